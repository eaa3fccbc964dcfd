"""Where loaded parameters live and in what dtype: the defaults every loader shares."""

from __future__ import annotations

from dflash_jax.config import default_compute_dtype
from dflash_jax.parallel import sharding as shd


def loading_dtypes(param_dtype: str | None, compute_dtype: str | None) -> tuple[str, str]:
    """Loader defaults: compute in bfloat16 on accelerators and float32 on CPU (`default_compute_dtype`), and store
    parameters in the compute dtype, whatever a file holds: float32 weights under bf16 compute would double the
    weight traffic of every linear inside the decode loop (bf16 files on CPU are widened once, exactly)."""
    compute = compute_dtype or default_compute_dtype()
    return param_dtype or compute, compute


def shard_if(model, mesh):
    """The model placed on `mesh` by `dflash_jax.parallel.sharding`'s rules, or as it is when mesh is None."""
    return model if mesh is None else shd.shard(model, mesh)


__all__ = ["loading_dtypes", "shard_if"]
