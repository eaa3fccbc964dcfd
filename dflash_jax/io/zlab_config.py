"""z-lab's DFlash / DFlash2 drafter `config.json` <-> `DrafterConfig`.

z-lab's loader reads each DFlash key from `dflash_config` first, then from the top level; the layer stack is an HF
Qwen3 config (read by `hf_config`), whatever target the drafter serves. Keys other engines use for attention
layouts whose semantics z-lab's code does not pin down are refused rather than guessed.
"""

from __future__ import annotations

import warnings

from dflash_jax.config import DFLASH2_REQUIRED, DrafterConfig, default_target_layer_ids
from dflash_jax.io.hf_config import target_config_from_hf, target_config_to_hf

DRAFTER_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


def is_drafter_config(d: dict) -> bool:
    """Whether a config.json names a z-lab drafter architecture."""
    return any(a in DRAFTER_ARCHITECTURES.values() for a in d.get("architectures") or [])


def drafter_config_from_hf(d: dict, *, param_dtype: str | None = None, compute_dtype: str | None = None
                           ) -> DrafterConfig:
    """A drafter config from a z-lab DFlash / DFlash2 `config.json` dict; errors name the key."""
    dcfg = d.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ValueError(f"drafter config.json: dflash_config must be an object, got {type(dcfg).__name__}")

    def pick(key, default=None):  # z-lab reads dflash_config first, then the top level
        value = dcfg.get(key, d.get(key))
        return default if value is None else value

    arch = d.get("architectures") or []
    kind = "dflash2" if DRAFTER_ARCHITECTURES["dflash2"] in arch else "dflash"
    block_size = pick("block_size")
    mask_token_id = pick("mask_token_id")
    if block_size is None:
        raise ValueError("drafter config.json: missing block_size (top level or dflash_config)")
    if mask_token_id is None:
        raise ValueError("drafter config.json: missing dflash_config.mask_token_id")
    n_target = d.get("num_target_layers")
    if n_target is None:
        raise ValueError("drafter config.json: missing num_target_layers")
    layer_ids = pick("target_layer_ids")
    if layer_ids is None:
        layer_ids = default_target_layer_ids(int(n_target), int(d["num_hidden_layers"]))
        warnings.warn(f"drafter config.json has no target_layer_ids; derived {list(layer_ids)} by the "
                      "standard rule (check that it matches fc's input width)", stacklevel=2)
    # Other engines' spellings whose exact semantics are not pinned down by z-lab's code: refuse them rather
    # than guess (z-lab's own keys are layer_types / sliding_window / is_causal).
    for key in ("causal", "use_swa", "swa_window_size", "attention_sink_bias"):
        if dcfg.get(key):
            raise NotImplementedError(f"drafter config.json: dflash_config.{key} is not supported; use the "
                                      "z-lab keys layer_types / sliding_window / is_causal")
    window, layer_types = _attention_layout(d, dcfg, pick("layer_types"))
    extra = {}
    if kind == "dflash2":
        missing = [k for k in DFLASH2_REQUIRED if pick(k) is None]
        if missing:
            raise ValueError(f"drafter config.json: DFlash2DraftModel config is missing {missing} "
                             "(dflash_config or top level)")
        extra = {k: pick(k) for k in DFLASH2_REQUIRED}
    stripped = {k: v for k, v in d.items() if k != "layer_types"}  # the drafter handles its own layer types
    # z-lab's drafter layers are Qwen3 layers whatever target they serve (a Llama or Qwen2 one included), so the
    # stack is read as qwen3 even where the file copies the target's model_type.
    stripped["model_type"] = "qwen3"
    model = target_config_from_hf(stripped, param_dtype=param_dtype, compute_dtype=compute_dtype)
    return DrafterConfig(model=model, block_size=int(block_size), mask_token_id=int(mask_token_id),
                         target_layer_ids=tuple(int(i) for i in layer_ids), num_target_layers=int(n_target),
                         kind=kind, layer_types=tuple(layer_types) if layer_types else None, sliding_window=window,
                         is_causal=pick("is_causal"), input_embedding_scale=pick("input_embedding_scale", 1.0),
                         output_multiplier=pick("output_multiplier", 1.0),
                         final_logit_softcapping=pick("final_logit_softcapping"),
                         draft_vocab_size=pick("draft_vocab_size"), **extra)


def _attention_layout(d: dict, dcfg: dict, layer_types):
    """(sliding window or None, per-layer types or None) as z-lab's attention sees them through an HF Qwen3 config
    (transformers 4.57): sliding_window (default 4096) is kept only when use_sliding_window is true, and a missing
    layer_types is derived as "sliding_attention" for layers >= max_window_layers (default 28) when a window is
    kept. A dflash_config.sliding_window (not an HF key) is taken as given."""
    if "sliding_window" in dcfg:
        window = dcfg["sliding_window"]
    else:
        window = d.get("sliding_window", 4096 if d.get("use_sliding_window") else None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"drafter config.json: sliding_window must be an integer >= 1 (or null), got {window!r}")
    if window is not None and "sliding_window" not in dcfg and not d.get("use_sliding_window", False):
        if layer_types and "sliding_attention" in layer_types:
            warnings.warn(f"drafter config.json: sliding_window {window} is ignored because use_sliding_window "
                          "is not true (as HF Qwen3Config does); sliding layers attend without a window",
                          stacklevel=3)
        window = None
    if layer_types is None and window is not None:
        first = int(d.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(int(d["num_hidden_layers"]))]
    return window, layer_types


def drafter_config_to_hf(cfg: DrafterConfig) -> dict:
    """The z-lab `config.json` dict of a drafter config (the layer stack's HF Qwen3 keys plus `dflash_config`)."""
    d = target_config_to_hf(cfg.model)
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.kind == "dflash2":
        dflash.update(block_size=cfg.block_size, **{k: getattr(cfg, k) for k in DFLASH2_REQUIRED})
    if cfg.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dflash["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.draft_vocab_size is not None:  # this project's key; z-lab's loader ignores it (drafts over all)
        dflash["draft_vocab_size"] = cfg.draft_vocab_size
    arch = DRAFTER_ARCHITECTURES[cfg.kind]
    d.update({
        "architectures": [arch],
        "auto_map": {"AutoModel": f"dflash.{arch}"},
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash,
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.model.num_hidden_layers),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
    })
    if cfg.is_causal is not None:
        d["is_causal"] = cfg.is_causal
    return d


__all__ = ["drafter_config_from_hf", "drafter_config_to_hf", "is_drafter_config", "DRAFTER_ARCHITECTURES"]
