"""dflash-jax: DFlash block-diffusion speculative decoding with NVFP4 drafters, in JAX.

Public calls (a contract): `load_target`, `load_drafter` (folders and llama.cpp `dflash` GGUF files), `save`,
`save_hf`, `save_gguf`, `target_forward`, `draft_logits`, `draft_tokens`, `generate`, `generate_autoregressive`
(with `SamplingParams`, `GenerationOptions`), `audit_scales`, `audit_file`, `quantize_nvfp4`, `load_default`,
`enable_compilation_cache`, `load_tokenizer` (GGUF or tokenizer.json), `make_mesh`, `shard`
(dflash_jax.parallel.sharding), and the `nvfp4` module. Drafters are DFlash or DFlash2 (`DrafterConfig.kind`); every
call takes either.
"""

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

__all__ = [
    "nvfp4", "NVFP4Array", "audit_scales", "ScaleAudit",
    "TargetConfig", "Qwen3Config", "DrafterConfig", "default_target_layer_ids",
    "Target", "KVCache", "init_target", "target_forward",
    "Drafter", "init_drafter", "draft_logits", "draft_tokens",
    "generate", "generate_autoregressive", "GenerationResult", "SamplingParams", "GenerationOptions",
    "load_target", "load_drafter", "save", "save_hf", "save_gguf", "CheckpointError", "audit_file", "FileAudit",
    "quantize_nvfp4", "drop_global_scales", "load_default", "Tokenizer", "load_tokenizer", "ModelTokenizer",
    "TokenizerError", "GGUFError", "smollm2_path", "enable_compilation_cache",
    "make_mesh", "shard", "ShardingError", "sharding",
]
