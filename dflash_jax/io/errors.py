"""The errors a model file or folder that cannot be loaded raises; every message names the file and what in it is
wrong (the tensor, the key), so a user can tell a bad download from a wrong path from an unsupported model."""

from __future__ import annotations

from dflash_jax.io.gguf import GGUFError


class CheckpointError(ValueError):
    """A model file or folder that cannot be this model."""


class GGUFDrafterError(GGUFError, CheckpointError):
    """A GGUF file that cannot be a DFlash drafter; the message names the file and the tensor or key."""


__all__ = ["CheckpointError", "GGUFDrafterError"]
