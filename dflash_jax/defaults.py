"""The embedded default models: the small target and DFlash drafter trained and shipped in `checkpoints/`."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_jax.checkpoint import load_drafter, load_target
from dflash_jax.tokenizer import Tokenizer


def checkpoints_dir() -> Path:
    """`$DFLASH_JAX_CHECKPOINTS`, else `checkpoints/` next to the package (plain clone or editable install)."""
    env = os.environ.get("DFLASH_JAX_CHECKPOINTS")
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "checkpoints"
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"no shipped checkpoints in {path}: run from a clone of the repository (pip install -e .), or set "
            "DFLASH_JAX_CHECKPOINTS to a folder holding tokenizer.json, target/ and drafter/")
    return path


def load_default(*, compute_dtype: str | None = None):
    """(target, drafter, tokenizer) from `checkpoints/`."""
    root = checkpoints_dir()
    tokenizer = Tokenizer.from_file(root / "tokenizer.json")
    target = load_target(root / "target", compute_dtype=compute_dtype)
    drafter = load_drafter(root / "drafter", compute_dtype=compute_dtype)
    return target, drafter, tokenizer
