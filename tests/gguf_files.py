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
