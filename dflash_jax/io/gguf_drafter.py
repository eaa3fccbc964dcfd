"""DFlash and DFlash2 drafters as GGUF files in llama.cpp's layout (`general.architecture = "dflash"`), both ways.

Names and metadata follow llama.cpp's converter (`conversion/qwen.py` DFlashModel, `LLM_ARCH_DFLASH`, the DFlash2
tensors): `fc.weight`, `enc.output_norm.weight` (our `hidden_norm`), `output_norm.weight`, per layer `blk.N.attn_norm`,
`attn_{q,k,v,output}`, `attn_{q,k}_norm`, `ffn_norm`, `ffn_{gate,up,down}` (`.weight`), and for DFlash2
`blk.N.{attn,ffn}_conv_base` (no `.weight`: a raw [2, Kc, H] F32 tensor), `blk.N.{attn,ffn}_conv_proj.weight` and
`selector_{predecessor,successor,hidden}.weight`. Token embedding and LM head are the target's and are not stored.

An NVFP4 linear is `<base>.weight` of ggml type 40 with `<base>.scale` (F32 {1}, ModelOpt's `weight_scale_2`) and,
for W4A4, `<base>.input_scale`; reading builds the ModelOpt tensors (`weight`, `weight_scale`, `weight_scale_2`,
`input_scale`) and goes through `hf_folder.params_from_hf`, the same from-named path as an HF folder, so missing,
unexpected, mis-shaped and non-finite tensors are refused there with the same messages, before anything compiles.

The metadata (`dflash.*` keys) <-> DrafterConfig is `gguf_config`'s (`drafter_metadata`,
`drafter_config_from_metadata`).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from dflash_jax.config import DRAFTER_KINDS
from dflash_jax.io import gguf as gguf_io
from dflash_jax.io import gguf_nvfp4 as g4
from dflash_jax.io.errors import CheckpointError, GGUFDrafterError
from dflash_jax.io.gguf import GGUFFile
from dflash_jax.io.gguf_config import (T_ARRAY, T_BOOL, T_FLOAT32, T_FLOAT64, T_INT8, T_INT16, T_INT32, T_INT64,
                                       T_STRING, T_UINT8, T_UINT16, T_UINT32, T_UINT64, drafter_config_from_metadata,
                                       drafter_metadata)
from dflash_jax.io.hf_folder import dense_keys, params_from_hf
from dflash_jax.io.placement import loading_dtypes, shard_if
from dflash_jax.models.drafter import Drafter
from dflash_jax.params import abstract_drafter, is_linear_name, named_leaves
from dflash_jax.quant.nvfp4 import NVFP4Array

GGUF_MAGIC = gguf_io.MAGIC
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# ggml tensor types this module writes (ggml.h numbering, as gguf-py's GGMLQuantizationType); reading decodes every
# dense type `io/gguf.py` does (F32, F16, BF16, Q8_0, ...) and repacks NVFP4
F32, F16, BF16, NVFP4 = 0, 1, 30, g4.GGML_TYPE_NVFP4
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", NVFP4: "NVFP4"}
_ELEMENT_BYTES = {F32: 4, F16: 2, BF16: 2}

# how each numeric GGUF metadata value type is packed
_SCALAR_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
               T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}


# -- names -------------------------------------------------------------------------------------------------------

_LAYER = {
    "input_layernorm": "attn_norm.weight",
    "self_attn.q_proj": "attn_q.weight",
    "self_attn.k_proj": "attn_k.weight",
    "self_attn.v_proj": "attn_v.weight",
    "self_attn.o_proj": "attn_output.weight",
    "self_attn.q_norm": "attn_q_norm.weight",
    "self_attn.k_norm": "attn_k_norm.weight",
    "post_attention_layernorm": "ffn_norm.weight",
    "mlp.gate_proj": "ffn_gate.weight",
    "mlp.up_proj": "ffn_up.weight",
    "mlp.down_proj": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection": "ffn_conv_proj.weight",
}
_ROOT = {
    "fc": "fc.weight",
    "hidden_norm": "enc.output_norm.weight",
    "norm": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection": "selector_hidden.weight",
}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_ROOT_INV = {v: k for k, v in _ROOT.items()}


def gguf_name(param: str) -> str:
    """Our parameter name (`layers.3.self_attn.q_proj`) -> llama.cpp's tensor name (`blk.3.attn_q.weight`)."""
    if param in _ROOT:
        return _ROOT[param]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", param)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise GGUFDrafterError(f"parameter {param!r} has no llama.cpp DFlash tensor name")


def param_name(tensor: str) -> str | None:
    """llama.cpp's tensor name -> our parameter name, or None when it is not a DFlash drafter tensor."""
    if tensor in _ROOT_INV:
        return _ROOT_INV[tensor]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", tensor)
    if m and m.group(2) in _LAYER_INV:
        return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}"
    return None


def _base(tensor: str) -> str:
    return tensor[: -len(".weight")] if tensor.endswith(".weight") else tensor


# -- reading (the container is `io/gguf.py`'s GGUFFile) ------------------------------------------------------------

def _plain(value):
    """Metadata as plain Python (GGUFFile gives numeric arrays as numpy arrays)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file; container errors (truncation, overlap, unknown types) re-raised as GGUFDrafterError."""
    try:
        return GGUFFile(path)
    except gguf_io.GGUFError as e:
        raise GGUFDrafterError(str(e)) from None


def type_name(type_id: int) -> str:
    return TYPE_NAMES.get(type_id, str(type_id))


def _scalar_f32(g: GGUFFile, key: str, owner: str) -> np.ndarray:
    info = g.tensors[key]
    if info.type_id != F32 or int(np.prod(info.shape)) != 1:
        raise GGUFDrafterError(f"{g.path}: {key!r} (the per-tensor scale of {owner!r}) must be F32 of shape {{1}}, "
                               f"got {info.type_name} {list(info.shape)}")
    return g.dequantize(key).reshape(()).astype(np.float32)


def hf_tensors(g: GGUFFile) -> dict[str, np.ndarray]:
    """The drafter's tensors under the HF / ModelOpt names `hf_folder.params_from_hf` reads (NVFP4 repacked into
    ModelOpt's layout with `.scale` as weight_scale_2, dense ones decoded to float32); a tensor that is not a DFlash
    drafter tensor is an error."""
    path, tensors = g.path, g.tensors
    out: dict[str, np.ndarray] = {}
    quantized = {n for n, t in tensors.items() if t.type_id == NVFP4}
    for name, info in tensors.items():
        if name.endswith((".scale", ".input_scale")):
            owner = name[: -len(".input_scale")] if name.endswith(".input_scale") else name[: -len(".scale")]
            if owner + ".weight" not in quantized:
                raise GGUFDrafterError(f"{path}: tensor {name!r} is a per-tensor scale but {owner + '.weight'!r} is "
                                       "not an NVFP4 tensor")
            continue
        param = param_name(name)
        if param is None:
            raise GGUFDrafterError(f"{path}: unexpected tensor {name!r} (not a DFlash / DFlash2 drafter tensor; "
                                   "token embedding and output head belong to the target)")
        if info.type_id == NVFP4:
            base = _base(name)
            if not is_linear_name(param):
                raise GGUFDrafterError(f"{path}: {name!r} is NVFP4 but only linear weights may be (norms, codebooks "
                                       "and conv base kernels stay dense)")
            if len(info.shape) != 2:
                raise GGUFDrafterError(f"{path}: NVFP4 tensor {name!r} must be 2-D, got {list(info.shape)}")
            if base + ".scale" not in tensors:
                raise GGUFDrafterError(f"{path}: NVFP4 tensor {name!r} has no per-tensor scale {base + '.scale'!r}")
            rows, k = info.shape
            packed, block_scale = g4.from_gguf_blocks(np.asarray(g.raw(name)), k, name=name)
            out[param + ".weight"] = packed.reshape(rows, k // 2)
            out[param + ".weight_scale"] = block_scale.reshape(rows, k // 16)
            out[param + ".weight_scale_2"] = _scalar_f32(g, base + ".scale", name)
            if base + ".input_scale" in tensors:
                out[param + ".input_scale"] = _scalar_f32(g, base + ".input_scale", name)
            continue
        out[dense_keys("drafter", param)[0]] = g.dequantize(name)  # F32 / F16 / BF16 / Q8_0 / ... -> float32
    return out


def load_drafter_gguf(path: str | Path, *, param_dtype: str | None = None, compute_dtype: str | None = None,
                      mesh=None, vocab_size: int | None = None, num_target_layers: int | None = None) -> Drafter:
    """A Drafter from a llama.cpp `dflash` GGUF (F32 / F16 / BF16 / Q8_0 / NVFP4 tensors). See the module doc.
    vocab_size / num_target_layers: the target's, for a file that does not record them."""
    path = Path(path)
    param_dtype, compute_dtype = loading_dtypes(param_dtype, compute_dtype)
    try:
        g = open_gguf(path)
        meta = {k: _plain(v) for k, v in g.metadata.items()}
        cfg = drafter_config_from_metadata(meta, g.tensors, path, vocab_size=vocab_size,
                                           num_target_layers=num_target_layers, param_dtype=param_dtype,
                                           compute_dtype=compute_dtype)
        hf = hf_tensors(g)
        params = params_from_hf("drafter", path, abstract_drafter(cfg), cfg.model.storage_dtype, None, tensors=hf)
    except g4.NVFP4LayoutError as e:
        raise GGUFDrafterError(f"{path}: {e}") from None
    except CheckpointError as e:
        if isinstance(e, GGUFDrafterError):
            raise
        raise GGUFDrafterError(str(e)) from None
    return shard_if(Drafter(params=params, config=cfg), mesh)


# -- container: writing ------------------------------------------------------------------------------------------

def _nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    n = int(np.prod(shape))
    if ggml_type == NVFP4:
        return n // g4.QK_NVFP4 * g4.BLOCK_BYTES
    return n * _ELEMENT_BYTES[ggml_type]


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_value(vtype: int, value) -> bytes:
    if vtype == T_STRING:
        return _pack_string(value)
    if vtype == T_ARRAY:
        etype, values = value
        return struct.pack("<IQ", etype, len(values)) + b"".join(_pack_value(etype, v) for v in values)
    return struct.pack(_SCALAR_FMT[vtype], value)


def _dense_bytes(name: str, x, dtype: str) -> tuple[int, np.ndarray]:
    arr = np.asarray(jax.device_get(x), np.float32)
    if dtype == "float32" or arr.ndim == 1 or name.endswith("base_kernel"):
        # norms and the conv base kernels stay F32, as llama.cpp's converter keeps 1-D tensors and the
        # engine adds the base kernel to F32 graph values
        return F32, arr
    if dtype == "float16":
        return F16, arr.astype(np.float16)
    if dtype == "bfloat16":
        return BF16, arr.astype(ml_dtypes.bfloat16)
    raise ValueError(f"save_gguf: dtype must be float32, float16 or bfloat16, got {dtype!r}")


def gguf_tensors(drafter: Drafter, dtype: str = "float32") -> list[tuple[str, tuple[int, ...], int, np.ndarray]]:
    """(GGUF name, numpy shape, ggml type, data) for every tensor `save_gguf` writes, in the engine's order."""
    out = []
    for name, leaf in named_leaves(drafter.params).items():
        tname = gguf_name(name)
        if isinstance(leaf, NVFP4Array):
            if len(leaf.shape) != 2:
                raise GGUFDrafterError(f"save_gguf: {name} is an NVFP4 tensor of rank {len(leaf.shape)} (GGUF: 2-D "
                                       "only)")
            rows, k = leaf.shape
            blocks = g4.to_gguf_blocks(np.asarray(leaf.packed), np.asarray(leaf.block_scale), name=tname)
            out.append((tname, (rows, k), NVFP4, blocks))
            base = _base(tname)
            out.append((base + ".scale", (1,), F32, np.asarray(leaf.global_scale, np.float32).reshape(1)))
            if leaf.input_scale is not None:
                out.append((base + ".input_scale", (1,), F32, np.asarray(leaf.input_scale, np.float32).reshape(1)))
        else:
            ggml_type, arr = _dense_bytes(name, leaf, dtype)
            out.append((tname, tuple(arr.shape), ggml_type, arr))
    return out


def save_gguf(path: str | Path, drafter: Drafter, *, dtype: str = "float32") -> Path:
    """Write a DFlash / DFlash2 drafter as a llama.cpp `dflash` GGUF (v3, 32-byte alignment).

    NVFP4 leaves become ggml type 40 tensors with `<name>.scale` (and `<name>.input_scale`): codes, block scales and
    tensor scales round-trip bit for bit through `load_drafter`. Dense linears are written in `dtype` (float32,
    float16 or bfloat16); norms and conv base kernels always in F32. The file is written to a temporary name and
    renamed, so a failed write leaves no half file under `path`."""
    if not isinstance(drafter, Drafter):
        raise TypeError(f"save_gguf() takes a Drafter, got {type(drafter).__name__}")
    if drafter.config.kind not in DRAFTER_KINDS:
        raise GGUFDrafterError(f"save_gguf: unknown drafter kind {drafter.config.kind!r}")
    path = Path(path)
    tensors = gguf_tensors(drafter, dtype)
    kv = drafter_metadata(drafter.config)
    header = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kv))]
    for key, vtype, value in kv:
        header.append(_pack_string(key) + struct.pack("<I", vtype) + _pack_value(vtype, value))
    offset, layout = 0, []
    for name, shape, ggml_type, data in tensors:
        nbytes = data.nbytes
        if nbytes != _nbytes(shape, ggml_type):
            raise GGUFDrafterError(f"save_gguf: {name} holds {nbytes} bytes, {TYPE_NAMES[ggml_type]} {list(shape)} "
                                   f"needs {_nbytes(shape, ggml_type)}")
        header.append(_pack_string(name) + struct.pack("<I", len(shape))
                      + b"".join(struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", ggml_type, offset))
        layout.append((offset, data))
        offset += -(-nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    head = b"".join(header)
    head += b"\0" * (-len(head) % DEFAULT_ALIGNMENT)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for off, data in layout:
            f.seek(len(head) + off)
            f.write(np.ascontiguousarray(data).tobytes())
        f.truncate(len(head) + offset)
    tmp.replace(path)
    return path


def patch_scales(path: str | Path, select, value: float) -> list[str]:
    """Overwrite, in place, every F32 {1} tensor whose name `select(name)` accepts with `value` (e.g. the attention
    `.scale` tensors with 1.0: the bug report replayed). Returns the names patched. For audits and benchmarks."""
    g = open_gguf(path)
    hits = [(t.name, t.offset) for n, t in g.tensors.items() if select(n) and t.type_id == F32 and t.nbytes == 4]
    del g
    with open(path, "r+b") as f:
        for _, offset in hits:
            f.seek(offset)
            f.write(np.float32(value).tobytes())
    return [n for n, _ in hits]


__all__ = ["save_gguf", "load_drafter_gguf", "open_gguf", "gguf_name", "param_name", "patch_scales", "type_name",
           "F32", "F16", "BF16", "NVFP4"]
