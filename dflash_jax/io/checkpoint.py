"""`load_target` and `load_drafter`: any model path, whatever its format (`model_path` decides what it is), read by
that format's reader: HF / z-lab / ModelOpt folders (`hf_folder`), `save` folders (`orbax_folder`), llama.cpp GGUF
files (`gguf_model` for targets, `gguf_drafter` for drafters). Writing is `orbax_folder.save`, `hf_folder.save_hf`
and `gguf_drafter.save_gguf`.
"""

from __future__ import annotations

from pathlib import Path

import jax

from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.gguf_drafter import load_drafter_gguf
from dflash_jax.io.gguf_model import load_target_gguf
from dflash_jax.io.hf_config import read_config_json, target_config_from_hf
from dflash_jax.io.hf_folder import params_from_hf, qwen3_5_text_tensors, read_quant_config, read_tensors
from dflash_jax.io.model_path import model_path
from dflash_jax.io.orbax_folder import load_saved
from dflash_jax.io.placement import loading_dtypes, shard_if
from dflash_jax.io.step_table_file import with_step_table
from dflash_jax.io.zlab_config import DRAFTER_ARCHITECTURES, drafter_config_from_hf, is_drafter_config
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.params import abstract_drafter, abstract_target


GGUF_BLOCKS = "gguf"  # load_target's param_dtype that keeps a GGUF file's quantized blocks as they are


def load_target(path: str | Path, *, param_dtype: str | None = None, compute_dtype: str | None = None, mesh=None):
    """A Target from an HF Qwen3, Qwen2, Llama, Mistral or Qwen3.5 folder (`model_type` qwen3 / qwen2 / llama /
    mistral / qwen3_5; optionally ModelOpt NVFP4), a folder written by `save`, or a llama.cpp GGUF file of the llama /
    qwen2 / qwen3 / qwen35 (hybrid) architectures (a `.gguf` suffix or the GGUF magic; see `dflash_jax.io.gguf_model`).
    A config this decoder cannot run is refused naming the key; a path that is no target (a bare .safetensors file,
    an empty folder, ...) is refused saying what a target path can be.

    Dtypes: see `placement.loading_dtypes` (compute: bf16 on accelerators, f32 on CPU; parameters: the compute
    dtype). A GGUF file on a CPU keeps its Q4_0 / Q4_1 / Q8_0 matrices and embedding as they are
    (`param_dtype="gguf"`, the CPU default: ~0.6 bytes per weight, streamed by the CPU kernel);
    `param_dtype="float32"` decodes them (the parity reference with transformers). mesh: a
    `dflash_jax.parallel.sharding.make_mesh` mesh: HF safetensors and GGUF tensors go straight into sharded device
    arrays (each device reads only its slice of the memory-mapped file, one tensor at a time, so host memory stays
    near the size of the placed parameters); a `save` folder is restored, then sharded."""
    where = model_path(path, "target")
    path = where.path
    if where.format == "gguf":
        keep_blocks = param_dtype == GGUF_BLOCKS or (param_dtype is None and mesh is None
                                                     and jax.default_backend() == "cpu")
        if keep_blocks and mesh is not None:
            raise CheckpointError(f"{path}: param_dtype='gguf' (the file's own blocks) cannot be sharded over a mesh; "
                                  "load with param_dtype='float32' or 'bfloat16' to shard")
        param_dtype, compute_dtype = loading_dtypes(None if param_dtype == GGUF_BLOCKS else param_dtype,
                                                    compute_dtype)
        return load_target_gguf(path, param_dtype, compute_dtype, mesh, keep_blocks=keep_blocks)
    if param_dtype == GGUF_BLOCKS:
        raise CheckpointError(f"{path}: param_dtype='gguf' keeps a GGUF file's own quantized blocks, and this is not "
                              "a GGUF file")
    param_dtype, compute_dtype = loading_dtypes(param_dtype, compute_dtype)
    if where.format == "saved":
        return shard_if(load_saved(path, "target", param_dtype=param_dtype, compute_dtype=compute_dtype), mesh)
    d = read_config_json(path)
    if is_drafter_config(d):
        raise CheckpointError(f"{path}: is a DFlash drafter ({d['architectures'][0]}), not a target (use "
                              "load_drafter)")
    cfg = target_config_from_hf(d, param_dtype=param_dtype, compute_dtype=compute_dtype)
    tensors = None
    if cfg.model_type == "qwen3_5":
        tensors = qwen3_5_text_tensors(path, read_tensors(path, lazy=mesh is not None))
    params = params_from_hf("target", path, abstract_target(cfg), cfg.storage_dtype, read_quant_config(path, d),
                            mesh=mesh, cfg=cfg, tensors=tensors)
    return Target(params=params, config=cfg)


def load_drafter(path: str | Path, *, param_dtype: str | None = None, compute_dtype: str | None = None, mesh=None,
                 vocab_size: int | None = None, num_target_layers: int | None = None):
    """A Drafter from a z-lab DFlash or DFlash2 HF folder (optionally ModelOpt NVFP4), a folder written by `save`, or
    a llama.cpp `dflash` GGUF file (see `dflash_jax.io.gguf_drafter`).

    `architectures: ["DFlash2DraftModel"]` selects a DFlash2 drafter: its conv (`layers.{i}.{attention,mlp}_conv.
    base_kernel`, `...kernel_projection.weight`) and selector (`candidate_selector.{predecessor,successor}_codebook`
    with or without `.weight`, `candidate_selector.hidden_projection.weight`) tensors are then required.
    vocab_size / num_target_layers: only for a GGUF file that does not record them (the target's).
    Dtypes and mesh: as `load_target`."""
    where = model_path(path, "drafter")
    path = where.path
    if where.format != "gguf" and (vocab_size is not None or num_target_layers is not None):
        raise TypeError("vocab_size / num_target_layers apply to GGUF drafters only")
    param_dtype, compute_dtype = loading_dtypes(param_dtype, compute_dtype)
    if where.format == "gguf":
        return load_drafter_gguf(path, param_dtype=param_dtype, compute_dtype=compute_dtype, mesh=mesh,
                                 vocab_size=vocab_size, num_target_layers=num_target_layers)
    if where.format == "saved":
        drafter = load_saved(path, "drafter", param_dtype=param_dtype, compute_dtype=compute_dtype)
        return shard_if(with_step_table(drafter, path), mesh)
    d = read_config_json(path)
    arch = d.get("architectures") or []
    if arch and not is_drafter_config(d):
        raise CheckpointError(f"{path}: architectures {arch} is not a DFlash drafter "
                              f"({' or '.join(DRAFTER_ARCHITECTURES.values())})")
    try:
        cfg = drafter_config_from_hf(d, param_dtype=param_dtype, compute_dtype=compute_dtype)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    params = params_from_hf("drafter", path, abstract_drafter(cfg), cfg.model.storage_dtype,
                            read_quant_config(path, d), mesh=mesh, cfg=cfg.model)
    return with_step_table(Drafter(params=params, config=cfg), path)


__all__ = ["load_target", "load_drafter"]
