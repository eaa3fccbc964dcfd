"""A GGUF decoder (llama.cpp's `llama`, `qwen2`, `qwen3`, `qwen35` architectures) loaded as a Target.

`gguf_config.target_hf_config(g)` maps the GGUF metadata onto an HF `config.json` dict and `hf_tensors(g, d)` maps
the tensor names onto HF's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), each a lazy
`GGUFTensor` that decodes on read. `load_target_gguf` then builds the Target exactly as from safetensors
(`hf_folder.params_from_hf`: shape checks, NaN checks, `mesh=`).

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
A file with multi-token-prediction layers (`qwen35.nextn_predict_layers`, counted in block_count after the decoder's,
as the converter's MTP mixin appends them) loads without them, with a warning (assumed from the converter; no such
file was at hand). The metadata keys are `gguf_config`'s docstring.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.gguf import GGUFError, GGUFFile
from dflash_jax.io.gguf_config import target_hf_config
from dflash_jax.io.hf_config import target_config_from_hf
from dflash_jax.io.hf_folder import dense_keys, params_from_hf
from dflash_jax.io.lazy_array import LazyArray
from dflash_jax.models.target import Target
from dflash_jax.params import abstract_target, is_linear_name, map_named, named_leaves
from dflash_jax.quant import ggml
from dflash_jax.quant.ggml import GGMLArray

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
        heads = {"attn_q.weight": cfg["num_attention_heads"], "attn_k.weight": cfg["num_key_value_heads"]}.get(
            name.split(".", 2)[-1]) if permute else None
        if heads is not None:
            rows = raw.shape[0]
            raw = raw.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
        out[hf] = ggml.from_blocks(raw, t.type_name, tuple(t.shape))
    return out


def load_target_gguf(path: Path, param_dtype: str, compute_dtype: str, mesh=None, *,
                     keep_blocks: bool = False) -> Target:
    """A Target from a llama.cpp GGUF file: config from the metadata, tensors decoded one at a time from the
    memory-mapped file into the storage dtype; any problem with the file is a CheckpointError naming it.
    keep_blocks: the linear weights and the embedding stored as Q4_0 / Q4_1 / Q8_0 stay those blocks (`GGMLArray`
    leaves, what the CPU kernel streams); every tensor is still decoded once on the way, which checks it for NaN."""
    try:
        g = GGUFFile(path)
        d = target_hf_config(g)
        tensors = hf_tensors(g, d)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    cfg = target_config_from_hf(d, param_dtype=param_dtype, compute_dtype=compute_dtype)
    abstract = abstract_target(cfg)
    try:
        check_against(g, tensors, {dense_keys("target", n)[0]: s.shape for n, s in named_leaves(abstract).items()})
        params = params_from_hf("target", path, abstract, cfg.storage_dtype, None, mesh=mesh, cfg=cfg,
                                tensors=tensors)
        if keep_blocks:
            keys = {dense_keys("target", n)[0] for n in named_leaves(abstract)
                    if is_linear_name(n) or n == "embed_tokens"}
            blocks = block_leaves(g, d, wanted=lambda hf: hf in keys)
            params = map_named(lambda n, x: blocks.get(dense_keys("target", n)[0], x), params)
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    return Target(params=params, config=cfg)


__all__ = ["load_target_gguf", "block_leaves", "BLOCK_TYPES", "hf_tensors", "hf_name", "gguf_name", "check_against",
           "GGUFTensor", "Converted"]
