"""Frozen, hashable model configs and their validation (reading them from files is `dflash_jax.io`'s job:
`io/hf_config.py`, `io/zlab_config.py`, `io/gguf_config.py`).

Configs are static under `jax.jit`: they are registered as static pytree metadata of the model dataclasses, so
every field must be hashable (tuples, not lists). Storage dtype (how weights live in memory) and compute dtype (what
the matmuls run in) are separate choices: bf16 weights computed in f32 on CPU, where XLA's bf16 dot is slow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.frozen import Replaceable
from dflash_jax.step_table import StepTable

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_compute_dtype() -> str:
    # XLA:CPU's bf16 dot is several times slower than f32; GPUs want bf16.
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _dtype_name(value: Any) -> str:
    name = jnp.dtype(value).name if not isinstance(value, str) else value
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of {sorted(DTYPES)}")
    return name


# The decoder families one target config describes. They differ only by feature switches (see TargetConfig):
#   qwen3: per-head q/k RMSNorm, no biases;  qwen2: q/k/v biases, no q/k norm;  llama: neither;
#   mistral: Llama's layers (its sliding window must be off: `sliding_window: null`).
#   qwen3_5: hybrid (Qwen3.5 / 3.6 / 3.8 text): Gated DeltaNet layers ("linear_attention") between gated full-attention
#   layers with q/k norm and partial rotary; every RMSNorm but the DeltaNet's gated one is zero-centred (x * (1 + w)).
MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_5")
FAMILY_FEATURES = {"qwen3": dict(qk_norm=True, attention_bias=False),
                   "qwen2": dict(qk_norm=False, attention_bias=True),
                   "llama": dict(qk_norm=False, attention_bias=False),
                   "mistral": dict(qk_norm=False, attention_bias=False),
                   "qwen3_5": dict(qk_norm=True, attention_bias=False)}
ROPE_TYPES = ("default", "linear", "llama3")
# Target layer kinds (`layer_types`): softmax attention with a KV cache, or a Gated DeltaNet with a conv window and a
# recurrent state (qwen3_5 only).
TARGET_LAYER_TYPES = ("full_attention", "linear_attention")
LINEAR_ATTENTION_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                           "linear_value_head_dim", "linear_conv_kernel_dim")


@dataclasses.dataclass(frozen=True)
class TargetConfig(Replaceable):
    """One decoder-only target: GQA, NeoX RoPE, SwiGLU MLP, RMSNorm, with the family's features as switches.

    `model_type` names the HF family ("qwen3" | "qwen2" | "llama" | "mistral" | "qwen3_5"); `qk_norm` (per-head q/k
    RMSNorm before RoPE) and `attention_bias` (biases on q/k/v, never on o_proj) default to that family's values and
    may be set apart from it (`io.hf_config.target_config_to_hf` then refuses what HF cannot express).
    `Qwen3Config` is the same class (the name it first had).

    RoPE: `rope_type` "default", "linear" (positions divided by `rope_scaling_factor`) or "llama3" (Llama 3.x:
    long wavelengths divided by the factor, short ones kept, a smooth blend between, set by the low/high frequency
    factors and `rope_original_max_position_embeddings`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling_factor: float = 1.0  # linear / llama3 factor; 1.0 with rope_type "default" = none
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    param_dtype: str = "float32"  # storage
    compute_dtype: str = "float32"  # activations and matmuls
    # Family and feature switches (after the fields above, so configs saved before they existed still load).
    model_type: str = "qwen3"
    qk_norm: bool | None = None  # None: the family's value
    attention_bias: bool | None = None  # None: the family's value
    rope_type: str = "default"
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int | None = None  # llama3 only
    # Hybrid (qwen3_5) fields. layer_types: per layer "full_attention" | "linear_attention"; None = all full attention.
    layer_types: tuple[str, ...] | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    linear_num_key_heads: int = 0  # Gated DeltaNet sizes (0 without linear-attention layers)
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"config: model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        for name, value in FAMILY_FEATURES[self.model_type].items():  # one canonical form: configs are static metadata
            object.__setattr__(self, name, value if getattr(self, name) is None else bool(getattr(self, name)))
        self._canonical_rope()
        self._canonical_hybrid()
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype))
        object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype))

    def _canonical_rope(self):
        factor = float(self.rope_scaling_factor)
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"config: rope_scaling_factor must be finite and > 0, got {self.rope_scaling_factor!r}")
        object.__setattr__(self, "rope_scaling_factor", factor)
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise ValueError(f"config: rope_type must be one of {ROPE_TYPES}, got {kind!r}")
        # Configs saved before rope_type existed carry a linear factor under "default".
        if kind == "default" and factor != 1.0:
            kind = "linear"
        if kind == "linear" and factor == 1.0:
            kind = "default"
        object.__setattr__(self, "rope_type", kind)
        if kind == "llama3":
            low, high = float(self.rope_low_freq_factor), float(self.rope_high_freq_factor)
            original = self.rope_original_max_position_embeddings
            if original is None or int(original) < 1:
                raise ValueError("config: rope_type 'llama3' needs rope_original_max_position_embeddings >= 1, got "
                                 f"{original!r}")
            if not (0 < low < high):
                raise ValueError(f"config: llama3 RoPE needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
                                 f"{low} and {high}")
            object.__setattr__(self, "rope_low_freq_factor", low)
            object.__setattr__(self, "rope_high_freq_factor", high)
            object.__setattr__(self, "rope_original_max_position_embeddings", int(original))
        else:  # unused by this type: one canonical value
            object.__setattr__(self, "rope_low_freq_factor", 1.0)
            object.__setattr__(self, "rope_high_freq_factor", 4.0)
            object.__setattr__(self, "rope_original_max_position_embeddings", None)

    def _canonical_hybrid(self):
        factor = float(self.partial_rotary_factor)
        rotary = int(self.head_dim * factor)
        if not (0 < factor <= 1) or rotary < 2 or rotary % 2:
            raise ValueError(f"config: partial_rotary_factor {self.partial_rotary_factor!r} gives {rotary} rotary dims "
                             f"of head_dim {self.head_dim} (need 0 < factor <= 1 and an even count >= 2)")
        if factor != 1.0 and self.model_type != "qwen3_5":
            raise ValueError(f"config: partial_rotary_factor={factor} is only supported for model_type 'qwen3_5'")
        object.__setattr__(self, "partial_rotary_factor", factor)
        types = None if self.layer_types is None else tuple(str(t) for t in self.layer_types)
        if types is not None:
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"config: layer_types has {len(types)} entries for {self.num_hidden_layers} layers")
            unknown = sorted(set(types) - set(TARGET_LAYER_TYPES))
            if unknown:
                raise ValueError(f"config: layer_types entries {unknown} are not known (one of {TARGET_LAYER_TYPES})")
            if "linear_attention" in types and self.model_type != "qwen3_5":
                raise ValueError(f"config: linear_attention layers need model_type 'qwen3_5', got {self.model_type!r}")
            if set(types) == {"full_attention"}:
                types = None  # one canonical form: configs are static metadata
        object.__setattr__(self, "layer_types", types)
        if types is None:  # no DeltaNet: its sizes are meaningless, one canonical value
            for name in LINEAR_ATTENTION_FIELDS:
                object.__setattr__(self, name, 0)
            return
        for name in LINEAR_ATTENTION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise ValueError(f"config: {name} must be an integer >= 1 with linear_attention layers, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")

    # -- hybrid helpers ------------------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_type(i) == "linear_attention")

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layer_ids)

    @property
    def attn_output_gate(self) -> bool:
        """q_proj yields the query and a sigmoid output gate per head (Qwen3.5's gated attention)."""
        return self.model_type == "qwen3_5"

    @property
    def zero_centered_norm(self) -> bool:
        """RMSNorm weights are stored as w and applied as (1 + w) (Qwen3.5's `Qwen3_5RMSNorm`)."""
        return self.model_type == "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's depthwise conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def dtype(self):
        return DTYPES[self.compute_dtype]

    @property
    def storage_dtype(self):
        return DTYPES[self.param_dtype]

    def drafter_stack(self, num_hidden_layers: int) -> "TargetConfig":
        """The layer stack of a DFlash drafter for this target: Qwen3 layers (q/k norm, no biases) of the target's
        sizes and RoPE, whatever the target's family (z-lab's drafters are Qwen3 layers for every target)."""
        return self.replace(num_hidden_layers=num_hidden_layers, model_type="qwen3", qk_norm=True,
                            attention_bias=False, layer_types=None, partial_rotary_factor=1.0,
                            **{name: 0 for name in LINEAR_ATTENTION_FIELDS})


Qwen3Config = TargetConfig  # the name it first had (Qwen3 was the first family), kept for callers


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """The z-lab rule: one tap -> the middle layer; else evenly spaced from layer 1 to layer N-3."""
    if num_taps < 1:
        raise ValueError(f"need at least one target layer tap, got {num_taps}")
    if num_taps == 1:
        return (num_target_layers // 2,)
    if num_target_layers < 4:
        raise ValueError(f"cannot derive target_layer_ids for a {num_target_layers}-layer target "
                         "(the rule spaces taps from layer 1 to N-3); give dflash_config.target_layer_ids")
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_taps - 1))) for i in range(num_taps))


DRAFTER_KINDS = ("dflash", "dflash2")
DRAFT_PASSES = ("block", "drafted")  # `DrafterConfig.draft_pass`
LAYER_TYPES = ("full_attention", "sliding_attention")
# DFlash2 keys that a DFlash2DraftModel config must carry (z-lab reads them with int(...), no default).
DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class DrafterConfig(Replaceable):
    """A DFlash drafter: a Qwen3 layer stack plus `fc` + `hidden_norm` over concatenated target features.

    The drafter has no embedding and no LM head of its own: it borrows the target's at run time.

    `kind="dflash2"` (z-lab `DFlash2DraftModel` in dflash/model.py at 07ebd93db9f4) adds a grouped dynamic causal
    convolution around every attention and MLP sublayer (`conv_kernel_size` taps, one dynamic tap per
    `conv_group_size` channels) and a pairwise candidate selector over the `selector_top_k` best draft logits
    (`selector_rank`-dim codebooks).

    Attention per layer follows z-lab: a layer whose `layer_types` entry is "sliding_attention" attends within
    `sliding_window` positions and is causal inside the block unless `is_causal` says otherwise; "full_attention"
    layers are non-causal unless `is_causal` is true. `input_embedding_scale` multiplies the block embeddings;
    draft logits are `lm_head(h) * output_multiplier`, then `cap * tanh(logits / cap)` when
    `final_logit_softcapping` is set. The defaults are the original DFlash drafter.
    """

    model: TargetConfig  # the drafter's own layer stack (vocab/tie fields describe the target it borrows from)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    kind: str = "dflash"
    layer_types: tuple[str, ...] | None = None  # per drafter layer; None = all "full_attention"
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal exactly in the sliding-attention layers (z-lab's rule)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 2  # DFlash2 only (the fields below are ignored for kind="dflash")
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # Draft over the first draft_vocab_size token ids only (None: the whole vocabulary). A BPE vocabulary numbers
    # its pieces in merge order, so a prefix holds the frequent ones; the drafter's LM head is then a prefix of the
    # target's (no gather, no copy), which cuts a small drafter's step several times (SmolLM2: 49,152 x 576 rows
    # against a 4.5M-parameter drafter). Drafts stay inside the prefix and the target verifies as always, so output
    # is unchanged in law (greedy: token for token); only acceptance can move. EAGLE-3 calls the same idea a
    # reduced draft vocabulary.
    draft_vocab_size: int | None = None
    # What a step costs and buys with this drafter, measured (`dflash_jax.step_table`; `step_table.json` beside the
    # weights): `generate`'s default draft length is its best row. Not an architecture setting: never saved in the
    # config itself, and a table that does not match the running pair is ignored with a warning.
    step_table: StepTable | None = None
    # Which block the draft pass reads (DRAFT_PASSES): "block", z-lab's, the last committed token then mask tokens
    # over the whole block; "drafted", the last token then one mask per drafted slot (D + 1 rows instead of
    # block_size: the slots past D propose nothing, but they are keys of the drafted slots' attention, so a drafter
    # may draft differently without them). None: the step table's best row's, else "block". A run setting, chosen
    # per pair from measured tau and c (`dflash-jax bench --step-table --draft-passes block drafted`).
    draft_pass: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.model.qk_norm or self.model.attention_bias:
            raise ValueError("drafter config: the drafter's layers are Qwen3 layers (q/k norm, no biases); got "
                             f"qk_norm={self.model.qk_norm}, attention_bias={self.model.attention_bias}")
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter config: kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("drafter config: target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"drafter config: target_layer_ids {bad} outside 0..{self.num_target_layers - 1} "
                             f"(num_target_layers={self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.model.vocab_size:
            raise ValueError(f"drafter config: mask_token_id {self.mask_token_id} outside the vocabulary "
                             f"[0, {self.model.vocab_size})")
        n = self.model.num_hidden_layers
        if self.layer_types is not None:
            types = tuple(str(t) for t in self.layer_types)
            if len(types) != n:
                raise ValueError(f"drafter config: layer_types has {len(types)} entries for {n} layers")
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown:
                raise NotImplementedError(f"drafter config: layer_types {unknown} not supported ({LAYER_TYPES})")
            # One canonical form (configs are static pytree metadata: equal meaning must compare equal).
            object.__setattr__(self, "layer_types", None if set(types) == {"full_attention"} else types)
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or int(self.sliding_window) != self.sliding_window \
                    or int(self.sliding_window) < 1:
                raise ValueError(f"drafter config: sliding_window must be an integer >= 1, got "
                                 f"{self.sliding_window!r}")
            object.__setattr__(self, "sliding_window", int(self.sliding_window))
        if self.is_causal is not None:
            object.__setattr__(self, "is_causal", bool(self.is_causal))
        for name in ("input_embedding_scale", "output_multiplier"):
            value = float(getattr(self, name))
            if not math.isfinite(value):
                raise ValueError(f"drafter config: {name} must be finite, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        cap = self.final_logit_softcapping
        if cap is not None:
            cap = float(cap)
            if not math.isfinite(cap):
                raise ValueError(f"drafter config: final_logit_softcapping must be finite, got {cap!r}")
            # z-lab applies the cap only when it is > 0; 0 (or less) means none.
            object.__setattr__(self, "final_logit_softcapping", cap if cap > 0 else None)
        n, V = self.draft_vocab_size, self.model.vocab_size
        if n is not None:
            if isinstance(n, bool) or int(n) != n or not 1 <= int(n) <= V:
                raise ValueError(f"drafter config: draft_vocab_size must be an integer in 1..{V} (the vocabulary), "
                                 f"got {n!r}")
            # One canonical form: the whole vocabulary is None.
            object.__setattr__(self, "draft_vocab_size", None if int(n) == V else int(n))
        if self.step_table is not None and not isinstance(self.step_table, StepTable):
            raise ValueError(f"drafter config: step_table must be a dflash_jax.step_table.StepTable or None, got "
                             f"{type(self.step_table).__name__}")
        if self.draft_pass is not None and self.draft_pass not in DRAFT_PASSES:
            raise ValueError(f"drafter config: draft_pass must be one of {DRAFT_PASSES} or None, got "
                             f"{self.draft_pass!r}")
        if self.kind == "dflash2" and self.draft_pass == "drafted":
            raise ValueError("drafter config: draft_pass 'drafted' is for DFlash drafters: a DFlash2 drafter's "
                             "convolution runs along its whole block")
        if self.kind == "dflash2":
            self._check_dflash2()

    def _check_dflash2(self):
        H, V = self.model.hidden_size, self.model.vocab_size
        for name in DFLASH2_REQUIRED:
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or int(value) < 1:
                raise ValueError(f"drafter config: {name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if H % self.conv_group_size:
            raise ValueError(f"drafter config: conv_group_size {self.conv_group_size} does not divide the hidden "
                             f"size {H}")
        drafted = self.draft_vocab_size or V
        if self.selector_top_k > drafted:
            raise ValueError(f"drafter config: selector_top_k {self.selector_top_k} is larger than the "
                             f"{'draft ' if self.draft_vocab_size else ''}vocabulary ({drafted})")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def is_dflash2(self) -> bool:
        return self.kind == "dflash2"

    @property
    def drafted_vocab(self) -> int:
        """How many token ids a draft can be: the draft vocabulary's size, or the whole vocabulary."""
        return self.draft_vocab_size or self.model.vocab_size

    @property
    def conv_groups(self) -> int:
        return self.model.hidden_size // self.conv_group_size

    def layer_attention(self, i: int) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of drafter layer i, by z-lab's rule."""
        layer_type = self.layer_types[i] if self.layer_types else "full_attention"
        sliding = layer_type == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if sliding else None)


def check_pair(drafter: DrafterConfig, target: TargetConfig) -> None:
    """Every way a drafter can be built for another target, as one clear error."""
    problems = []
    if drafter.model.hidden_size != target.hidden_size:
        problems.append(f"hidden size: drafter {drafter.model.hidden_size} vs target {target.hidden_size}")
    if drafter.model.vocab_size != target.vocab_size:
        problems.append(f"vocab size: drafter {drafter.model.vocab_size} vs target {target.vocab_size}")
    if drafter.num_target_layers != target.num_hidden_layers:
        problems.append(f"num_target_layers: drafter expects {drafter.num_target_layers}, "
                        f"target has {target.num_hidden_layers}")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's layers 0..{target.num_hidden_layers - 1}")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} outside the target vocabulary [0, {target.vocab_size})")
    if problems:
        raise ValueError("drafter does not match target: " + "; ".join(problems))


__all__ = ["TargetConfig", "Qwen3Config", "DrafterConfig", "DRAFT_PASSES", "default_target_layer_ids", "check_pair",
           "default_compute_dtype"]
