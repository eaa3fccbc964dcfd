"""GGUF metadata <-> configs: a llama.cpp target's `{arch}.*` keys as an HF config dict, and a `dflash` drafter's
keys <-> `DrafterConfig`. Both describe the same llama-style block with the same keys (`_attention_block`).

Targets (`llama`, `qwen2`, `qwen3`, `qwen35`): `target_hf_config` maps the metadata onto an HF `config.json` dict,
which `hf_config.target_config_from_hf` then reads as it reads any HF folder's (one set of refusals). The vocabulary
size comes from the embedding's rows, tying from the absence of `output.weight`, bos / eos from
`tokenizer.ggml.*_token_id`. `qwen35` (Qwen3.5 / 3.6 / 3.8 hybrid) adds `qwen35.ssm.conv_kernel`
(linear_conv_kernel_dim), `.ssm.state_size` (linear_key_head_dim), `.ssm.group_count` (linear_num_key_heads),
`.ssm.time_step_rank` (linear_num_value_heads), `.ssm.inner_size` (value heads x value head dim),
`.full_attention_interval` (every n-th layer is full attention, as HF's default `layer_types`) and
`.rope.dimension_count` (head_dim x partial_rotary_factor); `.rope.dimension_sections` (multimodal RoPE) is not
read: a text model's three position streams are equal, so sections do not change it. `block_count` counts the
multi-token-prediction layers the converter appends (`qwen35.nextn_predict_layers`); they are not decoder layers.

Drafters (`general.architecture = "dflash"`, llama.cpp's converter; see `gguf_drafter` for the tensors):
`dflash.target_layers` holds the HF layer id + 1. Checked against llama.cpp (ggml-org/llama.cpp, read with the
search tool, not copied): `common/speculative.cpp` @ 001d906a (`common_speculative_impl_draft_dflash`) arms each
stored id L with `llama_set_embeddings_layer_inp(ctx_tgt, L, true)`, the hidden state *entering* target layer L,
i.e. the output of layer L - 1, and takes L == the target's layer count as the pre-final-norm state (the last
layer's output); `src/models/dflash.cpp` @ 01b78a15 reads the array as it is. So HF's output of layer i
(`hidden_states[i + 1]`, our feature id i) is stored as L = i + 1, and a stored value must lie in 1..n_target. (An
older converter, `conversion/qwen.py` @ 03173d5e, wrote the HF ids unshifted; later ones write
`[i + 1 for i in target_layer_ids]`.) `dflash.mask_token_id` (or `tokenizer.ggml.mask_token_id`);
`dflash.block_size`; `dflash.attention.sliding_window` and `.sliding_window_pattern` (per layer, true = sliding):
llama.cpp (`src/models/dflash.cpp` @ 01b78a15) turns sliding-window attention on only for a window > 0 and reads the
pattern only then, so a window of 0 reads here as full attention in every layer; `dflash.sample_from_anchor`
(llama.cpp reads it only in DSpark mode, where true means slot k predicts token p+k+1; a DFlash drafter predicts
token p+k: written false, true refused); `dflash.attention.causal`; `dflash.embedding_scale`, `dflash.logit_scale`,
`dflash.final_logit_softcapping`; DFlash2 `dflash.conv_kernel_size`, `conv_group_size`, `selector_rank`,
`selector_top_k`. The engine's files carry no vocabulary size and no target depth (both come from the target at
run time): `drafter_metadata` also writes `dflash.vocab_size` and `dflash.target_block_count` (and
`dflash.draft_vocab_size` for a draft vocabulary), and `drafter_config_from_metadata` takes `vocab_size=` /
`num_target_layers=` for files without them (the vocabulary is otherwise read from `tokenizer.ggml.tokens` or the
selector codebooks).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dflash_jax.config import DFLASH2_REQUIRED, DrafterConfig, TargetConfig
from dflash_jax.io.errors import GGUFDrafterError
from dflash_jax.io.gguf import GGUFError, GGUFFile

# GGUF metadata value types (the container's numbering)
(T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64,
 T_FLOAT64) = range(13)

TARGET_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "qwen35": "Qwen3_5ForCausalLM"}
DRAFTER_ARCH = "dflash"
REQUIRED = object()  # `read(key, kind, REQUIRED)`: the key must be there

# read(key, kind, default=REQUIRED) -> the value as `kind` (int / float / str); each side checks types its own way
Reader = Callable[..., Any]


def _attention_block(read: Reader, arch: str, where) -> dict:
    """The llama-style block a GGUF target and a GGUF drafter describe with the same keys, as config fields:
    sizes, heads, RoPE base and linear scaling. A value length other than the key length, and RoPE scaling other
    than none / linear, are refused naming the key."""
    hidden = read(f"{arch}.embedding_length", int)
    heads = read(f"{arch}.attention.head_count", int)
    head_dim = read(f"{arch}.attention.key_length", int, hidden // heads)
    value_dim = read(f"{arch}.attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise NotImplementedError(f"{where}: metadata key '{arch}.attention.value_length' ({value_dim}) differs "
                                  f"from the key length ({head_dim}); not supported")
    factor = 1.0
    scaling = read(f"{arch}.rope.scaling.type", str, None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise NotImplementedError(f"{where}: metadata key '{arch}.rope.scaling.type' = {scaling!r} is not "
                                      "supported (none and linear are)")
        factor = read(f"{arch}.rope.scaling.factor", float)
    return dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=read(
        f"{arch}.attention.head_count_kv", int, heads), head_dim=head_dim,
        intermediate_size=read(f"{arch}.feed_forward_length", int),
        rope_theta=read(f"{arch}.rope.freq_base", float, 10000.0), rope_scaling_factor=factor)


# -- targets -----------------------------------------------------------------------------------------------------

def _file_reader(g: GGUFFile) -> Reader:
    """Typed reads through the container's checks (its errors name the key and the type it expected)."""
    def read(key, kind, default=REQUIRED):
        value = g.require(key, kind) if default is REQUIRED else g.get(key, default, kind)
        return value if value is None or kind is str else kind(value)
    return read


def target_hf_config(g: GGUFFile) -> dict:
    """An HF-style config dict from a GGUF target's metadata (see the module docstring)."""
    arch = g.architecture
    if arch not in TARGET_ARCHITECTURES:
        raise NotImplementedError(f"{g.path}: metadata key 'general.architecture' is {arch!r}; supported GGUF "
                                  f"architectures are {sorted(TARGET_ARCHITECTURES)}")
    read = _file_reader(g)
    block = _attention_block(read, arch, g.path)
    hidden, head_dim = block["hidden_size"], block["head_dim"]
    rope_dims = read(f"{arch}.rope.dimension_count", int, head_dim)
    if rope_dims != head_dim and arch != "qwen35":
        raise NotImplementedError(f"{g.path}: metadata key '{arch}.rope.dimension_count' ({rope_dims}) is not the "
                                  f"head dimension ({head_dim}): partial RoPE is not supported")
    embd = g.info("token_embd.weight")
    if len(embd.shape) != 2 or embd.shape[1] != hidden:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight' has shape {list(embd.shape)}, expected "
                        f"[vocab, {hidden}] ('{arch}.embedding_length')")
    if "rope_freqs.weight" in g.tensors:
        raise NotImplementedError(f"{g.path}: tensor 'rope_freqs.weight' (per-frequency RoPE scaling, llama 3.1 "
                                  "style) is not supported")
    factor = block.pop("rope_scaling_factor")
    mtp_layers = read(f"{arch}.nextn_predict_layers", int, 0) if arch == "qwen35" else 0
    d = {
        "architectures": [TARGET_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embd.shape[0]),
        **block,
        "num_hidden_layers": read(f"{arch}.block_count", int) - mtp_layers,
        "hidden_act": "silu",
        "rms_norm_eps": read(f"{arch}.attention.layer_norm_rms_epsilon", float),
        "rope_scaling": None if factor == 1.0 else {"rope_type": "linear", "factor": factor},
        "max_position_embeddings": read(f"{arch}.context_length", int),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": "float32",
    }
    if arch == "qwen35":
        d.update(_qwen35_config(g, read, head_dim, rope_dims))
    for field, meta in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                        ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if meta in g.metadata:
            d[field] = read(meta, int)
    return d


def _qwen35_config(g: GGUFFile, read: Reader, head_dim: int, rope_dims: int) -> dict:
    """The hybrid fields of a qwen35 file's HF config (Qwen3_5TextConfig names), from the `qwen35.ssm.*` keys."""
    n_v = read("qwen35.ssm.time_step_rank", int)
    n_k = read("qwen35.ssm.group_count", int)
    inner = read("qwen35.ssm.inner_size", int)
    if n_v <= 0 or n_k <= 0 or n_v % n_k or inner % n_v:
        raise GGUFError(f"{g.path}: metadata keys 'qwen35.ssm.time_step_rank' ({n_v} value heads), "
                        f"'qwen35.ssm.group_count' ({n_k} key heads) and 'qwen35.ssm.inner_size' ({inner}) do not "
                        "split into whole heads (key heads must divide value heads, value heads the inner size)")
    if rope_dims <= 0 or rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{g.path}: metadata key 'qwen35.rope.dimension_count' ({rope_dims}) must be an even number "
                        f"of dimensions up to the head dimension ({head_dim})")
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],
            "partial_rotary_factor": rope_dims / head_dim,
            "full_attention_interval": read("qwen35.full_attention_interval", int, 4),
            "linear_conv_kernel_dim": read("qwen35.ssm.conv_kernel", int),
            "linear_key_head_dim": read("qwen35.ssm.state_size", int),
            "linear_num_key_heads": n_k, "linear_num_value_heads": n_v, "linear_value_head_dim": inner // n_v}


# -- drafters ----------------------------------------------------------------------------------------------------

def _f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-6 stays 1e-6 through an F32 field)."""
    return float(str(np.float32(x)))


def drafter_metadata(cfg: DrafterConfig) -> list[tuple[str, int, Any]]:
    """(key, GGUF value type, value) in the order they are written; arrays as (T_ARRAY, (elem_type, values))."""
    m = cfg.model
    a = DRAFTER_ARCH
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
        kv += [(f"{a}.{k}", T_UINT32, getattr(cfg, k)) for k in DFLASH2_REQUIRED]
    for key, value in (("tokenizer.ggml.bos_token_id", m.bos_token_id), ("tokenizer.ggml.eos_token_id",
                                                                          m.eos_token_id)):
        if isinstance(value, int) and value >= 0:
            kv.append((key, T_UINT32, value))
    return kv


def _metadata_reader(meta: dict[str, Any], path) -> Reader:
    """Reads of a plain metadata dict; floats as the shortest decimal of their float32 (`_f32`)."""
    def read(key, kind, default=REQUIRED):
        if key not in meta:
            if default is REQUIRED:
                raise GGUFDrafterError(f"{path}: missing metadata {key!r}")
            return default
        v = meta[key]
        if kind is str:
            return v
        if isinstance(v, (list, str)) or (kind is int and isinstance(v, float)):
            raise GGUFDrafterError(f"{path}: metadata {key!r} must be a number, got {v!r}")
        return int(v) if kind is int else _f32(v)
    return read


def _vocab_size(meta: dict, tensors: dict, path, given) -> int:
    """Ours, the tokenizer's, the selector codebooks', or the caller's (which must agree with the file's)."""
    V = meta.get(f"{DRAFTER_ARCH}.vocab_size")
    if V is None and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        V = len(meta["tokenizer.ggml.tokens"])
    if V is None and "selector_predecessor.weight" in tensors:
        V = tensors["selector_predecessor.weight"].shape[0]
    if V is None:
        V = given
    elif given is not None and int(given) != int(V):
        raise GGUFDrafterError(f"{path}: vocab_size={given} given, the file says {V}")
    if V is None:
        raise GGUFDrafterError(f"{path}: no vocabulary size ({DRAFTER_ARCH}.vocab_size, tokenizer.ggml.tokens or "
                               "the selector codebooks); pass vocab_size= (the target's)")
    return int(V)


def _target_depth(meta: dict, path, given) -> int:
    n_target = meta.get(f"{DRAFTER_ARCH}.target_block_count", given)
    if n_target is None:
        raise GGUFDrafterError(f"{path}: no target depth ({DRAFTER_ARCH}.target_block_count); pass "
                               "num_target_layers= (the target's num_hidden_layers)")
    if given is not None and int(given) != int(n_target):
        raise GGUFDrafterError(f"{path}: num_target_layers={given} given, the file says {n_target}")
    return int(n_target)


def drafter_config_from_metadata(meta: dict[str, Any], tensors: dict, path, *, param_dtype: str,
                                 compute_dtype: str, vocab_size=None, num_target_layers=None) -> DrafterConfig:
    """A DrafterConfig from a `dflash` GGUF's metadata (+ tensor shapes for what only they tell)."""
    arch = meta.get("general.architecture")
    if arch != DRAFTER_ARCH:
        raise GGUFDrafterError(f"{path}: general.architecture is {arch!r}, not {DRAFTER_ARCH!r} (a DFlash drafter "
                               "GGUF)")
    a = DRAFTER_ARCH
    read = _metadata_reader(meta, path)
    if meta.get(f"{a}.sample_from_anchor"):
        raise NotImplementedError(f"{path}: {a}.sample_from_anchor = true (slot k predicts token p+k+1, the DSpark "
                                  "convention) is not supported; DFlash drafters predict token p+k")
    block = _attention_block(read, a, path)
    n_layers = read(f"{a}.block_count", int)
    target_hidden = meta.get(f"{a}.target_hidden_size")
    if target_hidden is not None and int(target_hidden) != block["hidden_size"]:
        raise NotImplementedError(f"{path}: {a}.target_hidden_size {target_hidden} differs from the drafter's "
                                  f"hidden size {block['hidden_size']} (a projected-feature drafter is not supported)")
    V = _vocab_size(meta, tensors, path, vocab_size)
    n_target = _target_depth(meta, path, num_target_layers)
    if f"{a}.target_layers" not in meta:
        raise GGUFDrafterError(f"{path}: missing metadata {a + '.target_layers'!r}")
    stored = meta[f"{a}.target_layers"]
    if not isinstance(stored, list) or not stored or not all(isinstance(i, int) for i in stored):
        raise GGUFDrafterError(f"{path}: {a}.target_layers must be a non-empty integer array, got {stored!r}")
    # n_target itself is legal: llama.cpp reads it as the pre-final-norm state, the output of the last layer
    bad = [i for i in stored if not 1 <= i <= n_target]
    if bad:
        raise GGUFDrafterError(f"{path}: {a}.target_layers {bad} out of range: stored as HF layer id + 1, each must "
                               f"be in 1..{n_target} for a {n_target}-layer target (got {stored})")
    mask = meta.get(f"{a}.mask_token_id", meta.get("tokenizer.ggml.mask_token_id"))
    if mask is None:
        raise GGUFDrafterError(f"{path}: missing metadata {a}.mask_token_id (or tokenizer.ggml.mask_token_id)")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    model = TargetConfig(vocab_size=V, num_hidden_layers=n_layers, **block,
                         rms_norm_eps=read(f"{a}.attention.layer_norm_rms_epsilon", float, 1e-6),
                         max_position_embeddings=read(f"{a}.context_length", int, 40960),
                         bos_token_id=None if bos is None else int(bos), eos_token_id=None if eos is None else int(eos),
                         param_dtype=param_dtype, compute_dtype=compute_dtype)
    layer_types, window = _sliding_layers(meta, read, n_layers, path)
    kind = "dflash2" if f"{a}.conv_kernel_size" in meta or "selector_hidden.weight" in tensors else "dflash"
    extra = {k: read(f"{a}.{k}", int) for k in DFLASH2_REQUIRED} if kind == "dflash2" else {}
    causal = meta.get(f"{a}.attention.causal")
    block_size = read(f"{a}.block_size", int)
    try:
        return DrafterConfig(model=model, block_size=block_size, mask_token_id=int(mask),
                             target_layer_ids=tuple(i - 1 for i in stored), num_target_layers=n_target, kind=kind,
                             layer_types=layer_types, sliding_window=window,
                             is_causal=None if causal is None else bool(causal),
                             input_embedding_scale=read(f"{a}.embedding_scale", float, 1.0),
                             output_multiplier=read(f"{a}.logit_scale", float, 1.0),
                             final_logit_softcapping=meta.get(f"{a}.final_logit_softcapping") and
                             read(f"{a}.final_logit_softcapping", float),
                             draft_vocab_size=read(f"{a}.draft_vocab_size", int, None), **extra)
    except ValueError as e:
        raise GGUFDrafterError(f"{path}: {e}") from None


def _sliding_layers(meta: dict, read: Reader, n_layers: int, path) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding window) from the window and its per-layer pattern, as llama.cpp reads them."""
    a = DRAFTER_ARCH
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    window = meta.get(f"{a}.attention.sliding_window")
    if window is not None and read(f"{a}.attention.sliding_window", int) == 0:
        window = pattern = None  # llama.cpp: no sliding window unless it is > 0, and then no pattern is read
    layer_types = None
    if pattern is not None:
        if not isinstance(pattern, list) or len(pattern) != n_layers:
            raise GGUFDrafterError(f"{path}: {a}.attention.sliding_window_pattern must list one flag per layer "
                                   f"({n_layers}), got {pattern!r}")
        layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    if window is not None and layer_types is None:
        layer_types = ("sliding_attention",) * n_layers  # a window with no pattern: every layer slides
    return layer_types, None if window is None else int(window)


__all__ = ["target_hf_config", "drafter_metadata", "drafter_config_from_metadata", "TARGET_ARCHITECTURES",
           "DRAFTER_ARCH"]
