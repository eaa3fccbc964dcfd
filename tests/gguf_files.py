"""Tiny GGUF files for tests, written with gguf-py's `GGUFWriter` (llama.cpp's own writer), laid out as llama.cpp's
converter lays out a model: GGUF tensor names, numpy [out, in] weights, llama's Q/K rows permuted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_jax.io.gguf_model import gguf_name
from dflash_jax.params import named_leaves


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: per head, rows [2, hd/2] -> [hd/2, 2] (adjacent-pair RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(arr: np.ndarray, qtype: int):
    """(data, raw_dtype) for GGUFWriter.add_tensor: float32 / float16 as is, other types via gguf.quants."""
    import gguf

    t = gguf.GGMLQuantizationType(qtype)
    if t == gguf.GGMLQuantizationType.F32:
        return np.asarray(arr, np.float32), None
    if t == gguf.GGMLQuantizationType.F16:
        return np.asarray(arr, np.float16), None
    return gguf.quants.quantize(np.asarray(arr, np.float32), t), t


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict[str, tuple[np.ndarray, int]],
               tokenizer: dict | None = None) -> Path:
    """metadata: {key: value} (ints as uint32, floats as float32, str, bool, lists of str / int); tensors:
    {name: (float array, ggml type id)}."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**metadata, **(tokenizer or {})}.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            w.add_array(key, list(value))
        else:
            raise TypeError(f"{key}: {type(value)}")
    for name, (arr, qtype) in tensors.items():
        data, raw = quantized(arr, qtype)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def model_metadata(cfg, arch: str) -> dict:
    return {
        f"{arch}.vocab_size": cfg.vocab_size, f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads, f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim, f"{arch}.rope.freq_base": float(cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }


def write_target_gguf(path: Path, target, arch: str = "qwen3", types: dict[str, int] | None = None,
                      drop: tuple[str, ...] = (), reshape: dict[str, tuple] | None = None, extra=None) -> Path:
    """A Target's parameters as a GGUF of `arch`. types: {GGUF name suffix: ggml type} (default F32)."""
    cfg = target.config
    tensors = {}
    for name, leaf in named_leaves(target.params).items():
        hf = ("model." + name if name != "lm_head" else name) + ".weight"
        gname = gguf_name(hf)
        arr = np.asarray(leaf, np.float32)
        if arch == "llama" and gname.endswith("attn_q.weight"):
            arr = permute_like_llama_cpp(arr, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            arr = permute_like_llama_cpp(arr, cfg.num_key_value_heads)
        if gname in drop:
            continue
        if reshape and gname in reshape:
            arr = arr.reshape(reshape[gname])
        qtype = next((t for suffix, t in (types or {}).items() if gname.endswith(suffix)), 0)
        tensors[gname] = (arr, qtype)
    tensors.update(extra or {})
    return write_gguf(path, arch, model_metadata(cfg, arch), tensors)


def _tiled(x: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """llama.cpp's qwen35 conversion of value heads along `axis`: HF's grouped order [nK, r, hd] -> tiled [r, nK, hd]
    (written from the converter's description, independently of the loader's inverse)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(n_k, n_v // n_k, head_dim, *rest).swapaxes(0, 1).reshape(n_v * head_dim, *rest)
    return np.moveaxis(x, 0, axis)


def write_qwen35_gguf(path: Path, model, *, drop: tuple[str, ...] = (), meta: dict | None = None) -> Path:
    """A transformers `Qwen3_5ForCausalLM` as llama.cpp's converter writes it (architecture qwen35): tensor names from
    gguf-py's own name map, A_log -> ssm_a = -exp(A_log), dt_bias -> ssm_dt.bias, conv1d squeezed to [C, K], every
    zero-centred norm but the gated one stored as 1 + w, value heads reordered grouped -> tiled (v rows of attn_qkv,
    v channels of the conv, z / beta / alpha rows, A_log, dt_bias, out_proj columns), the `qwen35.*` metadata.
    drop: GGUF names left out; meta: metadata overrides."""
    import gguf

    c = model.config
    n_k, n_v = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    rope = c.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, c.num_hidden_layers)
    tensors = {}
    for hf, p in model.state_dict().items():
        x = p.detach().float().numpy()
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf.endswith(".A_log"):
            x = -np.exp(x)
        if hf.endswith(".dt_bias"):
            hf = hf[:-len(".dt_bias")] + ".dt_proj.bias"
        if ".conv1d." in hf:
            x = x.squeeze()
        if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            x = x + 1.0
        if ".linear_attn." in hf and n_k != n_v:
            if ".in_proj_qkv." in hf or ".conv1d." in hf:
                x = np.concatenate([x[:2 * n_k * dk], _tiled(x[2 * n_k * dk:], 0, n_k, n_v, dv)])
            elif ".in_proj_z." in hf:
                x = _tiled(x, 0, n_k, n_v, dv)
            elif ".in_proj_a." in hf or ".in_proj_b." in hf or hf.endswith((".A_log", ".dt_proj.bias")):
                x = _tiled(x, 0, n_k, n_v, 1)
            elif ".out_proj." in hf:
                x = _tiled(x, 1, n_k, n_v, dv)
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        if name not in drop:
            tensors[name] = (np.ascontiguousarray(x, np.float32), 0)
    a = "qwen35"
    metadata = {
        f"{a}.block_count": c.num_hidden_layers, f"{a}.context_length": c.max_position_embeddings,
        f"{a}.embedding_length": c.hidden_size, f"{a}.feed_forward_length": c.intermediate_size,
        f"{a}.attention.head_count": c.num_attention_heads, f"{a}.attention.head_count_kv": c.num_key_value_heads,
        f"{a}.attention.key_length": c.head_dim, f"{a}.attention.value_length": c.head_dim,
        f"{a}.rope.freq_base": float(rope["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        f"{a}.rope.dimension_count": int(c.head_dim * rope.get("partial_rotary_factor", 0.25)),
        f"{a}.rope.dimension_sections": list(rope.get("mrope_section", [11, 11, 10])) + [0],
        f"{a}.ssm.conv_kernel": c.linear_conv_kernel_dim, f"{a}.ssm.state_size": dk, f"{a}.ssm.group_count": n_k,
        f"{a}.ssm.time_step_rank": n_v, f"{a}.ssm.inner_size": n_v * dv,
        f"{a}.full_attention_interval": int(getattr(c, "full_attention_interval", 4)),
        **(meta or {}),
    }
    return write_gguf(path, a, metadata, tensors)
