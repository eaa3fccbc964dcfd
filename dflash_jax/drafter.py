"""The DFlash drafter: KV injection of target features, and one non-causal pass over a block of mask tokens.

Per layer, the fused context `ctx = hidden_norm(fc(concat of target layer outputs))` is projected with the layer's own
`k_proj`/`k_norm`/`v_proj` (RoPE at the context tokens' absolute positions) into keys/values that sit in front of the
block's own keys/values. Context K/V are cached (post-RoPE) with per-row lengths; the block's K/V are scratch and are
never written, so the cache only ever holds committed positions (< block start).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, check_pair
from dflash_jax.layers import decoder_layer, project_kv, rms_norm, write_rows
from dflash_jax.linear import backend_scope, linear, program_backend
from dflash_jax.params import DrafterParams, abstract_drafter, init_from_abstract, static_field
from dflash_jax.target import KVCache, Target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafter:
    params: DrafterParams
    config: DrafterConfig = static_field()

    def replace(self, **changes) -> "Drafter":
        return dataclasses.replace(self, **changes)


class DraftCache:
    """The drafter's context cache is a `KVCache` (per layer [B, S, nKV, hd] keys after k_norm + RoPE, and values;
    lengths [B] = committed context positions held). This only builds an empty one from a DrafterConfig."""

    @staticmethod
    def empty(cfg: DrafterConfig, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(cfg.model, batch, max_len)


def init_drafter(cfg: DrafterConfig, key: jax.Array) -> Drafter:
    return Drafter(params=init_from_abstract(abstract_drafter(cfg), key, cfg.model.storage_dtype), config=cfg)


def fuse_context(drafter: Drafter, features: jax.Array) -> jax.Array:
    """[B, C, K*H] target features -> [B, C, H] context, computed once and shared by every layer."""
    cfg = drafter.config.model
    return rms_norm(linear(features.astype(cfg.dtype), drafter.params.fc), drafter.params.hidden_norm,
                    cfg.rms_norm_eps)


def context_kv(drafter: Drafter, features: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per drafter layer, the context keys (k_norm + RoPE at `positions` [B, C]) and values [B, C, nKV, hd] of target
    features [B, C, K*H]: what every block query sees of the context. Inference caches them (`append_context`);
    training uses them directly."""
    cfg = drafter.config.model
    ctx = fuse_context(drafter, features)
    return [project_kv(layer.self_attn, ctx, positions, cfg) for layer in drafter.params.layers]


def append_context(drafter: Drafter, features: jax.Array, n_valid: jax.Array, cache: KVCache) -> KVCache:
    """Append the first n_valid[b] of features [B, C, K*H] to each row's context K/V (a static-width slab)."""
    cfg = drafter.config.model
    B, C, _ = features.shape
    chex.assert_shape(features, (B, C, drafter.config.num_taps * cfg.hidden_size))
    offsets = jnp.arange(C, dtype=jnp.int32)[None, :]
    positions = cache.lengths[:, None] + offsets  # [B, C]
    # Slots past a row's valid count go to an out-of-range index and are dropped by the scatter.
    write_pos = jnp.where(offsets < n_valid[:, None], positions, cache.max_len)
    kv = context_kv(drafter, features, positions)
    ks = tuple(write_rows(cache.k[i], k, write_pos) for i, (k, _) in enumerate(kv))
    vs = tuple(write_rows(cache.v[i], v, write_pos) for i, (_, v) in enumerate(kv))
    return KVCache(k=ks, v=vs, lengths=cache.lengths + n_valid.astype(jnp.int32))


def block_pass(drafter: Drafter, x: jax.Array, positions: jax.Array, ctx_k, ctx_v, ctx_len: jax.Array, *,
               mask: jax.Array | None = None, causal: bool = False,
               windows: tuple[int | None, ...] | None = None, chunk: int | None = None) -> jax.Array:
    """The drafter layer stack over block queries x [B, Q, H] at positions [B, Q].

    ctx_k/ctx_v: per layer [B, S, nKV, hd] context keys/values, slot = position, valid below ctx_len ([B] per row,
    or [B, Q] per query); mask [B, Q, Q]: which block keys each query sees (None: the whole block). causal / windows:
    the layers' visibility rule (DFlash drafters: non-causal, full). Inference (one block, cache) and training (many
    blocks per sequence, one mask) both call this, so what is trained is exactly what runs. Returns the final-normed
    hidden states [B, Q, H].
    """
    cfg = drafter.config.model
    windows = (None,) * len(drafter.params.layers) if windows is None else tuple(windows)
    if len(windows) != len(drafter.params.layers):
        raise ValueError(f"windows: {len(windows)} entries for {len(drafter.params.layers)} drafter layers")
    for i, layer in enumerate(drafter.params.layers):
        with jax.named_scope(f"draft_layer{i}"):
            x, _, _ = decoder_layer(layer, x, positions, cfg, cache_k=ctx_k[i], cache_v=ctx_v[i], cache_len=ctx_len,
                                    mask=mask, causal=causal, window=windows[i], chunk=chunk)
    return rms_norm(x, drafter.params.norm, cfg.rms_norm_eps)


def embed_block(drafter: Drafter, target: Target, block: jax.Array) -> jax.Array:
    """Block tokens are embedded with the target's (frozen) embedding table."""
    return jnp.take(target.params.embed_tokens, block, axis=0).astype(drafter.config.model.dtype)


def block_hidden(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache) -> jax.Array:
    """One non-causal pass over block [B, bs] at positions lengths..lengths+bs-1 -> final hidden [B, bs, H].

    Every block slot sees all committed context (cache slots below the row's length) and the whole block."""
    B, bs = block.shape
    positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]  # [B, bs]
    return block_pass(drafter, embed_block(drafter, target, block), positions, cache.k, cache.v, cache.lengths,
                      chunk=drafter.config.model.attention_chunk)


def block_logits(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache,
                 num_slots: int | None = None) -> jax.Array:
    """Logits [B, num_slots, V] f32 for block slots 1..num_slots (slot k predicts position start+k itself)."""
    num_slots = block.shape[1] - 1 if num_slots is None else num_slots
    h = block_hidden(drafter, target, block, cache)[:, 1:1 + num_slots]
    return linear(h, target.lm_head).astype(jnp.float32)


def draft_logits(drafter: Drafter, target: Target, features, block, *,
                 nvfp4_backend: str | None = None) -> jax.Array:
    """Public call (no cache): logits [B, bs-1, V] for block slots 1..bs-1.

    features [B, C, K*H]: target layer outputs of context positions 0..C-1; block [B, bs] at positions C..C+bs-1.
    nvfp4_backend: for NVFP4 weights (see `dflash_jax.linear`); None = the current default, resolved per call.
    """
    check_pair(drafter.config, target.config)
    features, block = jnp.asarray(features), jnp.asarray(block)
    B, C = features.shape[:2]
    if block.ndim != 2 or block.shape[0] != B:
        raise ValueError(f"block must be [B={B}, bs], got {list(block.shape)}")
    want = drafter.config.num_taps * drafter.config.model.hidden_size
    if features.ndim != 3 or features.shape[-1] != want:
        raise ValueError(f"features must be [B, C, {want}] (len(target_layer_ids) * hidden), got "
                         f"{list(features.shape)}")
    return _draft_logits_jit(drafter, target, features, block, program_backend(drafter, target, backend=nvfp4_backend))


@jax.jit(static_argnums=(4,))
def _draft_logits_jit(drafter, target, features, block, backend):
    B, C = features.shape[:2]
    # The whole context is live here: one dense attention pass (no chunk loop, whose traced trip count would also
    # make the call impossible to differentiate in reverse mode, e.g. by audit_scales).
    cfg = drafter.config
    drafter = drafter.replace(config=cfg.replace(model=cfg.model.replace(attention_chunk=None)))
    with backend_scope(backend):
        cache = DraftCache.empty(drafter.config, B, C)
        cache = append_context(drafter, features, jnp.full((B,), C, jnp.int32), cache)
        return block_logits(drafter, target, block, cache)
