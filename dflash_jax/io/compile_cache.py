"""JAX's persistent compilation cache for dflash-jax: compiled programs kept on disk, so a later process that builds
the same program (same shapes, static arguments, backend) loads it instead of compiling it again.

On by default for the `dflash-jax` command and the benchmark scripts; a library never switches it on behind its
user's back, so library code asks for it in one line:

    import dflash_jax; dflash_jax.enable_compilation_cache()

Location: `$XDG_CACHE_HOME/dflash-jax/xla` (default `~/.cache/dflash-jax/xla`), or the path given.
`DFLASH_JAX_NO_COMPILE_CACHE=1` turns it off everywhere. JAX never stores a program that contains a host callback,
which is why the CLI and benchmarks time prefill with `prefill_timing="rerun"` (see `dflash_jax.generate`).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_OFF = "DFLASH_JAX_NO_COMPILE_CACHE"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-jax" / "xla"


def enable_compilation_cache(path: str | Path | None = None, *, min_compile_time_s: float = 0.2) -> Path | None:
    """Keep compiled programs in `path` (default `default_cache_dir()`); returns the folder, or None when
    DFLASH_JAX_NO_COMPILE_CACHE is set. Programs that compile in under `min_compile_time_s` are not written (reading
    many tiny entries back costs more than compiling them)."""
    if os.environ.get(ENV_OFF, "").strip() not in ("", "0"):
        return None
    from jax.experimental.compilation_cache import compilation_cache as cc

    folder = Path(path) if path is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    cc.set_cache_dir(str(folder))
    cc.reset_cache()  # JAX decides once whether a cache is in use; a compile before this call must not freeze "no"
    return folder


__all__ = ["enable_compilation_cache", "default_cache_dir", "ENV_OFF"]
