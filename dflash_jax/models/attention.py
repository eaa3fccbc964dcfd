"""Softmax attention: the one function behind the target (prefill, verify, decode), the drafter (context + block) and
both trainers. By default every loop in it has a trip count fixed at trace time, so on an accelerator a decode step
never waits on the host for a loop predicate (a data-dependent trip count costs one device-to-host copy per iteration
on XLA:GPU), and its memory is bounded by a block, never by T x T.

Keys come in two parts. Each part is reduced to a partial softmax (running max `m`, sum of weights `l`, weighted
values `o`), and the parts are merged by log-sum-exp, so the result is exactly the softmax over their union:

  cached  k/v [B, nKV, S, hd] whose slot s holds position s (a KV cache, or the drafter's context), valid below
          `cache_len` ([B] per row, or [B, T] per query). Head-major, so that one head's keys are one sequential
          stream (the CPU kernel's row attention reads them so: docs/cpu-step.md).
  fresh   k/v [B, Tk, nKV, hd] at explicit positions `k_pos` [B, Tk]: the tokens of this call (a prompt, a verify
          block, the drafter's block), optionally restricted by `k_mask` [B, T, Tk] (training: each query sees only
          its own block).

Blocking (flash-style, online softmax): more than a query block of queries are split into query blocks, and either
key part longer than a key block is visited a key block at a time over its whole length (a cache's whole bucket:
invalid slots are masked, not skipped, which is what makes the trip count static). So a prompt of T tokens needs
O(T * block) scores, not T x T; the price is that a step reads the whole cache bucket, not only its live part.
Block sizes are an execution setting, not part of the architecture. By default queries go DEFAULT_CHUNK at a time
and a key block holds as many keys as keep one block's scores under SCORE_BUDGET per head (at least DEFAULT_CHUNK):
a decode or verify step at batch 1 reads a 16k-slot cache in one pass, not in 32 loop iterations (on a GPU each
iteration is several kernel launches). `chunk` (an argument, or the execution context's `attention_chunk`, set by
`with attention_chunk(n):`; part of every jit cache key, so changing it retraces) sets both block sizes exactly.

The live-length loop (`live_length_loop`, an execution setting chosen per platform when a program is built, off by
default): cached keys are visited LIVE_CHUNK slots at a time (or `chunk`) only up to the longest live row (and from
the first block a sliding window can reach), in a loop whose trip count is data. On a CPU such a loop costs nothing
extra, and a step then pays for its live context, not for the capacity of the cache bucket, so CPU programs can share
one large bucket; the generation programs switch it on for CPU only (`dflash_jax.decode.buckets`). It is never on
for an accelerator, and never where a gradient is taken (a loop with a traced trip count has no reverse mode). Like
the block size it is a field of the execution context (`dflash_jax.execution`), set by `with live_length_loop(on):`.
Inside the CPU generation loops most attention runs instead as the CPU kernel's fixed-order rows, which visit each
row's live keys alone (`_rows_in_fixed_order`); the loop serves what they cannot take (see `attention`).

On top of validity, a key at position k is visible to a query at position q (z-lab's rule):
  causal: k <= q;   sliding window w (None = full): q - k < w, and when not causal also k - q < w.
A query that sees no key at all returns zeros (padding rows, dropped training anchors).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax import execution
from dflash_jax.quant import cpu_kernel

DEFAULT_CHUNK = 512  # queries per block, and the fewest keys per block, by default
SCORE_BUDGET = 1 << 20  # by default, a key block holds up to this many scores per head: rows x queries x keys
LIVE_CHUNK = 256  # cached keys per iteration of the live-length loop (unless a chunk is given)


def attention_chunk(chunk: int | None):
    """Inside the block, attention goes `chunk` keys and queries per block, exactly (None: the defaults above).
    Programs traced under another value retrace; results agree across values up to float rounding of the online
    softmax."""
    return execution.changed(attention_chunk=chunk)


def live_length_loop(on: bool):
    """Inside the block, attention over cached keys visits only the blocks up to the longest live row (True: a
    data-dependent trip count, CPU programs only), or the whole cache with masks and static trip counts (False, the
    default). Programs traced under the other value retrace."""
    return execution.changed(live_length_loop=on)


def block_sizes(B: int, T: int, chunk: int | None = None) -> tuple[int, int]:
    """(queries per block, keys per block) for B rows of T queries: `chunk` for both if given, else the
    `attention_chunk` context's value, else the defaults (see the module doc)."""
    c = execution.current().attention_chunk if chunk is None else chunk
    if c is None:
        rows = B * min(T, DEFAULT_CHUNK)
        return DEFAULT_CHUNK, max(DEFAULT_CHUNK, SCORE_BUDGET // rows // DEFAULT_CHUNK * DEFAULT_CHUNK)
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"attention chunk must be an int >= 1, got {c!r}")
    return c, c


def visible(q_pos: jax.Array, k_pos: jax.Array, *, causal: bool, window: int | None) -> jax.Array:
    """Broadcasting bool: is a key at k_pos visible to a query at q_pos (validity aside)."""
    d = q_pos - k_pos
    vis = d >= 0 if causal else jnp.ones(d.shape, bool)
    if window is not None:
        vis = vis & (d < window)
        if not causal:
            vis = vis & (-d < window)
    return vis


def _partial(qg, q_pos, k, v, k_pos, valid, causal, window, head_major):
    """Partial softmax of grouped queries qg [B, T, nKV, G, hd] over keys k/v [B, C, nKV, hd] (or, head_major,
    [B, nKV, C, hd]: a cache's) at k_pos [B, C].

    valid [B, T or 1, C]. Returns (m [B, nKV, G, T], l [B, nKV, G, T], o [B, nKV, G, T, hd]), all float32.
    """
    hd = qg.shape[-1]
    kd = "bkcd" if head_major else "bckd"
    vis = valid & visible(q_pos[:, :, None], k_pos[:, None, :], causal=causal, window=window)  # [B, T, C]
    s = jnp.einsum(f"btkgd,{kd}->bkgtc", qg, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - jnp.where(m > -jnp.inf, m, 0.0)[..., None])  # exactly 0 where not visible
    # A slot no query sees may hold anything (a rolled-back slot, memory never written): 0 * NaN is NaN, so such
    # values are zeroed rather than trusted to be multiplied by a zero weight.
    seen = vis.any(axis=1)  # [B, C]
    v = jnp.where(seen[:, None, :, None] if head_major else seen[:, :, None, None], v, jnp.zeros((), v.dtype))
    o = jnp.einsum(f"bkgtc,{kd}->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
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


def _key_blocks(qg, q_pos, k, v, k_pos, valid: Callable, causal, window, chunk, live=None, head_major=False):
    """Partial softmax over all S keys of k/v [B, S, nKV, hd] (head_major: [B, nKV, S, hd]; positions k_pos [B, S]),
    `chunk` keys at a time.

    valid(start, size) -> bool [B, T or 1, size]: which of keys start..start+size-1 each query may see.
    The loop runs ceil(S / chunk) times, fixed at trace time; or, with live = (lo, hi) (traced block indices: the
    live-length loop), over blocks lo..hi-1 only, the blocks outside holding no key any query sees. The last block
    is clamped to end at S (S need not be a multiple of chunk); keys it shares with the block before are counted
    once, by the `>= c * chunk` test.
    """
    axis = 2 if head_major else 1
    S = k.shape[axis]
    if S <= chunk:
        return _partial(qg, q_pos, k, v, k_pos, valid(0, S), causal, window, head_major)

    def body(c, acc):
        start = jnp.minimum(c * chunk, S - chunk)
        kc = jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=axis)  # [B, chunk, nKV, hd] or [B, nKV, chunk, hd]
        vc = jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=axis)
        pc = jax.lax.dynamic_slice_in_dim(k_pos, start, chunk, axis=1)  # [B, chunk]
        new = (start + jnp.arange(chunk, dtype=jnp.int32)) >= c * chunk  # [chunk]
        return _merge(acc, _partial(qg, q_pos, kc, vc, pc, valid(start, chunk) & new, causal, window, head_major))

    lo, hi = (0, -(-S // chunk)) if live is None else live
    return jax.lax.fori_loop(lo, hi, body, _empty(qg))


def _attend(qg, q_pos, cache_k, cache_v, cache_len, k, v, k_pos, k_mask, causal, window, chunk, live_chunk=None):
    """(m, l, o) of one query block over both key parts (see `attention` for the arguments). chunk: keys per block;
    live_chunk: cached keys per block of the live-length loop (None: the cache's static-trip-count blocks)."""
    B = qg.shape[0]
    acc = _empty(qg)
    if cache_k is not None:
        S = cache_k.shape[2]
        lens = cache_len[:, None] if cache_len.ndim == 1 else cache_len  # [B, 1] or [B, T]
        slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))

        def cached_valid(start, size):
            return (start + jnp.arange(size, dtype=jnp.int32))[None, None, :] < lens[..., None]  # [B, T|1, size]

        if live_chunk is None:
            acc = _key_blocks(qg, q_pos, cache_k, cache_v, slots, cached_valid, causal, window, chunk,
                              head_major=True)
        else:  # blocks from the first a window can reach to the last holding a live slot (data: CPU only)
            hi = (jnp.max(lens) + live_chunk - 1) // live_chunk
            lo = 0 if window is None else jnp.maximum(jnp.min(q_pos) - window + 1, 0) // live_chunk
            acc = _key_blocks(qg, q_pos, cache_k, cache_v, slots, cached_valid, causal, window, live_chunk,
                              live=(lo, hi), head_major=True)
    if k is not None:
        def fresh_valid(start, size):
            if k_mask is None:
                return jnp.ones((B, 1, size), bool)
            return jax.lax.dynamic_slice_in_dim(k_mask, start, size, axis=2)  # [B, T, size]

        acc = _merge(acc, _key_blocks(qg, q_pos, k.astype(qg.dtype), v.astype(qg.dtype), k_pos, fresh_valid,
                                      causal, window, chunk))
    return acc


def _rows_in_fixed_order(qg, q_pos, cache_k, cache_v, cache_len, k, v, k_pos, k_mask, causal, window):
    """(l, o) as `_attend` gives them, from the CPU kernel's one pass per query row over its visible cached keys, then
    its visible fresh keys (`quant/cpu_attention.h`): each row's sums in one order that depends on that row alone, and
    the same whether a key sits in the cache (a decode, a chain's verify) or among the fresh keys (a tree's nodes,
    parent before child). No key blocks, so no merges of partial softmaxes whose rounding would depend on where the
    blocks fall."""
    B, T, nKV, _, hd = qg.shape
    none = jnp.zeros((B, 0, nKV, hd), jnp.float32)
    cached = (jnp.zeros((B, nKV, 0, hd), jnp.float32),) * 2 + (jnp.zeros((B, T, 0), bool),)
    if cache_k is not None:
        S = cache_k.shape[2]
        lens = cache_len[:, None] if cache_len.ndim == 1 else cache_len  # [B, 1] or [B, T]
        slots = jnp.arange(S, dtype=jnp.int32)
        vis = (slots[None, None, :] < lens[..., None]) & visible(q_pos[:, :, None], slots[None, None, :],
                                                                 causal=causal, window=window)
        cached = (cache_k, cache_v, jnp.broadcast_to(vis, (B, T, S)))
    fresh = (none, none, jnp.zeros((B, T, 0), bool))
    if k is not None:
        vis = visible(q_pos[:, :, None], k_pos[:, None, :], causal=causal, window=window)  # [B, T, Tk]
        if k_mask is not None:
            vis = vis & k_mask
        fresh = (k, v, jnp.broadcast_to(vis, (B, T, k.shape[1])))
    return cpu_kernel.attention_rows(qg, cached, fresh, hd ** -0.5)


def attention(q: jax.Array, q_pos: jax.Array, *, cache_k: jax.Array | None = None, cache_v: jax.Array | None = None,
              cache_len: jax.Array | None = None, k: jax.Array | None = None, v: jax.Array | None = None,
              k_pos: jax.Array | None = None, k_mask: jax.Array | None = None, causal: bool,
              window: int | None = None, chunk: int | None = None) -> jax.Array:
    """GQA softmax attention of q [B, T, nH, hd] at positions q_pos [B, T] over cached and fresh keys.

    cache_k/cache_v [B, nKV, S, hd] (slot = position) valid below cache_len [B] or [B, T]; k/v [B, Tk, nKV, hd] at
    k_pos [B, Tk], restricted by k_mask [B, T, Tk] when given. causal / window: the visibility rule (module doc);
    chunk: keys and queries per block (None: the execution context's, else the defaults; see `block_sizes`).
    Under `live_length_loop(True)` cached keys go `chunk` (default LIVE_CHUNK) at a time up to the longest live row.
    Returns [B, T, nH * hd] in q.dtype.
    """
    B, T, nH, hd = q.shape
    context = execution.current()
    explicit = chunk is not None or context.attention_chunk is not None
    q_block, chunk = block_sizes(B, T, chunk)
    # The live-length loop's blocks: a given chunk, else LIVE_CHUNK (the default key block is sized to read a whole
    # cache in one pass, which is what the live-length loop is there to avoid).
    live_chunk = (chunk if explicit else LIVE_CHUNK) if context.live_length_loop else None
    nKV = cache_k.shape[1] if cache_k is not None else k.shape[2]
    qg = q.reshape(B, T, nKV, nH // nKV, hd)  # [B, T, nKV, G, hd]
    q_pos = q_pos.astype(jnp.int32)
    cache_len = None if cache_len is None else cache_len.astype(jnp.int32)
    k_pos = None if k_pos is None else k_pos.astype(jnp.int32)
    args = (cache_k, cache_v, cache_len, k, v, k_pos, k_mask)
    fixed = execution.rows_in_fixed_order() and cpu_kernel.available() and T <= q_block  # the CPU loops
    head_fits = hd % 8 == 0 and hd <= 128  # what the kernel's chains take
    if fixed and context.q8_activations and not head_fits:  # Q8 rounding would turn XLA's ulps into other tokens
        raise ValueError(f"Q8 activations: attention's fixed-order rows need a head dim that is a multiple of 8 "
                         f"up to 128, got {hd}")
    # Otherwise XLA's blocks take what the kernel cannot (a row a few ulps apart between a decode and a verify): a head
    # dim it has no chain for, and bfloat16 compute (it would read a float32 copy of the whole cache every layer).
    if fixed and head_fits and (context.q8_activations or q.dtype == jnp.float32):
        # The kernel's rows: sums that depend on the row alone, at 1-2 ms of a SmolLM2 step where XLA's blocks
        # (their head-major cache slices, scores, merges) took ~5 ms
        l, o = _rows_in_fixed_order(qg, q_pos, *args, causal, window)
    elif T <= q_block:
        _, l, o = _attend(qg, q_pos, *args, causal, window, chunk, live_chunk)
    else:
        # Query blocks, one at a time (a static-length lax.map): only one block's scores are live. Padded queries
        # (past T) sit at position -1 with no keys (k_mask False, length 0); their rows are dropped.
        nq = -(-T // q_block)
        pad = nq * q_block - T

        def blocks(x, fill):  # [B, T, ...] -> [nq, B, q_block, ...]
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
            return jnp.moveaxis(x.reshape(B, nq, q_block, *x.shape[2:]), 1, 0)

        per_query_len = cache_len is not None and cache_len.ndim == 2
        xs = (blocks(qg, 0), blocks(q_pos, -1), blocks(cache_len, 0) if per_query_len else None,
              None if k_mask is None else blocks(k_mask, False))

        def one(x):
            qb, pb, lb, mb = x
            return _attend(qb, pb, cache_k, cache_v, lb if per_query_len else cache_len, k, v, k_pos, mb, causal,
                           window, chunk, live_chunk)[1:]

        l, o = jax.lax.map(one, xs)  # [nq, B, nKV, G, q_block(, hd)]
        l = jnp.moveaxis(l, 0, 3).reshape(B, nKV, nH // nKV, nq * q_block)[..., :T]
        o = jnp.moveaxis(o, 0, 3).reshape(B, nKV, nH // nKV, nq * q_block, hd)[..., :T, :]
    out = o / jnp.where(l > 0, l, 1.0)[..., None]  # [B, nKV, G, T, hd]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, nH * hd).astype(q.dtype)


__all__ = ["attention", "attention_chunk", "block_sizes", "DEFAULT_CHUNK", "LIVE_CHUNK", "live_length_loop",
           "SCORE_BUDGET", "visible"]
