"""The target model (Qwen3, Qwen2, Llama, Mistral, Qwen3.5 hybrids: one code path, config switches): params +
static config, a preallocated KV cache with per-row lengths, one forward.

One function (`forward_with_cache`) serves prefill, extend and verify: the new tokens' K/V are written at each row's
current length, the tokens attend causally to the cache (slots below length + T), and the cache comes back with
lengths advanced by T. Rollback is arithmetic on `lengths`; rejected slots stay in
memory, are never visible (only slots below a length are), and get overwritten by the next write.

Hybrid targets (Qwen3.5: `layer_types`) mix attention layers with Gated DeltaNet layers (models/deltanet.py), whose
cache entry (models/cache.py) is a conv window and a recurrent state instead of K/V: one step function per layer
type. Those states cannot roll back by a length: a verify pass (`defer_states=True`) leaves them untouched and
records its delta-rule inputs in the entry (`DeltaNetCache.deferred`), and `commit_states` applies each row's
accepted prefix once acceptance is known.

Draft trees (`forward_tree`, `commit_tree`): the nodes of a tree are verified in one pass with the cache read-only
(valid below each row's committed length) plus the nodes' own keys under an ancestor mask, at positions committed
length + depth; a hybrid's DeltaNet runs each node from its parent's states. Nothing is written: the pass returns
each layer's fresh K/V (or DeltaNet inputs), and `commit_tree` writes the accepted path's into consecutive slots
(slot = position) and commits its DeltaNet states, once the walk has chosen it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import execution
from dflash_jax.config import TargetConfig
from dflash_jax.frozen import Replaceable
from dflash_jax.models import deltanet as dn
from dflash_jax.models.cache import AttentionCache, DeltaNetCache, KVCache
from dflash_jax.models.layers import decoder_layer, linear_attn_layer, norm, write_kv, write_kv_run
from dflash_jax.quant.linear import embedding_rows, linear, program_backend
from dflash_jax.params import (DecoderLayer, LinearAttnLayer, TargetParams, abstract_target, committed,
                               init_from_abstract, static_field)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Target(Replaceable):
    params: TargetParams
    config: TargetConfig = static_field()

    @property
    def lm_head(self):
        return self.params.embed_tokens if self.params.lm_head is None else self.params.lm_head


def init_target(cfg: TargetConfig, key: jax.Array) -> Target:
    params = init_from_abstract(abstract_target(cfg), key, cfg.storage_dtype)
    return Target(params=params, config=cfg)


def _attention_step(layer: DecoderLayer, x: jax.Array, entry: AttentionCache | None, positions: jax.Array,
                    cache_len: jax.Array | None, cfg: TargetConfig, window: int | None, empty_cache: bool
                    ) -> tuple[jax.Array, AttentionCache | None]:
    """An attention layer over x [B, T, H] and its cache entry: (x, the entry with the new K/V written)."""
    if entry is None or empty_cache:  # the new tokens see each other only
        x, k, v = decoder_layer(layer, x, positions, cfg, causal=True, window=window)
        if entry is not None:
            entry = AttentionCache(k=write_kv(entry.k, k, positions), v=write_kv(entry.v, v, positions))
        return x, entry
    # written at each row's length first, then the cache is attended (slots < length + T)
    x, k, v = decoder_layer(layer, x, positions, cfg, cache_k=entry.k, cache_v=entry.v, cache_len=cache_len,
                            write=True, causal=True, window=window)
    return x, AttentionCache(k=k, v=v)


def _deltanet_step(layer: LinearAttnLayer, x: jax.Array, entry: DeltaNetCache | None, cfg: TargetConfig,
                   keep: jax.Array | None, defer: bool) -> tuple[jax.Array, DeltaNetCache]:
    """A Gated DeltaNet layer over x [B, T, H] from its entry's states (zero states without one): (x, the entry with
    the states advanced, or with defer the states untouched and the pass's inputs in `deferred`)."""
    if entry is None:
        entry = DeltaNetCache(*dn.empty_states(cfg, x.shape[0]))
    if defer:
        x, d = linear_attn_layer(layer, x, cfg, entry.conv, entry.state, keep=keep, defer=True)
        return x, entry.replace(deferred=d)
    x, conv, state = linear_attn_layer(layer, x, cfg, entry.conv, entry.state, keep=keep)
    return x, DeltaNetCache(conv=conv, state=state)


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
    (right-padded prompts; None = all T); defer_states leaves them untouched and records the pass in each DeltaNet
    entry's `deferred` for `commit_states` (verify). With cache=None the DeltaNet layers start from zero states.
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
    cache_len = None if cache is None else cache.lengths + T

    x = embedding_rows(p.embed_tokens, tokens, cfg.dtype)  # [B, T, H]
    entries, feats = [], {}
    for i, layer in enumerate(p.layers):
        entry = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer{i}"):
            if cfg.layer_type(i) == "linear_attention":
                x, entry = _deltanet_step(layer, x, entry, cfg, state_keep, defer_states)
            else:
                x, entry = _attention_step(layer, x, entry, positions, cache_len, cfg, windows[i], empty_cache)
        entries.append(entry)
        if i in layer_ids:
            feats[i] = x
    h = norm(x, p.norm, cfg)
    features = (jnp.concatenate([feats[i] for i in layer_ids], axis=-1) if layer_ids
                else jnp.zeros((B, T, 0), cfg.dtype))
    if cache is not None:
        cache = KVCache(layers=tuple(entries), lengths=cache.lengths + T)
    return h, features, cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeLayout(Replaceable):
    """How the 1 + N nodes of a draft tree (node 0 the root, parents before children) run through one verify."""

    positions: jax.Array  # [B, T] int32: committed length + depth
    mask: jax.Array  # [B, T, T] bool: node t sees node s iff s is t or one of its ancestors
    conv_taps: jax.Array | None = None  # [B, T, K] int32 (hybrid targets): where each node's conv reads its inputs


def forward_tree(target: Target, tokens: jax.Array, cache: KVCache, layer_ids: Sequence[int], layout: TreeLayout
                 ) -> tuple[jax.Array, jax.Array, tuple]:
    """A draft tree's nodes tokens [B, T] verified on top of `cache`, which is only read (slots below each row's
    length). Attention layers: every node attends to the cache and to the fresh keys the mask lets it see, at the
    layout's positions. DeltaNet layers: each node from its parent's conv window and state (`deltanet_tree`).

    Returns (logits [B, T, V] f32, features [B, T, len(layer_ids)*H], pending): per layer, the pass's fresh K/V
    (`AttentionCache` of [B, T, nKV, hd]) or DeltaNet inputs (`DeltaInputs`, node order), for `commit_tree`."""
    cfg = target.config
    p = target.params
    B, T = tokens.shape
    chex.assert_shape(layout.positions, (B, T))
    chex.assert_shape(layout.mask, (B, T, T))
    layer_ids = tuple(int(i) for i in layer_ids)
    x = embedding_rows(p.embed_tokens, tokens, cfg.dtype)  # [B, T, H]
    pending, feats = [], {}
    for i, layer in enumerate(p.layers):
        entry = cache.layers[i]
        with jax.named_scope(f"layer{i}"):
            if cfg.layer_type(i) == "linear_attention":
                x, d = linear_attn_layer(layer, x, cfg, entry.conv, entry.state, tree=(layout.mask, layout.conv_taps))
                pending.append(d)
            else:
                x, k, v = decoder_layer(layer, x, layout.positions, cfg, cache_k=entry.k, cache_v=entry.v,
                                        cache_len=cache.lengths, mask=layout.mask, causal=True)
                pending.append(AttentionCache(k=k, v=v))
        if i in layer_ids:
            feats[i] = x
    logits = lm_logits(target, norm(x, p.norm, cfg))
    chex.assert_shape(logits, (B, T, cfg.vocab_size))
    features = (jnp.concatenate([feats[i] for i in layer_ids], axis=-1) if layer_ids
                else jnp.zeros((B, T, 0), cfg.dtype))
    return logits, features, tuple(pending)


def commit_tree(cache: KVCache, pending: tuple, path: jax.Array, n: jax.Array, cfg: TargetConfig) -> KVCache:
    """The cache after a tree verify keeps the first n[b] nodes of path [B, P] (node indices, root first, as
    `decode.tree.walk` gives): their K/V written at slots length .. length + n - 1 (slot = position: the node at
    path step j sits at depth j) and the DeltaNet states advanced along them; lengths += n. n = 0 leaves a row as
    it was."""
    start = cache.lengths
    width = cfg.linear_conv_kernel_dim - 1

    def commit(entry, new):
        if isinstance(entry, DeltaNetCache):
            return DeltaNetCache(*dn.commit_path(new, entry.state, path, n, width))
        take = lambda x: jnp.take_along_axis(x, path[:, :, None, None], axis=1)  # [B, P, nKV, hd]
        return AttentionCache(k=write_kv_run(entry.k, take(new.k), start, n),
                              v=write_kv_run(entry.v, take(new.v), start, n))

    return KVCache(layers=tuple(commit(e, x) for e, x in zip(cache.layers, pending)), lengths=start + n)


def commit_states(cache: KVCache, n: jax.Array, cfg: TargetConfig) -> KVCache:
    """The cache after a deferred (verify) pass keeps only each row's first n[b] tokens in its DeltaNet states
    (0 <= n <= T; see `models.deltanet.commit`); KV entries roll back by `lengths` as for dense targets (the
    caller sets them). A cache without deferred states comes back as it is."""
    if not cache.has_deferred:
        return cache
    width = cfg.linear_conv_kernel_dim - 1

    def commit(entry):
        if not isinstance(entry, DeltaNetCache):
            return entry
        return DeltaNetCache(*dn.commit(entry.deferred, entry.state, n, width))

    return cache.replace(layers=tuple(commit(e) for e in cache.layers))


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
    # the program runs (and is keyed) under the backend resolved now, on the host
    with execution.changed(nvfp4_backend=program_backend(target, backend=nvfp4_backend)):
        logits, features, _ = _target_forward_jit(committed(target), tokens, tuple(int(i) for i in layer_ids))
    return logits, features


@jax.jit(static_argnums=(2,))
def _target_forward_jit(target, tokens, layer_ids):
    return forward_with_cache(target, tokens, None, layer_ids)
