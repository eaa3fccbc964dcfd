"""HF `config.json` <-> `TargetConfig`: Qwen3, Qwen2, Llama, Mistral and Qwen3.5 (hybrid) causal LMs.

Reading refuses, naming the key, whatever this decoder cannot run (an o_proj or MLP bias, another activation,
yarn / dynamic RoPE, sliding windows, partial RoPE outside Qwen3.5); writing refuses a config HF cannot express (a
family with another family's q/k norm or biases). The z-lab drafter's config.json is `zlab_config`'s; GGUF metadata
is `gguf_config`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_jax.config import (DTYPES, FAMILY_FEATURES, LINEAR_ATTENTION_FIELDS, MODEL_TYPES, TARGET_LAYER_TYPES,
                               TargetConfig, default_compute_dtype)

HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config_json(path: str | Path) -> dict:
    """The `config.json` of a folder (or the file itself) as a dict; errors name the file."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    return read_json_object(file)


def read_json_object(file: str | Path) -> dict:
    """A JSON file that must hold an object; errors name the file."""
    try:
        with open(file) as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return d


def _stored_dtype(d: dict, param_dtype: str | None) -> str:
    """`param_dtype`, else the file's torch_dtype when it is one this project stores, else float32."""
    dtype_in_file = d.get("torch_dtype") or d.get("dtype") or "float32"
    return param_dtype or (dtype_in_file if dtype_in_file in DTYPES else "float32")


def _first_eos(d: dict):
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def target_config_from_hf(d: dict, *, param_dtype: str | None = None, compute_dtype: str | None = None,
                          **overrides) -> TargetConfig:
    """A config from an HF `config.json` of a Qwen3, Qwen2, Llama, Mistral or Qwen3.5 (`qwen3_5`, text-only or the
    multimodal layout whose text model sits under `text_config`) causal LM; what this decoder cannot run is
    refused with an error naming the key. `overrides` replace fields of the result."""
    if d.get("model_type") in ("qwen3_5", "qwen3_5_text") or isinstance(d.get("text_config"), dict):
        return _qwen3_5_from_hf(d, param_dtype=param_dtype, compute_dtype=compute_dtype, **overrides)
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"config.json is missing required keys: {missing}")
    model_type = d.get("model_type")
    if model_type is None:  # older files: the architecture names the family
        by_arch = {v: k for k, v in HF_ARCHITECTURES.items()}
        model_type = next((by_arch[a] for a in d.get("architectures") or [] if a in by_arch), "qwen3")
    if model_type not in MODEL_TYPES:
        raise NotImplementedError(f"config.json: model_type {model_type!r} is not supported "
                                  f"(one of {list(MODEL_TYPES)})")
    features = dict(FAMILY_FEATURES[model_type])
    if model_type != "qwen2" and d.get("attention_bias", False):
        # HF Llama / Qwen3 put the bias on o_proj too; this decoder has q/k/v biases only (Qwen2's layout).
        raise NotImplementedError(f"config.json: attention_bias=true is not supported for model_type "
                                  f"{model_type!r} (it biases o_proj too); only Qwen2's q/k/v biases are")
    if d.get("mlp_bias", False):
        raise NotImplementedError("config.json: mlp_bias=true is not supported (the MLP has no biases)")
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"config.json: hidden_act={d['hidden_act']!r} is not supported (silu only)")
    partial = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
                    if isinstance(d.get("rope_parameters"), dict) else 1.0)
    if float(partial) != 1.0:
        raise NotImplementedError(f"config.json: partial_rotary_factor={partial} is not supported for model_type "
                                  f"{model_type!r} (RoPE over the whole head)")
    n_heads = int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or d["hidden_size"] // n_heads)
    rope_theta = d.get("rope_theta")
    rope_scaling = d.get("rope_scaling")
    key = "rope_scaling"
    if rope_scaling is None and isinstance(d.get("rope_parameters"), dict):  # newer HF layout
        rope_scaling, key = d["rope_parameters"], "rope_parameters"
        rope_theta = rope_theta or rope_scaling.get("rope_theta")
    rope = _rope_fields(rope_scaling, key, d)
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(f"config.json: layer_types {sorted(set(layer_types))} not supported "
                                  "(full_attention only)")
    if model_type == "mistral" and d.get("sliding_window", 4096) is not None:  # HF Mistral's default is 4096
        raise NotImplementedError(f"config.json: sliding_window={d.get('sliding_window', 4096)} is not supported "
                                  "for mistral (full attention only: sliding_window must be null)")
    if model_type == "qwen2" and not layer_types and d.get("use_sliding_window", False) \
            and int(d.get("max_window_layers", 28)) < int(d["num_hidden_layers"]):
        raise NotImplementedError("config.json: use_sliding_window=true is not supported (the layers from "
                                  "max_window_layers on would attend within sliding_window)")
    kwargs = dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or 10000.0),
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_first_eos(d),
        param_dtype=_stored_dtype(d, param_dtype),
        compute_dtype=compute_dtype or default_compute_dtype(),
        model_type=model_type,
        **features,
        **rope,
    )
    kwargs.update(overrides)
    return TargetConfig(**kwargs)


def _qwen3_5_from_hf(d: dict, *, param_dtype: str | None, compute_dtype: str | None, **overrides) -> TargetConfig:
    """Qwen3.5 / 3.6 / 3.8 (transformers 5.x `qwen3_5`): `Qwen3_5ForCausalLM`'s text config, or the multimodal
    `Qwen3_5ForConditionalGeneration` config whose text model is `text_config` (the vision config and the image
    token ids are not read: a text-only decoder never meets them, so an image_token_id outside a test model's
    vocabulary is harmless)."""
    text = d.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"config.json: text_config must be an object, got {type(text).__name__}")
    t = dict(text) if text is not None else dict(d)
    if text is not None:  # a few keys may sit at the top level only (older exports)
        for key in ("tie_word_embeddings", "torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
            if key not in t and key in d:
                t[key] = d[key]
    missing = [k for k in _REQUIRED if k not in t]
    if missing:
        raise ValueError(f"config.json: {'text_config' if text is not None else 'config'} is missing required "
                         f"keys: {missing}")
    if t.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"config.json: hidden_act={t['hidden_act']!r} is not supported (silu only)")
    if t.get("attention_bias", False):
        raise NotImplementedError("config.json: attention_bias=true is not supported for qwen3_5")
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {type(rope).__name__}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(f"config.json: rope_parameters.rope_type {kind!r} is not supported for qwen3_5 "
                                  "(default, with multimodal sections that are equal for text)")
    # transformers 5.x: partial_rotary_factor may sit only inside rope_parameters; its default for qwen3_5 is 0.25
    partial = t.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    rope_theta = t.get("rope_theta", rope.get("rope_theta", 10000.0))
    n = int(t["num_hidden_layers"])
    layer_types = t.get("layer_types")
    if layer_types is None:  # HF's default: every full_attention_interval-th layer is full attention
        interval = int(t.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(layer_types, list) or len(layer_types) != n:
        raise ValueError(f"config.json: layer_types must be a list of {n} entries (num_hidden_layers), got "
                         f"{layer_types!r}")
    unknown = sorted({str(x) for x in layer_types} - set(TARGET_LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"config.json: layer_types entries {unknown} are not supported "
                                  f"(one of {list(TARGET_LAYER_TYPES)})")
    n_heads = int(t["num_attention_heads"])
    linear_defaults = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                           linear_value_head_dim=128, linear_conv_kernel_dim=4)  # HF Qwen3_5TextConfig's
    kwargs = dict(
        vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]), num_hidden_layers=n, num_attention_heads=n_heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or n_heads),
        head_dim=int(t.get("head_dim") or 256), rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)), bos_token_id=t.get("bos_token_id"),
        eos_token_id=_first_eos(t), param_dtype=_stored_dtype(t, param_dtype),
        compute_dtype=compute_dtype or default_compute_dtype(), model_type="qwen3_5",
        layer_types=tuple(str(x) for x in layer_types), partial_rotary_factor=float(partial),
        **{k: int(t.get(k, v)) for k, v in linear_defaults.items()})
    kwargs.update(overrides)
    return TargetConfig(**kwargs)


def _rope_fields(rope_scaling, key: str, d: dict) -> dict:
    """The config's RoPE fields from an HF `rope_scaling` (or `rope_parameters`) object; errors name the key."""
    if not rope_scaling:
        return {}
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"config.json: {key} must be an object, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return {}

    def number(name, cast=float):
        if name not in rope_scaling:
            raise ValueError(f"config.json: {key}.{name} is required for rope_type {kind!r}")
        value = rope_scaling[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config.json: {key}.{name} must be a number, got {value!r}")
        return cast(value)

    if kind == "linear":
        return dict(rope_type="linear", rope_scaling_factor=number("factor"))
    if kind == "llama3":
        original = (rope_scaling.get("original_max_position_embeddings")
                    or d.get("max_position_embeddings"))  # HF's fallback when the key is absent
        return dict(rope_type="llama3", rope_scaling_factor=number("factor"),
                    rope_low_freq_factor=number("low_freq_factor"), rope_high_freq_factor=number("high_freq_factor"),
                    rope_original_max_position_embeddings=int(original) if original is not None else None)
    raise NotImplementedError(f"config.json: {key}.rope_type {kind!r} is not supported (default, linear, llama3)")


def target_config_to_hf(cfg: TargetConfig) -> dict:
    """The HF `config.json` dict of a target config (`Qwen3_5ForCausalLM`'s text layout for a hybrid one); a config
    whose q/k norm or biases differ from its family's has no such form and is refused."""
    if cfg.model_type == "qwen3_5":
        return _qwen3_5_to_hf(cfg)
    features = FAMILY_FEATURES[cfg.model_type]
    if (cfg.qk_norm, cfg.attention_bias) != tuple(features.values()):
        raise ValueError(f"config: model_type {cfg.model_type!r} with qk_norm={cfg.qk_norm}, attention_bias="
                         f"{cfg.attention_bias} has no HF config.json form (the {cfg.model_type} family has "
                         f"{features})")
    d = {
        "architectures": [HF_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.model_type == "llama":
        d.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif cfg.model_type == "mistral":
        d["sliding_window"] = None
    else:  # qwen2 / qwen3: full attention in every layer
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_hidden_layers,
                 layer_types=["full_attention"] * cfg.num_hidden_layers)
        if cfg.model_type == "qwen3":
            d["attention_bias"] = False
    return _with_special_tokens(d, cfg)


def _qwen3_5_to_hf(cfg: TargetConfig) -> dict:
    d = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
         "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                             "partial_rotary_factor": cfg.partial_rotary_factor},
         "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "attention_dropout": 0.0,
         "layer_types": [cfg.layer_type(i) for i in range(cfg.num_hidden_layers)],
         "torch_dtype": cfg.param_dtype}
    d.update({name: getattr(cfg, name) or 1 for name in LINEAR_ATTENTION_FIELDS})
    return _with_special_tokens(d, cfg)


def _with_special_tokens(d: dict, cfg: TargetConfig) -> dict:
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        d["eos_token_id"] = cfg.eos_token_id
    return d


def _rope_scaling(cfg: TargetConfig) -> dict | None:
    if cfg.rope_type == "default":
        return None
    if cfg.rope_type == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    return {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}


__all__ = ["target_config_from_hf", "target_config_to_hf", "read_config_json", "read_json_object",
           "HF_ARCHITECTURES"]
