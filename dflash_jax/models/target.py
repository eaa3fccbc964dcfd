"""The target model (Qwen3, Qwen2, Llama, Mistral, Qwen3.5 hybrids: one code path, config switches): params +
static config, a preallocated KV cache with per-row lengths, one forward.

One function (`forward_with_cache`) serves prefill, extend and verify: the new tokens' K/V are written at each row's
current length, the tokens attend causally to the cache (slots below length + T), and the cache comes back with
lengths advanced by T. Rollback is arithmetic on `lengths`; rejected slots stay in
memory, are never visible (only slots below a length are), and get overwritten by the next write.

Hybrid targets (Qwen3.5: `layer_types`) mix attention layers with Gated DeltaNet layers (models/deltanet.py), whose
cache entry is a conv window and a recurrent state instead of K/V. Those cannot roll back by a length: a verify pass
(`defer_states=True`) leaves them untouched and records its delta-rule inputs in `KVCache.deferred`, and
`commit_states` applies each row's accepted prefix once acceptance is known.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.models import deltanet as dn
from dflash_jax.models.layers import decoder_layer, linear_attn_layer, norm, write_rows
from dflash_jax.quant.linear import backend_scope, embedding_rows, linear, program_backend
from dflash_jax.params import TargetParams, abstract_target, committed, init_from_abstract, static_field


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Target:
    params: TargetParams
    config: TargetConfig = static_field()

    def replace(self, **changes) -> "Target":
        return dataclasses.replace(self, **changes)

    @property
    def lm_head(self):
        return self.params.embed_tokens if self.params.lm_head is None else self.params.lm_head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array | None, ...]  # per layer [B, S, nKV, hd], post-RoPE (None: a DeltaNet layer)
    v: tuple[jax.Array | None, ...]  # per layer [B, S, nKV, hd]
    lengths: jax.Array  # [B] int32: positions < lengths[b] are valid
    # Hybrid targets only (None otherwise), per layer, None for attention layers:
    conv: tuple[jax.Array | None, ...] | None = None  # [B, K-1, C] the DeltaNet's conv window
    state: tuple[jax.Array | None, ...] | None = None  # [B, nV, dk, dv] float32 recurrent state
    deferred: tuple | None = None  # per layer DeltaInputs of a verify pass not yet committed (`commit_states`)

    @property
    def max_len(self) -> int:
        return next(k for k in self.k if k is not None).shape[1]

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)

    @classmethod
    def empty(cls, cfg: TargetConfig, batch: int, max_len: int) -> "KVCache":
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        attn = [cfg.layer_type(i) == "full_attention" for i in range(cfg.num_hidden_layers)]
        if not any(attn):
            raise ValueError("config: a target needs at least one full_attention layer (its KV cache holds the "
                             "positions)")
        # One buffer per array (k and v never share one), so a cache can be donated and updated in place.
        k = tuple(jnp.zeros(shape, cfg.dtype) if a else None for a in attn)
        v = tuple(jnp.zeros(shape, cfg.dtype) if a else None for a in attn)
        conv = state = None
        if cfg.is_hybrid:
            pairs = [None if a else dn.empty_states(cfg, batch) for a in attn]
            conv = tuple(None if p is None else p[0] for p in pairs)
            state = tuple(None if p is None else p[1] for p in pairs)
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), conv=conv, state=state)

    def state_bytes_per_row(self) -> int:
        """Bytes of the DeltaNet states (conv windows and recurrent states) one row holds."""
        leaves = [x for x in (self.conv or ()) + (self.state or ()) if x is not None]
        return sum(x.nbytes // x.shape[0] for x in leaves)


def init_target(cfg: TargetConfig, key: jax.Array) -> Target:
    params = init_from_abstract(abstract_target(cfg), key, cfg.storage_dtype)
    return Target(params=params, config=cfg)


def forward_hidden(target: Target, tokens: jax.Array, cache: KVCache | None, layer_ids: Sequence[int] = (), *,
                   positions: jax.Array | None = None, windows: Sequence[int | None] | None = None,
                   empty_cache: bool = False, state_keep: jax.Array | None = None,
                   defer_states: bool = False) -> tuple[jax.Array, jax.Array, KVCache | None]:
    """The decoder stack over T new tokens per row: (final-normed hidden [B, T, H], features, cache).

    See `forward_with_cache`; this stops before the LM head, so callers that keep a few rows (prefill keeps one per
    row) project only those. windows: per-layer sliding windows (None = full attention everywhere, as Qwen3).
    empty_cache: the cache holds nothing yet (prefill): the new K/V are written, the empty cache is not attended
    (attending to a constant-empty cache only gives XLA constants to fold at compile time).
    Hybrid targets: state_keep [B] makes the DeltaNet states absorb only each row's first state_keep[b] tokens
    (right-padded prompts; None = all T); defer_states leaves them untouched and records the pass in
    `cache.deferred` for `commit_states` (verify). With cache=None the DeltaNet layers start from zero states.
    """
    cfg = target.config
    p = target.params
    B, T = tokens.shape
    layer_ids = tuple(int(i) for i in layer_ids)
    for i in layer_ids:
        if not 0 <= i < cfg.num_hidden_layers:
            raise ValueError(f"layer id {i} outside 0..{cfg.num_hidden_layers - 1}")
    windows = (None,) * cfg.num_hidden_layers if windows is None else tuple(windows)
    if len(windows) != cfg.num_hidden_layers:
        raise ValueError(f"windows: {len(windows)} entries for {cfg.num_hidden_layers} layers")
    if positions is None:  # with a cache, the new tokens must sit at slots lengths..lengths+T-1 (the default)
        start = jnp.zeros((B,), jnp.int32) if cache is None else cache.lengths
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]

    x = embedding_rows(p.embed_tokens, tokens, cfg.dtype)  # [B, T, H]
    new_k, new_v, feats = [], [], {}
    new_conv, new_state, deferred = [], [], []
    for i, layer in enumerate(p.layers):
        if cfg.layer_type(i) == "linear_attention":
            with jax.named_scope(f"layer{i}"):
                if cache is None:
                    conv, state = dn.empty_states(cfg, B)
                else:
                    conv, state = cache.conv[i], cache.state[i]
                if defer_states:
                    x, d = linear_attn_layer(layer, x, cfg, conv, state, keep=state_keep, defer=True)
                    deferred.append(d)
                else:
                    x, conv, state = linear_attn_layer(layer, x, cfg, conv, state, keep=state_keep)
                    deferred.append(None)
                new_k.append(None)
                new_v.append(None)
                new_conv.append(conv)
                new_state.append(state)
            if i in layer_ids:
                feats[i] = x
            continue
        new_conv.append(None)
        new_state.append(None)
        deferred.append(None)
        with jax.named_scope(f"layer{i}"):
            kw = dict(causal=True, window=windows[i])
            if cache is None or empty_cache:  # the new tokens see each other only
                x, k, v = decoder_layer(layer, x, positions, cfg, **kw)
                if cache is not None:
                    new_k.append(write_rows(cache.k[i], k, positions))
                    new_v.append(write_rows(cache.v[i], v, positions))
            else:  # written at each row's length first, then the cache is attended (slots < length + T)
                x, k, v = decoder_layer(layer, x, positions, cfg, cache_k=cache.k[i], cache_v=cache.v[i],
                                        cache_len=cache.lengths + T, write=True, **kw)
                new_k.append(k)
                new_v.append(v)
        if i in layer_ids:
            feats[i] = x
    h = norm(x, p.norm, cfg)
    features = (jnp.concatenate([feats[i] for i in layer_ids], axis=-1) if layer_ids
                else jnp.zeros((B, T, 0), cfg.dtype))
    if cache is not None:
        hybrid = dict(conv=tuple(new_conv), state=tuple(new_state),
                      deferred=tuple(deferred) if defer_states else None) if cfg.is_hybrid else {}
        cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + T, **hybrid)
    return h, features, cache


def commit_states(cache: KVCache, n: jax.Array, cfg: TargetConfig) -> KVCache:
    """The cache after a deferred (verify) pass keeps only each row's first n[b] tokens in its DeltaNet states
    (0 <= n <= T; see `models.deltanet.commit`); KV entries roll back by `lengths` as for dense targets (the
    caller sets them). A cache without deferred states comes back as it is."""
    if cache.deferred is None:
        return cache
    conv, state = list(cache.conv), list(cache.state)
    for i, d in enumerate(cache.deferred):
        if d is not None:
            conv[i], state[i] = dn.commit(d, cache.state[i], n, cfg.linear_conv_kernel_dim - 1)
    return cache.replace(conv=tuple(conv), state=tuple(state), deferred=None)


def lm_logits(target: Target, h: jax.Array) -> jax.Array:
    """Final-normed hidden [..., H] -> logits [..., V] float32."""
    return linear(h, target.lm_head).astype(jnp.float32)


def forward_with_cache(target: Target, tokens: jax.Array, cache: KVCache | None,
                       layer_ids: Sequence[int] = (), *, positions: jax.Array | None = None,
                       logits_at: jax.Array | None = None, windows: Sequence[int | None] | None = None,
                       empty_cache: bool = False, state_keep: jax.Array | None = None,
                       defer_states: bool = False) -> tuple[jax.Array, jax.Array, KVCache | None]:
    """Run T new tokens per row on top of `cache`.

    tokens [B, T] int; cache lengths [B] give each row's start position. Returns
    (logits [B, T, V] f32, features [B, T, len(layer_ids)*H], cache with the new K/V written and lengths += T).
    logits_at [B, R] int: logits only at those token indices ([B, R, V]), e.g. the last prompt token of each row.
    empty_cache: a freshly allocated cache (prefill), written but not attended (see `forward_hidden`).
    state_keep / defer_states: a hybrid target's DeltaNet states (see `forward_hidden` and `commit_states`).
    With cache=None the tokens are a fresh sequence at positions 0..T-1 (training / no-cache use).
    Feature id L is the output of decoder layer L (0-based), i.e. HF `hidden_states[L + 1]`.
    """
    cfg = target.config
    B, T = tokens.shape
    h, features, cache = forward_hidden(target, tokens, cache, layer_ids, positions=positions, windows=windows,
                                        empty_cache=empty_cache, state_keep=state_keep, defer_states=defer_states)
    if logits_at is not None:
        h = jnp.take_along_axis(h, logits_at.astype(jnp.int32)[..., None], axis=1)  # [B, R, H]
    logits = lm_logits(target, h)
    chex.assert_shape(logits, (B, T if logits_at is None else logits_at.shape[1], cfg.vocab_size))
    return logits, features, cache


def target_forward(target: Target, tokens, layer_ids: Sequence[int] = (), *,
                   nvfp4_backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Public call: logits [B, T, V] f32 and features [B, T, len(layer_ids)*H] for tokens at positions 0..T-1.

    nvfp4_backend: for NVFP4 weights (see `dflash_jax.quant.linear`); None = the current default, resolved per call.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [B, T], got {tokens.dtype}{list(tokens.shape)}")
    if not isinstance(tokens, jax.core.Tracer):
        bad = np.argwhere((np.asarray(tokens) < 0) | (np.asarray(tokens) >= target.config.vocab_size))
        if len(bad):
            b, t = bad[0]
            raise ValueError(f"token id {int(tokens[b, t])} at row {b}, position {t} is outside the vocabulary "
                             f"[0, {target.config.vocab_size})")
    backend = program_backend(target, backend=nvfp4_backend)
    logits, features, _ = _target_forward_jit(committed(target), tokens, tuple(int(i) for i in layer_ids), backend)
    return logits, features


@jax.jit(static_argnums=(2, 3))
def _target_forward_jit(target, tokens, layer_ids, backend):
    with backend_scope(backend):
        return forward_with_cache(target, tokens, None, layer_ids)
