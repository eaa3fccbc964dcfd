"""A GGUF decoder (llama.cpp's `llama`, `qwen2`, `qwen3` architectures) seen as an HF checkpoint.

`hf_config(g)` maps the GGUF metadata onto an HF `config.json` dict and `hf_tensors(g)` maps the tensor names onto
HF's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), each a lazy `GGUFTensor` that decodes on
read. The loader then builds the Target exactly as it does from safetensors (shape checks, NaN checks, `mesh=`).

llama.cpp's converter permutes the rows of `attn_q` / `attn_k` for the `llama` architecture so that its RoPE rotates
adjacent pairs of dimensions; HF (and this project) rotate halves. Within each head the converter took rows
[2, head_dim / 2] and interleaved them; `GGUFTensor` undoes that (rows [head_dim / 2, 2] -> [2, head_dim / 2]).
Qwen2 / Qwen3 files are written unpermuted (their HF models already rotate halves in llama.cpp's NeoX mode).
"""

from __future__ import annotations

import re

import numpy as np

from dflash_jax.io.gguf import GGUFError, GGUFFile
from dflash_jax.io.lazy_array import LazyArray

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _rename(name: str, names: dict, layer_names: dict, layer_re: re.Pattern, layer_fmt: str) -> str | None:
    """`name` looked up in one direction of the tables above: a global name, or a layer name with its index."""
    if name in names:
        return names[name]
    m = layer_re.match(name)
    if m and m.group(2) in layer_names:
        return layer_fmt.format(int(m.group(1)), layer_names[m.group(2)])
    return None


# the same two tables seen from the HF side
_HF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor of these architectures, or None when it has none."""
    return _rename(gguf_name, _GLOBAL_NAMES, _LAYER_NAMES, _LAYER_RE, "model.layers.{}.{}")


def gguf_name(hf: str) -> str | None:
    """The inverse of `hf_name`."""
    return _rename(hf, _HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE, "blk.{}.{}")


def check_against(g: GGUFFile, tensors: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected HF tensor {name: shape} is in the file with that shape; errors name the GGUF tensor."""
    for hf, shape in expected.items():
        name = gguf_name(hf) or hf
        if hf not in tensors:
            raise GGUFError(f"{g.path}: tensor {name!r} is missing (the model's {hf}, shape {list(shape)})")
        if tuple(tensors[hf].shape) != tuple(shape):
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(tensors[hf].shape)} (numpy order), expected "
                            f"{list(shape)} for the model's {hf}")


def hf_config(g: GGUFFile) -> dict:
    """An HF-style config dict from the metadata (`{arch}.*` keys; vocabulary size from the embedding rows; tied
    when there is no `output.weight`; bos / eos from `tokenizer.ggml.*_token_id`)."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise NotImplementedError(f"{g.path}: metadata key 'general.architecture' is {arch!r}; supported GGUF "
                                  f"architectures are {sorted(ARCHITECTURES)}")

    def key(name, kind=int, default=None):
        return g.get(f"{arch}.{name}", default, kind) if default is not None else g.require(f"{arch}.{name}", kind)

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", int, n_heads))
    head_dim = int(key("attention.key_length", int, hidden // n_heads))
    value_dim = int(key("attention.value_length", int, head_dim))
    if value_dim != head_dim:
        raise NotImplementedError(f"{g.path}: metadata key '{arch}.attention.value_length' ({value_dim}) differs "
                                  f"from the key length ({head_dim}); not supported")
    rope_dims = int(key("rope.dimension_count", int, head_dim))
    if rope_dims != head_dim:
        raise NotImplementedError(f"{g.path}: metadata key '{arch}.rope.dimension_count' ({rope_dims}) is not the "
                                  f"head dimension ({head_dim}): partial RoPE is not supported")
    embd = g.info("token_embd.weight")
    if len(embd.shape) != 2 or embd.shape[1] != hidden:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected "
                        f"[vocab, {hidden}] ('{arch}.embedding_length')")
    rope_scaling = None
    scaling = g.get(f"{arch}.rope.scaling.type", None, str)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise NotImplementedError(f"{g.path}: metadata key '{arch}.rope.scaling.type' = {scaling!r} is not "
                                      "supported (none and linear are)")
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", float))}
    if "rope_freqs.weight" in g.tensors:
        raise NotImplementedError(f"{g.path}: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, llama 3.1 "
                                  "style) is not supported")
    d = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embd.shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(key("rope.freq_base", float, 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": "float32",
    }
    for field, meta in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                        ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if meta in g.metadata:
            d[field] = int(g.require(meta, int))
    return d


class GGUFTensor(LazyArray):
    """One GGUF tensor under its HF name and layout, not decoded yet: `read(index)` decodes (only the rows of the
    outermost axis that `index` selects, when it can) into float32; `np.asarray(t)` decodes it whole. `heads`: undo
    llama.cpp's Q/K row permutation for that many heads."""

    dtype = np.dtype(np.float32)

    def __init__(self, g: GGUFFile, name: str, heads: int | None = None):
        self.g, self.name, self.heads = g, name, heads
        self.info = g.info(name)
        self.shape = self.info.shape
        if heads is not None and (len(self.shape) != 2 or self.shape[0] % (2 * heads)):
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(self.shape)}, which cannot hold {heads} "
                            "heads of an even head dimension")

    def read(self, index=()) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if self.heads is None and index and isinstance(index[0], slice) and len(self.shape) > 1:
            return self.g.dequantize(self.name, np.float32, rows=index[0])[(slice(None),) + index[1:]]
        full = self.g.dequantize(self.name, np.float32)
        if self.heads is not None:
            rows, cols = full.shape
            full = full.reshape(self.heads, rows // self.heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        return full[index]

    def __repr__(self):
        return f"GGUFTensor({self.name}, {self.info.type_name}{list(self.shape)})"


def hf_tensors(g: GGUFFile, cfg: dict) -> dict[str, GGUFTensor]:
    """Every tensor of the file under its HF name (an unknown name, or one whose layer index is out of range, is an
    error naming it); llama's attn_q / attn_k come back un-permuted."""
    out: dict[str, GGUFTensor] = {}
    permute = cfg["model_type"] == "llama"
    for name in g.tensors:
        hf = hf_name(name)
        if hf is None:
            raise GGUFError(f"{g.path}: tensor {name!r} has no counterpart in a {cfg['model_type']} model")
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
            raise GGUFError(f"{g.path}: tensor {name!r} is beyond the {cfg['num_hidden_layers']} layers of "
                            f"'{cfg['model_type']}.block_count'")
        heads = None
        if permute and name.endswith(("attn_q.weight", "attn_q.bias")):
            heads = cfg["num_attention_heads"]
        elif permute and name.endswith(("attn_k.weight", "attn_k.bias")):
            heads = cfg["num_key_value_heads"]
        if heads is not None and name.endswith(".bias"):
            raise NotImplementedError(f"{g.path}: tensor {name!r}: permuted llama q/k biases are not supported")
        out[hf] = GGUFTensor(g, name, heads)
    return out


__all__ = ["hf_config", "hf_tensors", "hf_name", "gguf_name", "check_against", "GGUFTensor", "ARCHITECTURES"]
