"""Folders written by `save`: orbax's `params/` (dense and NVFP4 leaves alike) next to `dflash_jax.json`, which
records the kind (target or drafter), the config and which leaves are NVFP4 (so the restore tree can be built
before anything is read)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io.step_table_file import write_step_table
from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.hf_folder import qkv_order, rows_taken
from dflash_jax.io.model_path import SAVED_MARKER
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.params import abstract_drafter, abstract_target, map_named, named_leaves
from dflash_jax.quant.nvfp4 import NVFP4Array

# Fields older saves carry that are no longer part of a config: `attention_chunk` became an execution setting
# (`dflash_jax.models.attention.attention_chunk`).
_RETIRED_FIELDS = ("attention_chunk",)


def _model_config(d: dict) -> TargetConfig:
    return TargetConfig(**{k: v for k, v in d.items() if k not in _RETIRED_FIELDS})


def config_from_saved_json(kind: str, d: dict):
    """The config `save` recorded for a "target" or a "drafter" (fields retired since are dropped)."""
    if kind == "target":
        return _model_config(d)
    d = {k: v for k, v in d.items() if k != "step_table"}  # a measurement, kept in its own file
    d["model"] = _model_config(d["model"])
    return DrafterConfig(**d)


def save(path: str | Path, model) -> Path:
    """Save a Target or Drafter (dense and NVFP4 leaves alike) with orbax, plus its config."""
    import orbax.checkpoint as ocp  # third-party, slow to import: only when saving

    kind = "target" if isinstance(model, Target) else "drafter" if isinstance(model, Drafter) else None
    if kind is None:
        raise TypeError(f"save() takes a Target or a Drafter, got {type(model).__name__}")
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    named = named_leaves(model.params)
    nvfp4 = {n: {"shape": list(leaf.shape), "input_scale": leaf.input_scale is not None}
             for n, leaf in named.items() if isinstance(leaf, NVFP4Array)}
    # version 2: a DeltaNet's in_proj_qkv / conv1d rows grouped by key head (version 1 held HF's q | k | v order)
    config = dataclasses.asdict(model.config)
    table = config.pop("step_table", None) and model.config.step_table  # its own file (`io.step_table_file`)
    meta = {"format": "dflash_jax", "version": 2, "kind": kind, "config": config, "nvfp4": nvfp4}
    params_dir = path / "params"
    if params_dir.exists():
        shutil.rmtree(params_dir)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(params_dir, model.params)
    ckptr.wait_until_finished()
    with open(path / SAVED_MARKER, "w") as f:
        json.dump(meta, f, indent=1)
    if table is not None:
        write_step_table(path, table)
    return path


def _abstract_restore_target(abstract, nvfp4: dict[str, dict], dtype):
    """The tree orbax restores into. Every leaf names this process's first device: without a sharding orbax takes
    the one recorded at save time, and a folder saved on a CPU ("cpu:0") then cannot be read on a GPU host."""
    here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def struct(shape, leaf_dtype):
        return jax.ShapeDtypeStruct(shape, leaf_dtype, sharding=here)

    def leaf(name, spec):
        if name in nvfp4:
            shape = tuple(nvfp4[name]["shape"])
            lead, k = shape[:-1], shape[-1]
            scalar = struct((), jnp.float32)
            return NVFP4Array(packed=struct(lead + (k // 2,), jnp.uint8),
                              block_scale=struct(lead + (k // 16,), jnp.float8_e4m3fn),
                              global_scale=scalar, shape=shape,
                              input_scale=scalar if nvfp4[name]["input_scale"] else None)
        return struct(spec.shape, dtype)

    return map_named(leaf, abstract)


def _restore(path: Path, kind: str):
    """(config, params) as saved; a folder of the other kind is refused."""
    import orbax.checkpoint as ocp  # third-party, slow to import: only when loading such a folder

    with open(path / SAVED_MARKER) as f:
        meta = json.load(f)
    if meta.get("kind") != kind:
        raise CheckpointError(f"{path}: holds a {meta.get('kind')}, not a {kind}")
    cfg = config_from_saved_json(kind, meta["config"])
    model_cfg = cfg if kind == "target" else cfg.model
    abstract = abstract_target(cfg) if kind == "target" else abstract_drafter(cfg)
    target_tree = _abstract_restore_target(abstract, meta.get("nvfp4", {}), model_cfg.storage_dtype)
    params = ocp.StandardCheckpointer().restore(path.absolute() / "params", target_tree)
    if int(meta.get("version", 1)) < 2 and kind == "target" and cfg.is_hybrid:
        params = map_named(lambda n, x: x if (o := qkv_order(kind, n, cfg)) is None else rows_taken(x, o), params)
    return cfg, params


def _cast_dense(params, dtype):
    return map_named(lambda n, x: x if isinstance(x, NVFP4Array) else x.astype(dtype), params)


def load_saved(path: Path, kind: str, *, param_dtype: str, compute_dtype: str):
    """The Target or Drafter (`kind`) a `save` folder holds, its dense leaves in `param_dtype` (NVFP4 leaves as
    saved) and its config computing in `compute_dtype`."""
    cfg, params = _restore(path, kind)
    if kind == "target":
        cfg = cfg.replace(param_dtype=param_dtype, compute_dtype=compute_dtype)
        return Target(params=_cast_dense(params, cfg.storage_dtype), config=cfg)
    model = cfg.model.replace(param_dtype=param_dtype, compute_dtype=compute_dtype)
    return Drafter(params=_cast_dense(params, model.storage_dtype), config=cfg.replace(model=model))


__all__ = ["save", "load_saved", "config_from_saved_json", "SAVED_MARKER"]
