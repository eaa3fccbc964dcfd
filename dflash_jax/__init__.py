"""dflash-jax: DFlash block-diffusion speculative decoding with NVFP4 drafters, in JAX.

Public calls (a contract): `load_target`, `load_drafter` (folders and llama.cpp `dflash` GGUF files), `save`,
`save_hf`, `save_gguf`, `target_forward`, `draft_logits`, `draft_tokens`, `generate`, `generate_autoregressive`
(with `SamplingParams`, `GenerationOptions`), `audit_scales`, `audit_file`, `quantize_nvfp4`, `load_default`,
`enable_compilation_cache`, `load_tokenizer` (GGUF or tokenizer.json), `make_mesh`, `shard`
(dflash_jax.parallel.sharding), and the `nvfp4` module. Drafters are DFlash or DFlash2 (`DrafterConfig.kind`); every
call takes either.

The names load on first use (PEP 562): `import dflash_jax` imports no JAX until one of them is read, so the
`dflash-jax` command answers `--help` and refuses a bad argument without loading JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it, or for the names in _MODULES, the module it is
_WHERE = {
    "nvfp4": "dflash_jax.quant.nvfp4", "NVFP4Array": "dflash_jax.quant.nvfp4",
    "audit_scales": "dflash_jax.quant.audit", "ScaleAudit": "dflash_jax.quant.audit",
    "load_drafter": "dflash_jax.io.checkpoint", "load_target": "dflash_jax.io.checkpoint",
    "CheckpointError": "dflash_jax.io.errors", "save_gguf": "dflash_jax.io.gguf_drafter",
    "save_hf": "dflash_jax.io.hf_folder", "save": "dflash_jax.io.orbax_folder",
    "FileAudit": "dflash_jax.io.audit_file", "audit_file": "dflash_jax.io.audit_file",
    "enable_compilation_cache": "dflash_jax.io.compile_cache",
    "DrafterConfig": "dflash_jax.config", "Qwen3Config": "dflash_jax.config", "TargetConfig": "dflash_jax.config",
    "default_target_layer_ids": "dflash_jax.config",
    "Drafter": "dflash_jax.models.drafter", "draft_logits": "dflash_jax.models.drafter",
    "draft_tokens": "dflash_jax.models.drafter", "init_drafter": "dflash_jax.models.drafter",
    "GenerationOptions": "dflash_jax.decode.options",
    "generate": "dflash_jax.decode.programs", "generate_autoregressive": "dflash_jax.decode.programs",
    "GenerationResult": "dflash_jax.decode.result", "SamplingParams": "dflash_jax.decode.sampling",
    "drop_global_scales": "dflash_jax.quant.quantize", "quantize_nvfp4": "dflash_jax.quant.quantize",
    "KVCache": "dflash_jax.models.target", "Target": "dflash_jax.models.target",
    "init_target": "dflash_jax.models.target", "target_forward": "dflash_jax.models.target",
    "load_default": "dflash_jax.io.shipped", "smollm2_path": "dflash_jax.io.shipped",
    "sharding": "dflash_jax.parallel.sharding", "ShardingError": "dflash_jax.parallel.sharding",
    "make_mesh": "dflash_jax.parallel.sharding", "shard": "dflash_jax.parallel.sharding",
    "ModelTokenizer": "dflash_jax.io.tokenizer", "Tokenizer": "dflash_jax.io.tokenizer",
    "TokenizerError": "dflash_jax.io.tokenizer", "load_tokenizer": "dflash_jax.io.tokenizer",
    "GGUFError": "dflash_jax.io.gguf",
}

_MODULES = frozenset({"nvfp4", "sharding"})

__all__ = list(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'dflash_jax' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if name in _MODULES else getattr(module, name)  # `audit_file` is a function of io.audit_file
    globals()[name] = value  # read once: later reads are plain attribute reads
    return value


def __dir__():
    return sorted({*globals(), *_WHERE})


if TYPE_CHECKING:  # what static tools see: the names as if imported eagerly
    from dflash_jax.quant import nvfp4
    from dflash_jax.quant.audit import ScaleAudit, audit_scales
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.io.errors import CheckpointError
    from dflash_jax.io.gguf_drafter import save_gguf
    from dflash_jax.io.hf_folder import save_hf
    from dflash_jax.io.orbax_folder import save
    from dflash_jax.io.audit_file import FileAudit, audit_file
    from dflash_jax.io.compile_cache import enable_compilation_cache
    from dflash_jax.config import DrafterConfig, Qwen3Config, TargetConfig, default_target_layer_ids
    from dflash_jax.models.drafter import Drafter, draft_logits, draft_tokens, init_drafter
    from dflash_jax.decode.options import GenerationOptions
    from dflash_jax.decode.programs import generate, generate_autoregressive
    from dflash_jax.decode.result import GenerationResult
    from dflash_jax.decode.sampling import SamplingParams
    from dflash_jax.quant.nvfp4 import NVFP4Array
    from dflash_jax.quant.quantize import drop_global_scales, quantize_nvfp4
    from dflash_jax.models.target import KVCache, Target, init_target, target_forward
    from dflash_jax.io.shipped import load_default, smollm2_path
    from dflash_jax.parallel import sharding
    from dflash_jax.parallel.sharding import ShardingError, make_mesh, shard
    from dflash_jax.io.tokenizer import ModelTokenizer, Tokenizer, TokenizerError, load_tokenizer
    from dflash_jax.io.gguf import GGUFError
