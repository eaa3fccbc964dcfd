"""dflash-jax: DFlash block-diffusion speculative decoding with NVFP4 drafters, in JAX.

Public calls (a contract): `load_target`, `load_drafter`, `save`, `save_hf`, `target_forward`, `draft_logits`,
`draft_tokens`, `generate`, `generate_autoregressive` (with `SamplingParams`), `audit_scales`, `quantize_nvfp4`, `load_default`,
`enable_compilation_cache`, `make_mesh`, `shard` (dflash_jax.parallel.sharding), and the `nvfp4` module. Drafters are DFlash or
DFlash2 (`DrafterConfig.kind`); every call takes either.
"""

from dflash_jax.quant import nvfp4
from dflash_jax.quant.audit import ScaleAudit, audit_scales
from dflash_jax.io.checkpoint import CheckpointError, load_drafter, load_target, save, save_hf
from dflash_jax.io.compile_cache import enable_compilation_cache
from dflash_jax.config import DrafterConfig, Qwen3Config, default_target_layer_ids
from dflash_jax.models.drafter import Drafter, draft_logits, draft_tokens, init_drafter
from dflash_jax.decode.programs import GenerationResult, generate, generate_autoregressive
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.quant.nvfp4 import NVFP4Array
from dflash_jax.quant.quantize import drop_global_scales, quantize_nvfp4
from dflash_jax.models.target import KVCache, Target, init_target, target_forward
from dflash_jax.io.shipped import load_default
from dflash_jax.parallel import sharding
from dflash_jax.parallel.sharding import ShardingError, make_mesh, shard
from dflash_jax.io.tokenizer import Tokenizer

__all__ = [
    "nvfp4", "NVFP4Array", "audit_scales", "ScaleAudit",
    "Qwen3Config", "DrafterConfig", "default_target_layer_ids",
    "Target", "KVCache", "init_target", "target_forward",
    "Drafter", "init_drafter", "draft_logits", "draft_tokens",
    "generate", "generate_autoregressive", "GenerationResult", "SamplingParams",
    "load_target", "load_drafter", "save", "save_hf", "CheckpointError",
    "quantize_nvfp4", "drop_global_scales", "load_default", "Tokenizer", "enable_compilation_cache",
    "make_mesh", "shard", "ShardingError", "sharding",
]
