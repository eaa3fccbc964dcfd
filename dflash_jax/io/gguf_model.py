"""A GGUF decoder (llama.cpp's `llama`, `qwen2`, `qwen3` architectures) seen as an HF checkpoint.

`hf_config(g)` maps the GGUF metadata onto an HF `config.json` dict and `hf_tensors(g)` maps the tensor names onto
HF's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), each a lazy `GGUFTensor` that decodes on
read. The loader then builds the Target exactly as it does from safetensors (shape checks, NaN checks, `mesh=`).

llama.cpp's converter permutes the rows of `attn_q` / `attn_k` for the `llama` architecture so that its RoPE rotates
adjacent pairs of dimensions; HF (and this project) rotate halves. Within each head the converter took rows
[2, head_dim / 2] and interleaved them; `GGUFTensor` undoes that (rows [head_dim / 2, 2] -> [2, head_dim / 2]).
Qwen2 / Qwen3 files are written unpermuted (their HF models already rotate halves in llama.cpp's NeoX mode).

`qwen35` (Qwen3.5 / 3.6 / 3.8 hybrid targets, llama.cpp's `Qwen3_5TextModel` conversion of `Qwen3_5ForCausalLM` /
`Qwen3_5ForConditionalGeneration`; read from its source, gguf-py 0.19 names). The converter changes these tensors,
undone here on read (`_qwen35_reader`):
  * every zero-centred RMSNorm weight except the gated one (attn_norm, post_attention_norm, attn_q_norm, attn_k_norm,
    output_norm) is stored as 1 + w (llama.cpp multiplies by the weight): w = stored - 1; ssm_norm is as in HF;
  * A_log is stored as ssm_a = -exp(A_log): A_log = log(-ssm_a); dt_bias as `ssm_dt.bias`;
  * the conv1d weight [C, 1, K] is squeezed to [C, K];
  * with fewer key than value heads (r = nV / nK > 1), value heads go from HF's grouped order (the r value heads of
    key head 0, then of key head 1, ...) to a tiled one (value 0 of every key head, then value 1, ...), so that ggml
    can broadcast key heads with a plain repeat: the v rows of attn_qkv (q and k rows untouched), the v channels of
    ssm_conv1d, the rows of attn_gate (z), ssm_beta, ssm_alpha, ssm_a, ssm_dt and the columns of ssm_out.
  The full-attention q_proj (query and output gate interleaved per head) is written as is, as `attn_q`.
Metadata: `qwen35.ssm.conv_kernel` (linear_conv_kernel_dim), `.ssm.state_size` (linear_key_head_dim),
`.ssm.group_count` (linear_num_key_heads), `.ssm.time_step_rank` (linear_num_value_heads), `.ssm.inner_size`
(value heads x value head dim), `.full_attention_interval` (every n-th layer is full attention, as HF's default
`layer_types`), `.rope.dimension_count` (head_dim x partial_rotary_factor), `.rope.dimension_sections` (multimodal
RoPE; a text model's three position streams are equal, so sections do not change it and are not read). A file
with multi-token-prediction layers (`qwen35.nextn_predict_layers`, counted in block_count after the decoder's, as the
converter's MTP mixin appends them) loads without them, with a warning (assumed from the converter; no such file was
at hand).
"""

from __future__ import annotations

import re
import warnings

import numpy as np

from dflash_jax.io.gguf import GGUFError, GGUFFile
from dflash_jax.io.lazy_array import LazyArray
from dflash_jax.quant import ggml
from dflash_jax.quant.ggml import GGMLArray

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM"}

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
_QWEN35_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
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


def _layer_names(arch: str | None) -> dict:
    return _QWEN35_LAYER_NAMES if arch == "qwen35" else _LAYER_NAMES


# the same tables seen from the HF side
_HF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The HF tensor name of a GGUF tensor of architecture `arch` (None: the llama family), or None when it has
    none."""
    return _rename(gguf_name, _GLOBAL_NAMES, _layer_names(arch), _LAYER_RE, "model.layers.{}.{}")


def gguf_name(hf: str, arch: str | None = None) -> str | None:
    """The inverse of `hf_name`."""
    return _rename(hf, _HF_GLOBAL, {v: k for k, v in _layer_names(arch).items()}, _HF_LAYER_RE, "blk.{}.{}")


def check_against(g: GGUFFile, tensors: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected HF tensor {name: shape} is in the file with that shape; errors name the GGUF tensor."""
    for hf, shape in expected.items():
        name = gguf_name(hf, g.architecture) or hf
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
    if rope_dims != head_dim and arch != "qwen35":
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
        # qwen35: block_count includes the multi-token-prediction layers llama.cpp's converter appends
        "num_hidden_layers": int(key("block_count")) - (int(key("nextn_predict_layers", int, 0)) if arch == "qwen35"
                                                        else 0),
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
    if arch == "qwen35":
        d.update(_qwen35_config(g, key, head_dim, rope_dims))
    for field, meta in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                        ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if meta in g.metadata:
            d[field] = int(g.require(meta, int))
    return d


def _qwen35_config(g: GGUFFile, key, head_dim: int, rope_dims: int) -> dict:
    """The hybrid fields of a qwen35 file's HF config (Qwen3_5TextConfig names), from the `qwen35.ssm.*` keys."""
    n_v = int(key("ssm.time_step_rank"))
    n_k = int(key("ssm.group_count"))
    inner = int(key("ssm.inner_size"))
    if n_v <= 0 or n_k <= 0 or n_v % n_k or inner % n_v:
        raise GGUFError(f"{g.path}: metadata keys 'qwen35.ssm.time_step_rank' ({n_v} value heads), "
                        f"'qwen35.ssm.group_count' ({n_k} key heads) and 'qwen35.ssm.inner_size' ({inner}) do not "
                        "split into whole heads (key heads must divide value heads, value heads the inner size)")
    if rope_dims <= 0 or rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{g.path}: metadata key 'qwen35.rope.dimension_count' ({rope_dims}) must be an even number "
                        f"of dimensions up to the head dimension ({head_dim})")
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],
            "partial_rotary_factor": rope_dims / head_dim,
            "full_attention_interval": int(key("full_attention_interval", int, 4)),
            "linear_conv_kernel_dim": int(key("ssm.conv_kernel")), "linear_key_head_dim": int(key("ssm.state_size")),
            "linear_num_key_heads": n_k, "linear_num_value_heads": n_v, "linear_value_head_dim": inner // n_v}


def _untiled_heads(n_k: int, n_v: int) -> np.ndarray:
    """[nV]: HF's (grouped) value head g = h r + j sits at llama.cpp's tiled position j nK + h."""
    r = n_v // n_k
    h, j = np.divmod(np.arange(n_v), r)
    return j * n_k + h


def _rows_of_heads(heads: np.ndarray, head_dim: int) -> np.ndarray:
    return (heads[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


class Converted(LazyArray):
    """A GGUF tensor with llama.cpp's converter undone by `fn` (whole tensor in, numpy order): `read(index)` decodes
    the whole tensor, converts it and slices (these are one layer's DeltaNet tensors: small next to the MLPs)."""

    dtype = np.dtype(np.float32)

    def __init__(self, base: LazyArray, fn, shape: tuple[int, ...]):
        self.base, self.fn, self.shape = base, fn, tuple(shape)

    def read(self, index=()) -> np.ndarray:
        return self.fn(np.asarray(self.base, np.float32))[index]

    def __repr__(self):
        return f"Converted({self.base!r} -> {list(self.shape)})"


def _qwen35_reader(g: GGUFFile, name: str, t: "GGUFTensor", cfg: dict) -> LazyArray:
    """`t` (GGUF tensor `name` of a qwen35 file) with the converter's transforms undone (module docstring)."""
    suffix = _LAYER_RE.match(name).group(2) if _LAYER_RE.match(name) else name
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    heads = _untiled_heads(n_k, n_v)  # identity when nK == nV
    v_rows = _rows_of_heads(heads, dv)
    qkv_rows = np.concatenate([np.arange(2 * n_k * dk), 2 * n_k * dk + v_rows])
    shape = tuple(t.shape)

    def need(ndim: int, rows: int | None = None, cols: int | None = None):
        if len(shape) != ndim or (rows is not None and shape[0] != rows) or (cols is not None and shape[-1] != cols):
            want = [rows if rows is not None else "?"] + (["?"] * (ndim - 2)) + ([cols if cols is not None else "?"]
                                                                                 if ndim > 1 else [])
            raise GGUFError(f"{g.path}: tensor {name!r} has shape {list(shape)} (numpy order), expected "
                            f"{want[:ndim]} from the ssm metadata")

    if suffix in ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight") \
            or name == "output_norm.weight":
        return Converted(t, lambda x: x - 1.0, shape)  # stored 1 + w
    if suffix == "ssm_a":
        need(1, n_v)
        return Converted(t, lambda x: np.log(-x)[heads], shape)  # stored -exp(A_log), tiled
    if suffix == "ssm_dt.bias":
        need(1, n_v)
        return Converted(t, lambda x: x[heads], shape)
    if suffix in ("ssm_beta.weight", "ssm_alpha.weight"):
        need(2, n_v)
        return Converted(t, lambda x: x[heads], shape)
    if suffix == "attn_gate.weight":
        need(2, n_v * dv)
        return Converted(t, lambda x: x[v_rows], shape)
    if suffix == "ssm_out.weight":
        need(2, None, n_v * dv)
        return Converted(t, lambda x: x[:, v_rows], shape)
    if suffix == "attn_qkv.weight":
        need(2, len(qkv_rows))
        return Converted(t, lambda x: x[qkv_rows], shape)
    if suffix == "ssm_conv1d.weight":  # stored squeezed [C, K]; its kernel size is checked against the metadata later
        need(2, len(qkv_rows))
        return Converted(t, lambda x: x[qkv_rows][:, None, :], (shape[0], 1, shape[1]))
    return t


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


def hf_tensors(g: GGUFFile, cfg: dict) -> dict[str, LazyArray]:
    """Every tensor of the file under its HF name (an unknown name, or one whose layer index is out of range, is an
    error naming it); llama's attn_q / attn_k come back un-permuted, qwen35's tensors converted back to HF's."""
    out: dict[str, LazyArray] = {}
    permute = cfg["model_type"] == "llama"
    arch = g.architecture
    n_blocks = int(g.get(f"{arch}.block_count", cfg["num_hidden_layers"], int))
    skipped: list[str] = []
    for name in g.tensors:
        m = _LAYER_RE.match(name)
        if m and arch == "qwen35" and cfg["num_hidden_layers"] <= int(m.group(1)) < n_blocks:
            skipped.append(name)  # a multi-token-prediction layer (`qwen35.nextn_predict_layers`): not run
            continue
        hf = hf_name(name, arch)
        if hf is None:
            raise GGUFError(f"{g.path}: tensor {name!r} has no counterpart in a {cfg['model_type']} model")
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
        if arch == "qwen35":
            out[hf] = _qwen35_reader(g, name, out[hf], cfg)
    if skipped:
        warnings.warn(f"{g.path}: {len(skipped)} tensors of the {n_blocks - cfg['num_hidden_layers']} "
                      "multi-token-prediction layers were skipped (the text decoder does not run them)", stacklevel=3)
    return out


__all__ = ["hf_config", "hf_tensors", "hf_name", "gguf_name", "check_against", "GGUFTensor", "Converted",
           "ARCHITECTURES"]


BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # kept as the file's own blocks (`quant.ggml.GGMLArray`) by `block_leaves`


def block_leaves(g: GGUFFile, cfg: dict, wanted) -> dict[str, GGMLArray]:
    """{HF name: GGMLArray} for the file's 2-D Q4_0 / Q4_1 / Q8_0 tensors whose HF name `wanted(name)` accepts (the
    linear weights and the embedding): their blocks as stored, rows permuted back for llama's attn_q / attn_k as
    `GGUFTensor` does (a row carries its own blocks, so the permutation moves whole rows)."""
    out = {}
    permute = cfg["model_type"] == "llama"
    for name in g.tensors:
        t = g.info(name)
        hf = hf_name(name, g.architecture)
        if hf is None or len(t.shape) != 2 or t.type_name not in BLOCK_TYPES or not wanted(hf):
            continue
        raw = np.asarray(g.raw(name))  # [rows, row bytes]
        heads = None
        if permute and name.endswith("attn_q.weight"):
            heads = cfg["num_attention_heads"]
        elif permute and name.endswith("attn_k.weight"):
            heads = cfg["num_key_value_heads"]
        if heads is not None:
            rows = raw.shape[0]
            raw = raw.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        out[hf] = ggml.from_blocks(raw, t.type_name, tuple(t.shape))
    return out
