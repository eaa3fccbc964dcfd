"""The Qwen3 target model: params + static config, a preallocated KV cache with per-row lengths, one forward.

One function (`forward`) serves prefill, extend and verify: it writes the new tokens' K/V at each row's current
length and returns the cache with lengths advanced by T. Rollback is arithmetic on `lengths`; rejected slots stay in
memory, are masked by `position < length`, and get overwritten by the next write.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import Qwen3Config
from dflash_jax.layers import attend, mlp, project_kv, project_q, rms_norm, write_rows
from dflash_jax.linear import linear
from dflash_jax.params import (TargetParams, abstract_target, init_from_abstract, static_field)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Target:
    params: TargetParams
    config: Qwen3Config = static_field()

    def replace(self, **changes) -> "Target":
        return dataclasses.replace(self, **changes)

    @property
    def lm_head(self):
        return self.params.embed_tokens if self.params.lm_head is None else self.params.lm_head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, nKV, hd], post-RoPE
    v: tuple[jax.Array, ...]  # per layer [B, S, nKV, hd]
    lengths: jax.Array  # [B] int32: positions < lengths[b] are valid

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)

    @classmethod
    def empty(cls, cfg: Qwen3Config, batch: int, max_len: int) -> "KVCache":
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_hidden_layers))
        return cls(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))


def init_target(cfg: Qwen3Config, key: jax.Array) -> Target:
    params = init_from_abstract(abstract_target(cfg), key, cfg.storage_dtype)
    return Target(params=params, config=cfg)


def forward_with_cache(target: Target, tokens: jax.Array, cache: KVCache | None,
                       layer_ids: Sequence[int] = (), *, positions: jax.Array | None = None,
                       ) -> tuple[jax.Array, jax.Array, KVCache | None]:
    """Run T new tokens per row on top of `cache`.

    tokens [B, T] int; cache lengths [B] give each row's start position. Returns
    (logits [B, T, V] f32, features [B, T, len(layer_ids)*H], cache with the new K/V written and lengths += T).
    With cache=None the tokens are a fresh sequence at positions 0..T-1 (training / no-cache use).
    Feature id L is the output of decoder layer L (0-based), i.e. HF `hidden_states[L + 1]`.
    """
    cfg = target.config
    p = target.params
    B, T = tokens.shape
    layer_ids = tuple(int(i) for i in layer_ids)
    for i in layer_ids:
        if not 0 <= i < cfg.num_hidden_layers:
            raise ValueError(f"layer id {i} outside 0..{cfg.num_hidden_layers - 1}")
    if positions is None:
        start = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    if cache is None:
        key_pos = positions  # [B, S=T]
    else:
        key_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (B, cache.max_len))
    # Causal over absolute positions: cached keys of this row and the new ones up to the query itself.
    mask = key_pos[:, None, :] <= positions[:, :, None]  # [B, T, S]

    x = jnp.take(p.embed_tokens, tokens, axis=0).astype(cfg.dtype)  # [B, T, H]
    new_k, new_v, feats = [], [], {}
    for i, layer in enumerate(p.layers):
        with jax.named_scope(f"layer{i}"):
            h = rms_norm(x, layer.input_layernorm, cfg.rms_norm_eps)
            q = project_q(layer.self_attn, h, positions, cfg)
            k, v = project_kv(layer.self_attn, h, positions, cfg)
            if cache is not None:
                k = write_rows(cache.k[i], k, positions)
                v = write_rows(cache.v[i], v, positions)
                new_k.append(k)
                new_v.append(v)
            x = x + linear(attend(q, k, v, mask), layer.self_attn.o_proj)
            x = x + mlp(layer.mlp, rms_norm(x, layer.post_attention_layernorm, cfg.rms_norm_eps))
        if i in layer_ids:
            feats[i] = x
    logits = linear(rms_norm(x, p.norm, cfg.rms_norm_eps), target.lm_head).astype(jnp.float32)
    features = (jnp.concatenate([feats[i] for i in layer_ids], axis=-1) if layer_ids
                else jnp.zeros((B, T, 0), cfg.dtype))
    chex.assert_shape(logits, (B, T, cfg.vocab_size))
    if cache is not None:
        cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + T)
    return logits, features, cache


def target_forward(target: Target, tokens, layer_ids: Sequence[int] = ()) -> tuple[jax.Array, jax.Array]:
    """Public call: logits [B, T, V] f32 and features [B, T, len(layer_ids)*H] for tokens at positions 0..T-1."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype}{list(tokens.shape)}")
    if not isinstance(tokens, jax.core.Tracer):
        bad = np.argwhere((np.asarray(tokens) < 0) | (np.asarray(tokens) >= target.config.vocab_size))
        if len(bad):
            b, t = bad[0]
            raise ValueError(f"token id {int(tokens[b, t])} at row {b}, position {t} is outside the vocabulary "
                             f"[0, {target.config.vocab_size})")
    logits, features, _ = _target_forward_jit(target, tokens, tuple(int(i) for i in layer_ids))
    return logits, features


@jax.jit(static_argnums=(2,))
def _target_forward_jit(target, tokens, layer_ids):
    return forward_with_cache(target, tokens, None, layer_ids)
