"""Softmax attention: the one function behind the target (prefill, verify, decode), the drafter (context + block) and
both trainers. Its cost follows the live context, not the capacity of the cache it reads.

Keys come in two parts. Each part is reduced to a partial softmax (running max `m`, sum of weights `l`, weighted
values `o`), and the parts are merged by log-sum-exp, so the result is exactly the softmax over their union:

  cached  k/v [B, S, nKV, hd] whose slot s holds position s (a KV cache, or the drafter's context), valid below
          `cache_len` ([B] per row, or [B, T] per query). With `chunk`, slots are visited `chunk` at a time, and only
          the chunks that can hold a key some query sees: a loop whose trip count is traced (the longest live row,
          and the sliding window's lower end), so a verify step at 64 live tokens costs the same in a 256-slot cache
          as in a 16k one. Without `chunk` the cached part is one dense pass (training, tiny caches).
  fresh   k/v [B, Tk, nKV, hd] at explicit positions `k_pos` [B, Tk]: the tokens of this call (a prompt, a verify
          block, the drafter's block), optionally restricted by `k_mask` [B, T, Tk] (training: each query sees only
          its own block).

On top of validity, a key at position k is visible to a query at position q (z-lab's rule):
  causal: k <= q;   sliding window w (None = full): q - k < w, and when not causal also k - q < w.
A query that sees no key at all returns zeros (padding rows, dropped training anchors).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(q_pos: jax.Array, k_pos: jax.Array, *, causal: bool, window: int | None) -> jax.Array:
    """Broadcasting bool: is a key at k_pos visible to a query at q_pos (validity aside)."""
    d = q_pos - k_pos
    vis = d >= 0 if causal else jnp.ones(d.shape, bool)
    if window is not None:
        vis = vis & (d < window)
        if not causal:
            vis = vis & (-d < window)
    return vis


def _partial(qg, q_pos, k, v, k_pos, valid, causal, window):
    """Partial softmax of grouped queries qg [B, T, nKV, G, hd] over keys k/v [B, C, nKV, hd] at k_pos [B, C].

    valid [B, T or 1, C]. Returns (m [B, nKV, G, T], l [B, nKV, G, T], o [B, nKV, G, T, hd]), all float32.
    """
    hd = qg.shape[-1]
    vis = valid & visible(q_pos[:, :, None], k_pos[:, None, :], causal=causal, window=window)  # [B, T, C]
    s = jnp.einsum("btkgd,bckd->bkgtc", qg, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - jnp.where(m > -jnp.inf, m, 0.0)[..., None])  # exactly 0 where not visible
    # A slot no query sees may hold anything (a rolled-back slot, memory never written): 0 * NaN is NaN, so such
    # values are zeroed rather than trusted to be multiplied by a zero weight.
    v = jnp.where(vis.any(axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
    o = jnp.einsum("bkgtc,bckd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(axis=-1), o


def _merge(a, b):
    """log-sum-exp merge of two partials: the partial of the union of their keys."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = jnp.maximum(ma, mb)
    m_safe = jnp.where(m > -jnp.inf, m, 0.0)
    sa, sb = jnp.exp(ma - m_safe), jnp.exp(mb - m_safe)  # 0 for a part that saw nothing
    return m, sa * la + sb * lb, sa[..., None] * oa + sb[..., None] * ob


def _empty(qg):
    B, T, nKV, G, hd = qg.shape
    m = jnp.full((B, nKV, G, T), -jnp.inf, jnp.float32)
    return m, jnp.zeros((B, nKV, G, T), jnp.float32), jnp.zeros((B, nKV, G, T, hd), jnp.float32)


def _cached_partial(qg, q_pos, k, v, cache_len, causal, window, chunk):
    B, S = k.shape[:2]
    lens = cache_len[:, None] if cache_len.ndim == 1 else cache_len  # [B, 1] or [B, T]
    if chunk is None or S <= chunk:
        slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        return _partial(qg, q_pos, k, v, slots, slots[:, None, :] < lens[..., None], causal, window)
    # Chunks [c*chunk, (c+1)*chunk) from the first one the window can reach to the last one holding a valid slot.
    # The last chunk may be clamped to end at S (S need not be a multiple of chunk); slots it shares with the chunk
    # before are counted once, by the `slots >= c * chunk` test.
    c_hi = (jnp.max(lens) + chunk - 1) // chunk
    c_lo = 0 if window is None else jnp.maximum(jnp.min(q_pos) - window + 1, 0) // chunk

    def body(c, acc):
        start = jnp.minimum(c * chunk, S - chunk)
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=1)
        slots = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        valid = (slots[:, None, :] < lens[..., None]) & (slots[:, None, :] >= c * chunk)
        return _merge(acc, _partial(qg, q_pos, kc, vc, slots, valid, causal, window))

    return jax.lax.fori_loop(c_lo, c_hi, body, _empty(qg))


def attention(q: jax.Array, q_pos: jax.Array, *, cache_k: jax.Array | None = None, cache_v: jax.Array | None = None,
              cache_len: jax.Array | None = None, k: jax.Array | None = None, v: jax.Array | None = None,
              k_pos: jax.Array | None = None, k_mask: jax.Array | None = None, causal: bool,
              window: int | None = None, chunk: int | None = None) -> jax.Array:
    """GQA softmax attention of q [B, T, nH, hd] at positions q_pos [B, T] over cached and fresh keys.

    cache_k/cache_v [B, S, nKV, hd] (slot = position) valid below cache_len [B] or [B, T]; k/v [B, Tk, nKV, hd] at
    k_pos [B, Tk], restricted by k_mask [B, T, Tk] when given. causal / window: the visibility rule (module doc);
    chunk: visit cached slots this many at a time, only up to the longest live row (None: one dense pass).
    Returns [B, T, nH * hd] in q.dtype.
    """
    B, T, nH, hd = q.shape
    nKV = (cache_k if cache_k is not None else k).shape[2]
    qg = q.reshape(B, T, nKV, nH // nKV, hd)
    q_pos = q_pos.astype(jnp.int32)
    acc = _empty(qg)
    if cache_k is not None:
        acc = _cached_partial(qg, q_pos, cache_k, cache_v, cache_len.astype(jnp.int32), causal, window, chunk)
    if k is not None:
        valid = jnp.ones((B, 1, k.shape[1]), bool) if k_mask is None else k_mask
        acc = _merge(acc, _partial(qg, q_pos, k.astype(qg.dtype), v.astype(qg.dtype), k_pos.astype(jnp.int32),
                                   valid, causal, window))
    _, l, o = acc
    out = o / jnp.where(l > 0, l, 1.0)[..., None]  # [B, nKV, G, T, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, nH * hd).astype(q.dtype)


__all__ = ["attention", "visible"]
