"""The embedded default models: the small target and DFlash drafter trained and shipped in `checkpoints/`."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_jax.checkpoint import load_drafter, load_target
from dflash_jax.tokenizer import Tokenizer


ENV_VAR = "DFLASH_JAX_CHECKPOINTS"


def checkpoints_dir() -> Path:
    """Where the shipped models are: `$DFLASH_JAX_CHECKPOINTS` when set; else the copy installed with the package
    (`dflash_jax/checkpoints`, the repository's top-level `checkpoints/` mapped into the wheel); else the
    `checkpoints/` folder next to the package (a source checkout or an editable install)."""
    env = os.environ.get(ENV_VAR)
    here = Path(__file__).resolve().parent
    candidates = [Path(env)] if env else [here / "checkpoints", here.parent / "checkpoints"]
    for path in candidates:
        if (path / "tokenizer.json").exists():
            return path
    raise FileNotFoundError(
        f"no shipped checkpoints in {' or '.join(map(str, candidates))}: install the package (pip install .), run "
        f"from a clone of the repository, or set {ENV_VAR} to a folder holding tokenizer.json, target/ and drafter/")


def load_default(*, compute_dtype: str | None = None, param_dtype: str | None = None):
    """(target, drafter, tokenizer) from `checkpoints_dir()`.

    Dtypes default as for `load_target`: compute in bfloat16 on accelerators and float32 on CPU, parameters stored in
    the compute dtype (so no linear converts its weights inside the decode loop)."""
    root = checkpoints_dir()
    tokenizer = Tokenizer.from_file(root / "tokenizer.json")
    target = load_target(root / "target", compute_dtype=compute_dtype, param_dtype=param_dtype)
    drafter = load_drafter(root / "drafter", compute_dtype=compute_dtype, param_dtype=param_dtype)
    return target, drafter, tokenizer
