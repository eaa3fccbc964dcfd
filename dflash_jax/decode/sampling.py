"""Token choice inside the loop: greedy, temperature / top-k / top-p sampling, and lossless block acceptance.

At temperature 0 a draft is accepted while it equals the target's argmax. At temperature > 0 this is rejection
sampling (z-lab dflash/model.py `_rejection_sample` at 07ebd93db9f4): p = target probs, q = draft probs, both after
the same temperature / top-k / top-p; draft x_i ~ q_i; accept position i while u_i * q_i(x_i) < p_i(x_i); at the
first rejection sample from normalize(max(p - q, 0)) (p if that is empty); when every draft is accepted the bonus
comes from p of the last verify row. Greedy drafts are the point mass q = onehot(argmax), for which the same rule is
exact.

`p_min` ends the draft at the first slot whose top draft probability is below p_min: slots from there on are not
proposed at all, so the token at the cut is sampled from p itself (not from a residual).

Randomness: `keys` are per-row raw threefry key data [B, 2]. Each sampling call hashes every row's key once, for the
row's next key and all the uniforms it needs, so a row's draws depend only on its own key (not on the batch).
A categorical draw takes one uniform per row and slot (inverse CDF), not one per vocabulary entry.

No `lax.cond` anywhere here: whether top-k, top-p and p_min are on is static (part of the program, like greedy), so
inside a decode step nothing waits on the host for a predicate and a switched-off filter costs nothing; their values
stay traced (one program serves every top-k up to its static cap, every top-p < 1, every p_min > 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import execution
from dflash_jax.models.layers import first_argmax
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import cpu_kernel_runs

CDF_BLOCK = 128  # ids per block of the two-level search (`_first_reaching`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings. The numbers are pytree leaves (traced: one compiled program serves every temperature,
    top-k, top-p and p_min); whether decoding is greedy and how drafts are drawn are static (they change the program).
    """

    temperature: Any = 0.0  # [] f32
    top_k: Any = 0  # [] i32, 0 = off
    top_p: Any = 1.0  # [] f32, 1 = off
    p_min: Any = 0.0  # [] f32, 0 = off
    greedy: bool = dataclasses.field(default=True, metadata=dict(static=True))  # temperature == 0
    # "sample": x ~ q ; "greedy": x = argmax q (point-mass proposal)
    draft_sampling: str = dataclasses.field(default="sample", metadata=dict(static=True))
    # Static switches (set by `make` from the values): top-k runs `lax.top_k` over this many entries (a power of two
    # >= top_k, so nearby k share a program; 0 = top-k off); top-p and p_min on or off.
    top_k_cap: int = dataclasses.field(default=0, metadata=dict(static=True))
    use_top_p: bool = dataclasses.field(default=False, metadata=dict(static=True))
    use_p_min: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0, p_min=0.0, draft_sampling="sample") -> "SamplingParams":
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if int(top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if not 0 <= p_min < 1:
            raise ValueError(f"p_min must be in [0, 1), got {p_min!r}")
        if draft_sampling not in ("sample", "greedy"):
            raise ValueError(f"draft_sampling must be 'sample' or 'greedy', got {draft_sampling!r}")
        k = int(top_k)
        return cls(float(temperature), k, float(top_p), float(p_min), float(temperature) == 0.0, draft_sampling,
                   top_k_cap=0 if k == 0 else max(8, 1 << (k - 1).bit_length()), use_top_p=float(top_p) < 1.0,
                   use_p_min=float(p_min) > 0.0)

    def as_arrays(self) -> "SamplingParams":
        """The same settings with fixed-dtype numpy leaves, so a compiled program sees one signature for all values."""
        return dataclasses.replace(self, temperature=np.float32(self.temperature), top_k=np.int32(self.top_k),
                                   top_p=np.float32(self.top_p), p_min=np.float32(self.p_min))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixQ:
    """A DFlash step's draft distribution at temperature > 0, as wide as the drafter's head computed it: q over the
    first n ids (the draft vocabulary, n <= V; zero past it), and the slots whose draft context lookup copied in,
    whose q is the point mass at that draft (which may lie past n). Drawing and verifying over n ids instead of V
    (SmolLM2's pair: 8,192 of 49,152) spares a step two softmaxes over the padded rows; only the one row a residual
    needs is spread onto the vocabulary (`accept_block`)."""

    probs: jax.Array  # [B, D, n] f32
    copied: jax.Array  # [B, D] bool


def processed_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Probabilities [..., V] f32 after temperature, top-k and top-p (identical for target and drafter).

    top-k: `lax.top_k` over the static cap (no sort of the vocabulary), then the traced k-th largest value is the
    threshold (ties kept). top-p keeps the smallest set of highest-probability tokens whose mass reaches top_p (the
    top token always; among equal probabilities the lower ids first), read off the same top-k candidates when top-k
    is on, else found by bisection (`_top_p_keep`) without ordering the vocabulary.
    """
    x = logits.astype(jnp.float32) / sp.temperature
    cap = min(sp.top_k_cap, x.shape[-1]) if sp.top_k_cap else 0
    if cap:
        vals, order = jax.lax.top_k(x, cap)  # [..., cap] best first (ties: lower index first, as a stable argsort)
        k = jnp.clip(jnp.asarray(sp.top_k, jnp.int32), 1, cap)  # top_k >= V keeps everything
        kth = jnp.take(vals, k - 1, axis=-1)[..., None]  # the k-th largest value
        x = jnp.where(x < kth, -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    if not sp.use_top_p:
        return probs
    if cap:  # the ordering of the top-k candidates is at hand
        sorted_p = jnp.take_along_axis(probs, order, axis=-1)  # [..., cap]
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep = jnp.zeros(probs.shape, bool).at[tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(
            mass_before < sp.top_p)
    else:
        keep = _top_p_keep(probs, sp.top_p)
    probs = jnp.where(keep, probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)


def _top_p_keep(probs: jax.Array, top_p) -> jax.Array:
    """probs [..., V] -> keep [..., V] bool: the tokens whose mass before them (higher probabilities, and equal ones
    with lower ids) is below top_p, the top-p set of one full ordering, found without ordering the vocabulary
    (XLA:CPU sorts SmolLM2's 49,152 ids in ~11 ms a row, more than a decode step; this takes ~0.5 ms).

    Non-negative float32 values order as their bit patterns, so a bisection over the bits finds the smallest
    probability c whose strictly larger ones hold less than top_p (31 passes, each one masked sum over the row): all
    tokens above c are kept, and of the tokens at exactly c the first n (by id) while c's earlier ones' mass stays
    below top_p (the n-th tied id found in two levels, `_nth_true`)."""
    lead, V = probs.shape[:-1], probs.shape[-1]
    p = probs.reshape(-1, V)  # [R, V]
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)  # [R, V] ordered as p (p >= 0)
    top_p = jnp.asarray(top_p, jnp.float32)

    def mass_above(c):  # [R] -> [R]: the mass of the tokens strictly above probability bits c
        return jnp.sum(jnp.where(bits > c[:, None], p, 0.0), axis=-1)

    def smallest(lo, hi, ok, passes):  # the smallest value in [lo, hi] where ok (monotone, true at hi), per row
        def step(_, bounds):
            lo, hi = bounds
            mid = lo + (hi - lo) // 2
            good = ok(mid)
            return jnp.where(good, lo, mid + 1), jnp.where(good, mid, hi)
        return jax.lax.fori_loop(0, passes, step, (lo, hi))[1]

    rows = p.shape[0]
    c = smallest(jnp.zeros((rows,), jnp.int32), jnp.max(bits, axis=-1), lambda m: mass_above(m) < top_p, 31)
    at_c = bits == c[:, None]  # [R, V] the tied tokens at the cut
    value = jax.lax.bitcast_convert_type(c, jnp.float32)  # [R]
    n_tied = jnp.sum(at_c, axis=-1)
    # tied token r (0-based, by id) has mass_above(c) + r * value before it; keep those below top_p (r = 0 always)
    room = jnp.ceil((top_p - mass_above(c)) / jnp.maximum(value, jnp.finfo(jnp.float32).tiny))
    n_keep = jnp.clip(room, 1, n_tied).astype(jnp.int32)
    ids = jnp.arange(V, dtype=jnp.int32)
    keep = (bits > c[:, None]) | (at_c & (ids <= _nth_true(at_c, n_keep)[:, None]))
    return keep.reshape(lead + (V,))


def _nth_true(mask: jax.Array, n: jax.Array) -> jax.Array:
    """mask [R, V] bool, n [R] in 1..count -> [R] the id of each row's n-th True: the first id whose cumulative count
    reaches n (`_first_reaching`; exact: integers)."""
    return _first_reaching(mask.astype(jnp.int32), lambda total: n)


def _first_reaching(values: jax.Array, target_of) -> jax.Array:
    """values [R, V] >= 0, target_of: the row sums [R] -> targets [R] (so that a fraction of the total is taken of
    the very total the search walks) -> [R] int32: the first id whose cumulative sum reaches target, in two levels,
    because a cumulative sum over the whole vocabulary is slow on a CPU (XLA runs it as a log-depth scan: ~0.25 ms a
    row over SmolLM2's 49,152 ids): the blocks' sums and their cumulative sum pick the block, then a cumulative sum
    inside that one block of CDF_BLOCK entries picks the id. The id has a value > 0 (the in-block sum steps up there;
    where float rounding leaves the in-block sum just short of the block's share, the block's last id with a value)
    and is < V (padding is 0)."""
    R, V = values.shape
    nb = -(-V // CDF_BLOCK)
    blocks = jnp.pad(values, ((0, 0), (0, nb * CDF_BLOCK - V))).reshape(R, nb, CDF_BLOCK)  # [R, nb, CDF_BLOCK]
    cum = jnp.cumsum(blocks.sum(axis=-1), axis=-1)  # [R, nb]
    target = target_of(cum[:, -1])  # [R]
    j = jnp.minimum(jnp.sum(cum < target[:, None], axis=-1), nb - 1)  # [R] the first block reaching the target
    before = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0)
    block = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [R, CDF_BLOCK]
    inside = jnp.sum(jnp.cumsum(block, axis=-1) < (target - before)[:, None], axis=-1)
    last_with_value = CDF_BLOCK - 1 - jnp.argmax(block[:, ::-1] > 0, axis=-1)
    return jnp.minimum(j * CDF_BLOCK + jnp.minimum(inside, last_with_value), V - 1).astype(jnp.int32)


def _draw(keys: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """keys [B, 2] raw key data -> (next keys [B, 2], n uniforms per row [B, n] in (0, 1)).

    One threefry call per row gives both the next key (its first two words, as `split` would) and the uniforms:
    each separate `split` / `categorical` / `uniform` call site adds about 0.5 s of XLA compile on a busy CPU
    (this cut the T=1 speculative program's compile from ~7.2 s to ~5.8 s in tests/test_sampling.py).
    """
    def one(k):
        bits = jax.random.bits(jax.random.wrap_key_data(k), (n + 2,), jnp.uint32)
        return bits[:2], bits[2:]

    new_keys, bits = jax.vmap(one)(keys)
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1), 23 bits
    return new_keys.astype(keys.dtype), jnp.maximum(u, jnp.finfo(jnp.float32).tiny)


def _categorical(u: jax.Array, probs: jax.Array) -> jax.Array:
    """Inverse CDF: one sample per leading index from probs [..., V] (unnormalised is fine), given one uniform per
    leading index, u [...] or [..., 1] in (0, 1): the first index whose cumulative mass reaches u * total mass.

    In two levels (`_first_reaching`): a cumulative sum over the whole vocabulary is the slowest part of a draw on a
    CPU. The chosen index always has mass > 0 and is < V."""
    lead, V = probs.shape[:-1], probs.shape[-1]
    return _first_reaching(probs.astype(jnp.float32).reshape(-1, V), lambda total: u.reshape(-1) * total).reshape(lead)


def in_cpu_kernel(logits: jax.Array, sp: SamplingParams | None = None) -> bool:
    """Whether a row reduction over these logits (a draw, a log-sum-exp, a residual) runs through the CPU kernel:
    float32 rows inside the CPU generation loops (`execution`'s `cpu_kernel`), where the kernel runs, and (given sp)
    a temperature-only rule: the kernel knows no top-k / top-p. XLA:CPU's softmax and two-level inverse CDF over
    SmolLM2's 49,152 ids took ~0.22 ms of a ~3.6 ms sampled decode step."""
    if sp is not None and (sp.top_k_cap or sp.use_top_p):
        return False
    return logits.dtype == jnp.float32 and execution.current().cpu_kernel and cpu_kernel_runs()


def sample_tokens(logits: jax.Array, keys: jax.Array, sp: SamplingParams, draft: bool = False,
                  probs: jax.Array | None = None):
    """logits [B, V] or [B, D, V] -> (tokens [B] or [B, D], keys). Greedy at temperature 0 or for greedy drafts.
    probs: processed_probs(logits, sp) where the caller keeps it (a draft's q), drawn from as it is."""
    if sp.greedy or (draft and sp.draft_sampling == "greedy"):
        return first_argmax(logits), keys
    keys, u = _draw(keys, logits[0].size // logits.shape[-1])  # one uniform per row and slot
    u = u.reshape(logits.shape[:-1])
    if probs is None and not draft and in_cpu_kernel(logits, sp):
        # the CPU loops: the kernel's three passes over each row (`cpu_kernel.sample_rows`), the same rule as below
        return cpu_kernel.sample_rows(logits, u, sp.temperature), keys
    probs = processed_probs(logits, sp) if probs is None else probs
    return _categorical(u, probs), keys


def _pmin_mask(d_logits: jax.Array, sp: SamplingParams, draft_probs=None) -> jax.Array:
    """[B, D] True while the draft's top probability stays >= p_min (then False from the first low slot on).

    draft_probs [B, D, V] or [B, D, k]: the drafter's own distribution when it is not a softmax of d_logits (the
    DFlash2 selector's q, over the vocabulary or over its k candidates: the top probability is the same); or a
    `PrefixQ`, whose copied slots are point masses (always confident)."""
    if not sp.use_p_min:
        return jnp.ones(d_logits.shape[:2], bool)
    if isinstance(draft_probs, PrefixQ):
        confident = draft_probs.copied | (draft_probs.probs.max(axis=-1) >= sp.p_min)
    else:
        if draft_probs is None:
            draft_probs = (jax.nn.softmax(d_logits.astype(jnp.float32), axis=-1) if sp.greedy
                           else processed_probs(d_logits, sp))
        confident = draft_probs.max(axis=-1) >= sp.p_min
    return jnp.cumprod(confident.astype(jnp.int32), axis=1).astype(bool)


def verify_probs(v_logits: jax.Array, sp: SamplingParams):
    """The target's processed distribution p over verify rows v_logits [B, R, V], read where acceptance needs it:
    (entries(ids [B, r]) -> p [B, r] at those ids of rows 0..r-1, row(i [B]) -> p [B, V] of row i).

    With temperature alone (no top-k, no top-p) p = exp(x / T - logsumexp(x / T)) is read at those entries and the
    one row only: no [B, R, V] of probabilities is written (a step reads each row's logits twice, for the max and
    the sum; in the CPU loops the log-sum-exp is the kernel's, `cpu_kernel.row_logsumexp`). With top-k or top-p
    every row is processed whole (`processed_probs`)."""
    if sp.top_k_cap or sp.use_top_p:
        p = processed_probs(v_logits, sp)
        return (lambda ids: jnp.take_along_axis(p[:, :ids.shape[1]], ids[..., None], axis=-1)[..., 0],
                lambda i: jnp.take_along_axis(p, i[:, None, None], axis=1)[:, 0])
    x = v_logits.astype(jnp.float32) / sp.temperature  # [B, R, V]
    if in_cpu_kernel(v_logits):
        lse = cpu_kernel.row_logsumexp(v_logits, sp.temperature)[..., None]  # [B, R, 1]
    else:
        m = jnp.max(x, axis=-1, keepdims=True)
        lse = m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True))  # [B, R, 1]
    return (lambda ids: jnp.exp(jnp.take_along_axis(x[:, :ids.shape[1]], ids[..., None], axis=-1)
                                - lse[:, :ids.shape[1]])[..., 0],
            lambda i: jnp.exp(jnp.take_along_axis(x, i[:, None, None], axis=1)[:, 0]
                              - jnp.take_along_axis(lse, i[:, None, None], axis=1)[:, 0]))


def residual_probs(p: jax.Array, q: jax.Array) -> jax.Array:
    """normalize(max(p - q, 0)) over the last axis, or p itself where that is all zero (p <= q everywhere).

    With a point-mass q = onehot(x) this is p with x removed, renormalised; with q = 0 it is p.
    """
    residual = jnp.maximum(p - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)


def accept_block(d_logits: jax.Array, drafts: jax.Array, v_logits: jax.Array, keys: jax.Array, sp: SamplingParams,
                 draft_probs: jax.Array | None = None):
    """Decide how many drafts to keep and what comes after them.

    d_logits [B, D, V] drafter logits for slots 1..D; drafts [B, D]; v_logits [B, D+1, V] target logits of the
    verify rows (row j predicts the token after slot j). draft_probs: the distribution the drafts were drawn from
    when it is not processed_probs(d_logits): [B, D, V]; a `PrefixQ` (a DFlash step's q over its draft vocabulary,
    with the slots context lookup copied in); or the DFlash2 selector's pair (q [B, D, k], candidate ids [B, D, k]),
    kept over its k candidates. Only the one row the residual needs is spread onto the vocabulary.
    Returns (n_acc [B] in 0..D, committed [B, D+1], keys):
    committed[:, :n_acc] are the accepted drafts and committed[:, n_acc] is the correction / bonus token.
    """
    B, D = drafts.shape
    candidates = None
    if isinstance(draft_probs, (tuple, list)):
        draft_probs, candidates = draft_probs  # [B, D, k] each
    proposed = _pmin_mask(d_logits, sp, draft_probs)  # [B, D]
    if sp.greedy:
        post = first_argmax(v_logits)  # [B, D+1]
        ok = (drafts == post[:, :D]) & proposed
        n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        return n_acc, post, keys  # accepted drafts equal post there, and post[n_acc] is the bonus

    p_entries, p_row = verify_probs(v_logits, sp)  # p [B, D+1, V] where it is read
    # the CPU loops: the residual's token is the kernel's (`_kernel_residual`), the same rule
    kernel = candidates is None and in_cpu_kernel(v_logits, sp)
    V = v_logits.shape[-1]
    prefix = draft_probs if isinstance(draft_probs, PrefixQ) and sp.draft_sampling == "sample" else None
    if sp.draft_sampling == "greedy":
        q = None  # point-mass proposal: q(x) = 1 at the draft, onehot at the stop row
        q_x = jnp.ones((B, D), jnp.float32)
    elif candidates is not None:
        q = None  # the selector's q over its k candidates
        q_x = jnp.sum(jnp.where(candidates == drafts[..., None], draft_probs.astype(jnp.float32), 0.0), axis=-1)
    elif prefix is not None:
        q = None  # q over the draft vocabulary's n ids; a copied slot's is 1 at its draft
        n = prefix.probs.shape[-1]
        inside = jnp.take_along_axis(prefix.probs, jnp.minimum(drafts, n - 1)[..., None], axis=-1)[..., 0]
        q_x = jnp.where(prefix.copied, 1.0, inside)  # a drawn draft is < n (drawn from q)
    else:
        if draft_probs is not None:
            q = draft_probs.astype(jnp.float32)  # [B, D, V]
        else:
            q = processed_probs(d_logits, sp)  # [B, D, V]
        q_x = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keys, uniforms = _draw(keys, D + 1)
    u = uniforms[:, :D]  # acceptance tests; uniforms[:, D:] drive the one categorical draw below
    p_x = p_entries(drafts)  # [B, D]
    ok = (u * q_x < p_x) & proposed
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]

    # q's row at the stop [B, V]; row D (nothing proposed) is zeroed below by was_proposed, so it may be anything.
    stop = jnp.minimum(n_acc, D - 1)[:, None]  # [B, 1]
    was_proposed = jnp.take_along_axis(jnp.concatenate([proposed, jnp.zeros((B, 1), bool)], axis=1),
                                       n_acc[:, None], axis=1)  # [B, 1]
    if kernel:
        final = _kernel_residual(v_logits, n_acc, stop, was_proposed[:, 0], drafts, q, prefix, uniforms[:, D], sp)
        return n_acc, _committed(drafts, n_acc, final), keys
    p_at = p_row(n_acc)  # [B, V] target row at the stop
    if q is not None:
        q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # row D: nothing proposed -> bonus from p
        q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    elif prefix is not None:
        probs_at = jnp.take_along_axis(prefix.probs, stop[..., None], axis=1)[:, 0]  # [B, n]
        probs_at = jnp.pad(probs_at, ((0, 0), (0, V - probs_at.shape[-1])))
        point = jax.nn.one_hot(jnp.take_along_axis(drafts, stop, axis=1)[:, 0], V, dtype=jnp.float32)
        q_at = jnp.where(jnp.take_along_axis(prefix.copied, stop, axis=1), point, probs_at)
    elif candidates is None:
        q_at = jax.nn.one_hot(jnp.take_along_axis(drafts, stop, axis=1)[:, 0], V, dtype=jnp.float32)
    else:
        cand_at = jnp.take_along_axis(candidates, stop[..., None], axis=1)[:, 0]  # [B, k]
        q_k_at = jnp.take_along_axis(draft_probs.astype(jnp.float32), stop[..., None], axis=1)[:, 0]
        q_at = jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], cand_at].set(q_k_at)
    # Not proposed (p_min cut, or past the last draft): nothing to correct for, so sample from p itself.
    final = _categorical(uniforms[:, D:], residual_probs(p_at, jnp.where(was_proposed, q_at, 0.0)))  # [B]
    return n_acc, _committed(drafts, n_acc, final), keys


def _committed(drafts: jax.Array, n_acc: jax.Array, final: jax.Array) -> jax.Array:
    """[B, D+1]: the accepted drafts [B, D] before n_acc [B], then final [B] (the correction / bonus token)."""
    B, D = drafts.shape
    drafts_pad = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    return jnp.where(jnp.arange(D + 1)[None, :] < n_acc[:, None], drafts_pad, final[:, None])


def _kernel_residual(v_logits, n_acc, stop, was_proposed, drafts, q, prefix, u, sp) -> jax.Array:
    """accept_block's token after the accepted drafts, drawn by the CPU kernel (`cpu_kernel.residual_draw`) from the
    target's row n_acc: q's row at the stop is passed as it is held (a point mass as its id; a PrefixQ's row over its
    n ids; a dense q's row), and only where that slot was proposed."""
    B = drafts.shape[0]
    draft_at = jnp.take_along_axis(drafts, stop, axis=1)[:, 0]  # [B]
    none = jnp.full((B,), -1, jnp.int32)
    if q is not None:  # dense [B, D, V]
        q_row, q_on, point = jnp.take_along_axis(q, stop[..., None], axis=1)[:, 0], was_proposed, none
    elif prefix is not None:  # over the draft vocabulary; a copied slot's q is the point mass at its draft
        copied = jnp.take_along_axis(prefix.copied, stop, axis=1)[:, 0]
        q_row = jnp.take_along_axis(prefix.probs, stop[..., None], axis=1)[:, 0]  # [B, n]
        q_on, point = was_proposed & ~copied, jnp.where(was_proposed & copied, draft_at, -1)
    else:  # greedy drafts: the point mass at the draft
        q_row, q_on = jnp.zeros((B, 1), jnp.float32), jnp.zeros((B,), bool)
        point = jnp.where(was_proposed, draft_at, -1)
    return cpu_kernel.residual_draw(v_logits, n_acc, q_row, q_on, point, u, sp.temperature)
