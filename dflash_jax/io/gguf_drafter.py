"""DFlash and DFlash2 drafters as GGUF files in llama.cpp's layout (`general.architecture = "dflash"`), both ways.

Names and metadata follow llama.cpp's converter (`conversion/qwen.py` DFlashModel, `LLM_ARCH_DFLASH`, the DFlash2
tensors): `fc.weight`, `enc.output_norm.weight` (our `hidden_norm`), `output_norm.weight`, per layer `blk.N.attn_norm`,
`attn_{q,k,v,output}`, `attn_{q,k}_norm`, `ffn_norm`, `ffn_{gate,up,down}` (`.weight`), and for DFlash2
`blk.N.{attn,ffn}_conv_base` (no `.weight`: a raw [2, Kc, H] F32 tensor), `blk.N.{attn,ffn}_conv_proj.weight` and
`selector_{predecessor,successor,hidden}.weight`. Token embedding and LM head are the target's and are not stored.

An NVFP4 linear is `<base>.weight` of ggml type 40 with `<base>.scale` (F32 {1}, ModelOpt's `weight_scale_2`) and,
for W4A4, `<base>.input_scale`; reading builds the ModelOpt tensors (`weight`, `weight_scale`, `weight_scale_2`,
`input_scale`) and goes through `checkpoint._params_from_hf`, the same from-named path as an HF folder, so missing,
unexpected, mis-shaped and non-finite tensors are refused there with the same messages, before anything compiles.

Metadata: `dflash.target_layers` holds the HF layer id + 1. Checked against llama.cpp (ggml-org/llama.cpp, read with
the search tool, not copied): `common/speculative.cpp` @ 001d906a (`common_speculative_impl_draft_dflash`) arms each
stored id L with `llama_set_embeddings_layer_inp(ctx_tgt, L, true)`, the hidden state *entering* target layer L, i.e.
the output of layer L - 1, and takes L == the target's layer count as the pre-final-norm state (the last layer's
output); `src/models/dflash.cpp` @ 01b78a15 reads the array as it is. So HF's output of layer i (`hidden_states[i +
1]`, our feature id i) is stored as L = i + 1, and a stored value must lie in 1..n_target. (An older converter,
`conversion/qwen.py` @ 03173d5e, wrote the HF ids unshifted; later ones write `[i + 1 for i in target_layer_ids]`.)
`dflash.mask_token_id` (or `tokenizer.ggml.mask_token_id`); `dflash.block_size`; `dflash.attention.sliding_window`
and `.sliding_window_pattern` (per layer, true = sliding): llama.cpp (`src/models/dflash.cpp` @ 01b78a15) turns
sliding-window attention on only for a window > 0 and reads the pattern only then, so a window of 0 reads here as
full attention in every layer; `dflash.sample_from_anchor` (llama.cpp reads it only in DSpark mode, where true
means slot k predicts token p+k+1; a DFlash drafter predicts token p+k: written false, true refused);
`dflash.attention.causal`; `dflash.embedding_scale`, `dflash.logit_scale`, `dflash.final_logit_softcapping`;
DFlash2 `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`. The engine's files carry no
vocabulary size and no target depth (both come from the target at run time): `save_gguf` also writes
`dflash.vocab_size` and `dflash.target_block_count` (and `dflash.draft_vocab_size` for a draft vocabulary), and `load_drafter` takes `vocab_size=` / `num_target_layers=`
for files without them (the vocabulary is otherwise read from `tokenizer.ggml.tokens` or the selector codebooks).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from dflash_jax.config import DRAFTER_KINDS, DrafterConfig, TargetConfig
from dflash_jax.io import gguf as gguf_io
from dflash_jax.io import gguf_nvfp4 as g4
from dflash_jax.io.gguf import GGUFFile, is_gguf
from dflash_jax.io import checkpoint
from dflash_jax.io.checkpoint import CheckpointError, _dense_keys, _dtypes, _params_from_hf
from dflash_jax.models.drafter import Drafter
from dflash_jax.params import abstract_drafter, is_linear_name, named_leaves
from dflash_jax.quant.nvfp4 import NVFP4Array

ARCH = "dflash"
GGUF_MAGIC = gguf_io.MAGIC
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# ggml tensor types this module writes (ggml.h numbering, as gguf-py's GGMLQuantizationType); reading decodes every
# dense type `io/gguf.py` does (F32, F16, BF16, Q8_0, ...) and repacks NVFP4
F32, F16, BF16, NVFP4 = 0, 1, 30, g4.GGML_TYPE_NVFP4
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", NVFP4: "NVFP4"}
_ELEMENT_BYTES = {F32: 4, F16: 2, BF16: 2}

# GGUF metadata value types
(T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64,
 T_FLOAT64) = range(13)
_SCALAR_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
               T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}


class GGUFError(gguf_io.GGUFError, CheckpointError):
    """A GGUF file that cannot be a drafter; the message names the file and the tensor or key."""


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
    raise GGUFError(f"parameter {param!r} has no llama.cpp DFlash tensor name")


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


# -- metadata ----------------------------------------------------------------------------------------------------

def _f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-6 stays 1e-6 through an F32 field)."""
    return float(str(np.float32(x)))


def config_metadata(cfg: DrafterConfig) -> list[tuple[str, int, Any]]:
    """(key, GGUF value type, value) in the order they are written; arrays as (T_ARRAY, (elem_type, values))."""
    m = cfg.model
    a = ARCH
    kv: list[tuple[str, int, Any]] = [
        ("general.architecture", T_STRING, a),
        ("general.name", T_STRING, f"dflash-jax {cfg.kind} drafter"),
        (f"{a}.block_count", T_UINT32, m.num_hidden_layers),
        (f"{a}.context_length", T_UINT32, m.max_position_embeddings),
        (f"{a}.embedding_length", T_UINT32, m.hidden_size),
        (f"{a}.feed_forward_length", T_UINT32, m.intermediate_size),
        (f"{a}.attention.head_count", T_UINT32, m.num_attention_heads),
        (f"{a}.attention.head_count_kv", T_UINT32, m.num_key_value_heads),
        (f"{a}.attention.key_length", T_UINT32, m.head_dim),
        (f"{a}.attention.value_length", T_UINT32, m.head_dim),
        (f"{a}.attention.layer_norm_rms_epsilon", T_FLOAT32, m.rms_norm_eps),
        (f"{a}.rope.freq_base", T_FLOAT32, m.rope_theta),
        (f"{a}.rope.dimension_count", T_UINT32, m.head_dim),
    ]
    if m.rope_scaling_factor != 1.0:
        kv += [(f"{a}.rope.scaling.type", T_STRING, "linear"),
               (f"{a}.rope.scaling.factor", T_FLOAT32, m.rope_scaling_factor)]
    kv += [
        (f"{a}.block_size", T_UINT32, cfg.block_size),
        # llama.cpp's layer-input ids: HF layer i's output enters layer i + 1 (module docstring, speculative.cpp)
        (f"{a}.target_layers", T_ARRAY, (T_INT32, [i + 1 for i in cfg.target_layer_ids])),
        (f"{a}.target_hidden_size", T_UINT32, m.hidden_size),
        (f"{a}.target_block_count", T_UINT32, cfg.num_target_layers),
        (f"{a}.vocab_size", T_UINT32, m.vocab_size),
        (f"{a}.mask_token_id", T_UINT32, cfg.mask_token_id),
        (f"{a}.sample_from_anchor", T_BOOL, False),
    ]
    if cfg.is_causal is not None:
        kv.append((f"{a}.attention.causal", T_BOOL, cfg.is_causal))
    if cfg.sliding_window is not None:
        kv.append((f"{a}.attention.sliding_window", T_UINT32, cfg.sliding_window))
    if cfg.layer_types is not None:
        kv.append((f"{a}.attention.sliding_window_pattern", T_ARRAY,
                   (T_BOOL, [t == "sliding_attention" for t in cfg.layer_types])))
    if cfg.input_embedding_scale != 1.0:
        kv.append((f"{a}.embedding_scale", T_FLOAT32, cfg.input_embedding_scale))
    if cfg.output_multiplier != 1.0:
        kv.append((f"{a}.logit_scale", T_FLOAT32, cfg.output_multiplier))
    if cfg.final_logit_softcapping is not None:
        kv.append((f"{a}.final_logit_softcapping", T_FLOAT32, cfg.final_logit_softcapping))
    if cfg.draft_vocab_size is not None:  # this project's key (llama.cpp ignores it and drafts over all ids)
        kv.append((f"{a}.draft_vocab_size", T_UINT32, cfg.draft_vocab_size))
    if cfg.is_dflash2:
        kv += [(f"{a}.conv_kernel_size", T_UINT32, cfg.conv_kernel_size),
               (f"{a}.conv_group_size", T_UINT32, cfg.conv_group_size),
               (f"{a}.selector_rank", T_UINT32, cfg.selector_rank),
               (f"{a}.selector_top_k", T_UINT32, cfg.selector_top_k)]
    for key, value in (("tokenizer.ggml.bos_token_id", m.bos_token_id), ("tokenizer.ggml.eos_token_id",
                                                                          m.eos_token_id)):
        if isinstance(value, int) and value >= 0:
            kv.append((key, T_UINT32, value))
    return kv


def config_from_metadata(meta: dict[str, Any], tensors: dict, path, *, vocab_size=None,
                         num_target_layers=None, param_dtype=None, compute_dtype=None) -> DrafterConfig:
    """A DrafterConfig from a `dflash` GGUF's metadata (+ tensor shapes for what only they tell)."""
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path}: general.architecture is {arch!r}, not {ARCH!r} (a DFlash drafter GGUF)")
    a = ARCH

    def need(key):
        if key not in meta:
            raise GGUFError(f"{path}: missing metadata {key!r}")
        return meta[key]

    def num(key, default=None, kind=int):
        if key not in meta:
            if default is None:
                raise GGUFError(f"{path}: missing metadata {key!r}")
            return default
        v = meta[key]
        if isinstance(v, (list, str)) or (kind is int and isinstance(v, float)):
            raise GGUFError(f"{path}: metadata {key!r} must be a number, got {v!r}")
        return kind(v) if kind is int else _f32(v)

    if meta.get(f"{a}.sample_from_anchor"):
        raise NotImplementedError(f"{path}: {a}.sample_from_anchor = true (slot k predicts token p+k+1, the DSpark "
                                  "convention) is not supported; DFlash drafters predict token p+k")
    H = num(f"{a}.embedding_length")
    n_layers = num(f"{a}.block_count")
    target_hidden = meta.get(f"{a}.target_hidden_size")
    if target_hidden is not None and int(target_hidden) != H:
        raise NotImplementedError(f"{path}: {a}.target_hidden_size {target_hidden} differs from the drafter's "
                                  f"hidden size {H} (a projected-feature drafter is not supported)")
    # vocabulary: ours, the tokenizer's, the selector codebooks', or the caller's
    V = meta.get(f"{a}.vocab_size")
    if V is None and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        V = len(meta["tokenizer.ggml.tokens"])
    if V is None and "selector_predecessor.weight" in tensors:
        V = tensors["selector_predecessor.weight"].shape[0]
    if V is None:
        V = vocab_size
    elif vocab_size is not None and int(vocab_size) != int(V):
        raise GGUFError(f"{path}: vocab_size={vocab_size} given, the file says {V}")
    if V is None:
        raise GGUFError(f"{path}: no vocabulary size ({a}.vocab_size, tokenizer.ggml.tokens or the selector "
                        "codebooks); pass vocab_size= (the target's)")
    n_target = meta.get(f"{a}.target_block_count", num_target_layers)
    if n_target is None:
        raise GGUFError(f"{path}: no target depth ({a}.target_block_count); pass num_target_layers= (the target's "
                        "num_hidden_layers)")
    if num_target_layers is not None and int(num_target_layers) != int(n_target):
        raise GGUFError(f"{path}: num_target_layers={num_target_layers} given, the file says {n_target}")
    n_target = int(n_target)
    stored = need(f"{a}.target_layers")
    if not isinstance(stored, list) or not stored or not all(isinstance(i, int) for i in stored):
        raise GGUFError(f"{path}: {a}.target_layers must be a non-empty integer array, got {stored!r}")
    # n_target itself is legal: llama.cpp reads it as the pre-final-norm state, the output of the last layer
    bad = [i for i in stored if not 1 <= i <= n_target]
    if bad:
        raise GGUFError(f"{path}: {a}.target_layers {bad} out of range: stored as HF layer id + 1, each must be in "
                        f"1..{n_target} for a {n_target}-layer target (got {stored})")
    mask = meta.get(f"{a}.mask_token_id", meta.get("tokenizer.ggml.mask_token_id"))
    if mask is None:
        raise GGUFError(f"{path}: missing metadata {a}.mask_token_id (or tokenizer.ggml.mask_token_id)")
    factor = 1.0
    if f"{a}.rope.scaling.type" in meta:
        kind = meta[f"{a}.rope.scaling.type"]
        if kind == "linear":
            factor = num(f"{a}.rope.scaling.factor", kind=float)
        elif kind != "none":
            raise NotImplementedError(f"{path}: {a}.rope.scaling.type {kind!r} is not supported (linear)")
    heads = num(f"{a}.attention.head_count")
    head_dim = num(f"{a}.attention.key_length", H // heads)
    if num(f"{a}.attention.value_length", head_dim) != head_dim:
        raise NotImplementedError(f"{path}: {a}.attention.value_length differs from key_length")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    param_dtype, compute_dtype = _dtypes(param_dtype, compute_dtype)
    model = TargetConfig(vocab_size=int(V), hidden_size=H, intermediate_size=num(f"{a}.feed_forward_length"),
                        num_hidden_layers=n_layers, num_attention_heads=heads,
                        num_key_value_heads=num(f"{a}.attention.head_count_kv", heads), head_dim=head_dim,
                        rms_norm_eps=num(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, float),
                        rope_theta=num(f"{a}.rope.freq_base", 10000.0, float), rope_scaling_factor=factor,
                        max_position_embeddings=num(f"{a}.context_length", 40960),
                        bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
                        param_dtype=param_dtype, compute_dtype=compute_dtype)
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    window = meta.get(f"{a}.attention.sliding_window")
    if window is not None and num(f"{a}.attention.sliding_window") == 0:
        window = pattern = None  # llama.cpp: no sliding window unless it is > 0, and then no pattern is read
    layer_types = None
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != n_layers:
            raise GGUFError(f"{path}: {a}.attention.sliding_window_pattern must list one flag per layer "
                            f"({n_layers}), got {pattern!r}")
        layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    if window is not None and layer_types is None:
        layer_types = ("sliding_attention",) * n_layers  # a window with no pattern: every layer slides
    kind = "dflash2" if f"{a}.conv_kernel_size" in meta or "selector_hidden.weight" in tensors else "dflash"
    extra = {}
    if kind == "dflash2":
        extra = {k: num(f"{a}.{k}") for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k")}
    causal = meta.get(f"{a}.attention.causal")
    try:
        return DrafterConfig(model=model, block_size=num(f"{a}.block_size"), mask_token_id=int(mask),
                             target_layer_ids=tuple(i - 1 for i in stored), num_target_layers=n_target, kind=kind,
                             layer_types=layer_types, sliding_window=None if window is None else int(window),
                             is_causal=None if causal is None else bool(causal),
                             input_embedding_scale=num(f"{a}.embedding_scale", 1.0, float),
                             output_multiplier=num(f"{a}.logit_scale", 1.0, float),
                             final_logit_softcapping=meta.get(f"{a}.final_logit_softcapping") and
                             num(f"{a}.final_logit_softcapping", kind=float),
                             draft_vocab_size=num(f"{a}.draft_vocab_size") if f"{a}.draft_vocab_size" in meta
                             else None,
                             **extra)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from None


# -- reading (the container is `io/gguf.py`'s GGUFFile) ------------------------------------------------------------

def _plain(value):
    """Metadata as plain Python (GGUFFile gives numeric arrays as numpy arrays)."""
    return value.tolist() if isinstance(value, np.ndarray) else value


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file; container errors (truncation, overlap, unknown types) re-raised as this module's GGUFError."""
    try:
        return GGUFFile(path)
    except gguf_io.GGUFError as e:
        raise GGUFError(str(e)) from None


def type_name(type_id: int) -> str:
    return TYPE_NAMES.get(type_id, str(type_id))


def _scalar_f32(g: GGUFFile, key: str, owner: str) -> np.ndarray:
    info = g.tensors[key]
    if info.type_id != F32 or int(np.prod(info.shape)) != 1:
        raise GGUFError(f"{g.path}: {key!r} (the per-tensor scale of {owner!r}) must be F32 of shape {{1}}, got "
                        f"{info.type_name} {list(info.shape)}")
    return g.dequantize(key).reshape(()).astype(np.float32)


def hf_tensors(g: GGUFFile) -> dict[str, np.ndarray]:
    """The drafter's tensors under the HF / ModelOpt names `checkpoint._params_from_hf` reads (NVFP4 repacked into
    ModelOpt's layout with `.scale` as weight_scale_2, dense ones decoded to float32); a tensor that is not a DFlash
    drafter tensor is an error."""
    path, tensors = g.path, g.tensors
    out: dict[str, np.ndarray] = {}
    quantized = {n for n, t in tensors.items() if t.type_id == NVFP4}
    for name, info in tensors.items():
        if name.endswith((".scale", ".input_scale")):
            owner = name[: -len(".input_scale")] if name.endswith(".input_scale") else name[: -len(".scale")]
            if owner + ".weight" not in quantized:
                raise GGUFError(f"{path}: tensor {name!r} is a per-tensor scale but {owner + '.weight'!r} is not an "
                                "NVFP4 tensor")
            continue
        param = param_name(name)
        if param is None:
            raise GGUFError(f"{path}: unexpected tensor {name!r} (not a DFlash / DFlash2 drafter tensor; token "
                            "embedding and output head belong to the target)")
        if info.type_id == NVFP4:
            base = _base(name)
            if not is_linear_name(param):
                raise GGUFError(f"{path}: {name!r} is NVFP4 but only linear weights may be (norms, codebooks and "
                                "conv base kernels stay dense)")
            if len(info.shape) != 2:
                raise GGUFError(f"{path}: NVFP4 tensor {name!r} must be 2-D, got {list(info.shape)}")
            if base + ".scale" not in tensors:
                raise GGUFError(f"{path}: NVFP4 tensor {name!r} has no per-tensor scale {base + '.scale'!r}")
            rows, k = info.shape
            packed, block_scale = g4.from_gguf_blocks(np.asarray(g.raw(name)), k, name=name)
            out[param + ".weight"] = packed.reshape(rows, k // 2)
            out[param + ".weight_scale"] = block_scale.reshape(rows, k // 16)
            out[param + ".weight_scale_2"] = _scalar_f32(g, base + ".scale", name)
            if base + ".input_scale" in tensors:
                out[param + ".input_scale"] = _scalar_f32(g, base + ".input_scale", name)
            continue
        out[_dense_keys("drafter", param)[0]] = g.dequantize(name)  # F32 / F16 / BF16 / Q8_0 / ... -> float32
    return out


def load_drafter_gguf(path: str | Path, *, param_dtype: str | None = None, compute_dtype: str | None = None,
                      mesh=None, vocab_size: int | None = None, num_target_layers: int | None = None) -> Drafter:
    """A Drafter from a llama.cpp `dflash` GGUF (F32 / F16 / BF16 / Q8_0 / NVFP4 tensors). See the module doc."""
    path = Path(path)
    try:
        g = open_gguf(path)
        meta = {k: _plain(v) for k, v in g.metadata.items()}
        cfg = config_from_metadata(meta, g.tensors, path, vocab_size=vocab_size, num_target_layers=num_target_layers,
                                   param_dtype=param_dtype, compute_dtype=compute_dtype)
        hf = hf_tensors(g)
        params = _params_from_hf("drafter", path, abstract_drafter(cfg), cfg.model.storage_dtype, None,
                                 tensors=hf)
    except g4.NVFP4LayoutError as e:
        raise GGUFError(f"{path}: {e}") from None
    except CheckpointError as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(str(e)) from None
    return checkpoint._maybe_shard(Drafter(params=params, config=cfg), mesh)


def load_drafter(path: str | Path, *, param_dtype: str | None = None, compute_dtype: str | None = None, mesh=None,
                 vocab_size: int | None = None, num_target_layers: int | None = None) -> Drafter:
    """`checkpoint.load_drafter` (HF / z-lab / ModelOpt folder, or a `save` folder), or a llama.cpp `dflash` GGUF
    file (recognised by its magic). vocab_size / num_target_layers: only for a GGUF that does not record them."""
    if is_gguf(path):
        return load_drafter_gguf(path, param_dtype=param_dtype, compute_dtype=compute_dtype, mesh=mesh,
                                 vocab_size=vocab_size, num_target_layers=num_target_layers)
    if vocab_size is not None or num_target_layers is not None:
        raise TypeError("vocab_size / num_target_layers apply to GGUF drafters only")
    return checkpoint.load_drafter(path, param_dtype=param_dtype, compute_dtype=compute_dtype, mesh=mesh)


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
                raise GGUFError(f"save_gguf: {name} is an NVFP4 tensor of rank {len(leaf.shape)} (GGUF: 2-D only)")
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
        raise GGUFError(f"save_gguf: unknown drafter kind {drafter.config.kind!r}")
    path = Path(path)
    tensors = gguf_tensors(drafter, dtype)
    kv = config_metadata(drafter.config)
    header = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(kv))]
    for key, vtype, value in kv:
        header.append(_pack_string(key) + struct.pack("<I", vtype) + _pack_value(vtype, value))
    offset, layout = 0, []
    for name, shape, ggml_type, data in tensors:
        nbytes = data.nbytes
        if nbytes != _nbytes(shape, ggml_type):
            raise GGUFError(f"save_gguf: {name} holds {nbytes} bytes, {TYPE_NAMES[ggml_type]} {list(shape)} needs "
                            f"{_nbytes(shape, ggml_type)}")
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


__all__ = ["save_gguf", "load_drafter", "load_drafter_gguf", "open_gguf", "gguf_name", "param_name", "config_metadata",
           "config_from_metadata", "GGUFError", "is_gguf", "patch_scales"]
