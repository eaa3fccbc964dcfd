"""What a model path is, decided in one place for every loader and the audit.

A model path is one of:
  - "hf": an HF folder, `config.json` next to `model.safetensors` (or `model.safetensors.index.json` and its shards):
    a Qwen3 / Qwen2 / Llama / Mistral / Qwen3.5 target, a z-lab DFlash / DFlash2 drafter, or either exported by
    ModelOpt in NVFP4 (`hf_quant_config.json`);
  - "saved": a folder written by `dflash_jax.save` (`dflash_jax.json` next to orbax's `params/`);
  - "gguf": a llama.cpp GGUF file (a `.gguf` suffix or the GGUF magic): a target, or a `dflash` drafter.
Anything else is refused here, before any reader runs, with an error that says what the path is and what it could
be: a bare `.safetensors` file (tensors without their config), an empty folder, a folder with no config, a missing
path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.gguf import GGUFFile, is_gguf
from dflash_jax.io.hf_config import read_config_json
from dflash_jax.io.zlab_config import is_drafter_config

SAVED_MARKER = "dflash_jax.json"  # written by `dflash_jax.save` next to orbax's params/
FORMATS = ("hf", "saved", "gguf")

WHAT_IT_CAN_BE = {
    "target": "a target is an HF folder (config.json + model.safetensors; Qwen3, Qwen2, Llama, Mistral, Qwen3.5, "
              "or a ModelOpt NVFP4 export of one), a folder written by dflash_jax.save (dflash_jax.json), or a "
              "llama.cpp GGUF file (.gguf)",
    "drafter": "a drafter is a z-lab DFlash / DFlash2 folder (config.json + model.safetensors, or a ModelOpt NVFP4 "
               "export of one), a folder written by dflash_jax.save (dflash_jax.json), or a llama.cpp dflash GGUF "
               "file (.gguf)",
    "model": "a model is an HF / z-lab / ModelOpt folder (config.json + model.safetensors), a folder written by "
             "dflash_jax.save (dflash_jax.json), or a llama.cpp GGUF file (.gguf)",
}


@dataclasses.dataclass(frozen=True)
class ModelPath:
    """A path known to be a model of one format (`FORMATS`); `role` says whether it holds a target or a drafter."""

    path: Path
    format: str

    @property
    def role(self) -> str:
        """"target" or "drafter", from what the path itself records (the saved kind, the config's architectures,
        the GGUF architecture)."""
        if self.format == "saved":
            return json.loads((self.path / SAVED_MARKER).read_text()).get("kind")
        if self.format == "hf":
            return "drafter" if is_drafter_config(read_config_json(self.path)) else "target"
        return "drafter" if GGUFFile(self.path).architecture == "dflash" else "target"


def model_path(path: str | Path, what: str = "model") -> ModelPath:
    """The format of `path`, or an error naming what the path is and what a `what` ("target", "drafter", "model")
    can be: FileNotFoundError when there is nothing model-like there (a missing path, a folder without a config),
    CheckpointError when there is something else (a bare .safetensors file, another kind of file)."""
    path = Path(path)
    can_be = WHAT_IT_CAN_BE[what]
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder; {can_be}")
    if path.is_file():
        if is_gguf(path):
            return ModelPath(path, "gguf")
        if path.suffix == ".safetensors":
            raise CheckpointError(f"{path}: a bare .safetensors file holds tensors but not the config that says what "
                                  f"they are; give the folder holding it and its config.json ({can_be})")
        raise CheckpointError(f"{path}: a file that is not GGUF (no GGUF magic); {can_be}")
    if (path / SAVED_MARKER).exists():
        return ModelPath(path, "saved")
    if (path / "config.json").exists():
        return ModelPath(path, "hf")
    if not any(path.iterdir()):
        raise FileNotFoundError(f"{path}: an empty folder (no config.json, no {SAVED_MARKER}); {can_be}")
    tensors = sorted(p.name for p in path.glob("*.safetensors"))
    held = f"it holds {', '.join(tensors[:3])} but " if tensors else ""
    raise FileNotFoundError(f"{path}: {held}no config.json or {SAVED_MARKER} in this folder; {can_be}")


__all__ = ["ModelPath", "model_path", "SAVED_MARKER", "FORMATS", "WHAT_IT_CAN_BE"]
