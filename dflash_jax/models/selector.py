"""DFlash2's pairwise candidate selector (z-lab dflash/model.py `CandidateSelector.select` at 07ebd93db9f4).

Per draft slot t = 1..D (final-normed hidden h_t, draft logits l_t after output_multiplier and softcapping):
    candidates  b in top-k(l_t), unary U_t(b) = l_t[b]
    score       S_t(a, b) = U_t(b) + < A[a] * P(h_t), B[b] >        A/B = predecessor/successor codebooks [V, r],
                                                                    P = hidden_projection [r, H]
    walk        a_0 = the block's first token (the last verified one); a_t = the candidate chosen at slot t:
                argmax_b S_t(a_{t-1}, b) when greedy, else sampled from q_t = softmax(S_t(a_{t-1}, .) / T).
q_t (over the k candidates, no top-k / top-p) is the draft distribution that rejection sampling divides by.

The pair term is computed for every (candidate of slot t-1, candidate of slot t) at once, one [k, k] table per slot,
so the sequential walk is only gathers over k numbers per slot (a `lax.scan`, inside generate's while loop).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from dflash_jax.quant.linear import linear
from dflash_jax.params import CandidateSelector


def candidates(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """logits [B, D, V] -> (unary [B, D, k] f32, candidate ids [B, D, k] int32), best first."""
    B, D, V = logits.shape
    unary, cand = jax.lax.top_k(logits.reshape(B * D, V).astype(jnp.float32), top_k)
    # The barrier keeps XLA from fusing top_k's slice into its consumers: fused, XLA:CPU no longer recognises the
    # pattern and sorts all V logits per slot (measured: 91 ms vs 3 ms for the selector of a 7-slot, 4096-token draft).
    unary, cand = jax.lax.optimization_barrier((unary, cand))
    return unary.reshape(B, D, top_k), cand.astype(jnp.int32).reshape(B, D, top_k)


def pair_scores(sel: CandidateSelector, hidden: jax.Array, predecessors: jax.Array, cand: jax.Array) -> jax.Array:
    """<A[a] * P(h_t), B[b]> for given predecessors.

    hidden [B, D, H]; predecessors [B, D, m] token ids (m rows per slot); cand [B, D, k] -> [B, D, m, k] f32.
    """
    B, D, _ = hidden.shape
    k = cand.shape[-1]
    proj = linear(hidden, sel.hidden_projection).astype(jnp.float32)  # [B, D, r]
    a = jnp.take(sel.predecessor_codebook, predecessors, axis=0).astype(jnp.float32)  # [B, D, m, r]
    b = jnp.take(sel.successor_codebook, cand, axis=0).astype(jnp.float32)  # [B, D, k, r]
    out = jnp.einsum("bdmr,bdr,bdkr->bdmk", a, proj, b)
    chex.assert_shape(out, (B, D, predecessors.shape[-1], k))
    return out


def transition_table(sel: CandidateSelector, hidden: jax.Array, cand: jax.Array, anchor: jax.Array) -> jax.Array:
    """Pair term for every (previous candidate i, candidate j) of every slot: [B, D, k, k] f32.

    Slot 0's predecessor is the anchor whatever i is (its k rows are equal), so the walk can start at any row.
    """
    B, D, k = cand.shape
    first = jnp.broadcast_to(anchor.astype(jnp.int32)[:, None, None], (B, 1, k))
    prev = jnp.concatenate([first, cand[:, :-1]], axis=1)  # [B, D, k]: candidates of slot t-1
    return pair_scores(sel, hidden, prev, cand)


def walk(unary: jax.Array, table: jax.Array, *, temperature=0.0, uniforms: jax.Array | None = None):
    """The left-to-right walk. unary [B, D, k]; table [B, D, k, k] from `transition_table`.

    uniforms [B, D, k] in (0, 1) (or None = greedy): with temperature > 0 slot t's index is sampled from
    softmax(scores_t / T) by Gumbel-max, else it is the argmax. temperature may be traced.
    Returns (index [B, D] int32 into the candidates, scores [B, D, k] f32 along the chosen path).
    """
    B, D, k = unary.shape
    chex.assert_shape(table, (B, D, k, k))
    t = jnp.asarray(temperature, jnp.float32)
    safe_t = jnp.where(t > 0, t, 1.0)
    if uniforms is not None:
        chex.assert_shape(uniforms, (B, D, k))
        gumbel = -jnp.log(-jnp.log(uniforms.astype(jnp.float32)))
    else:
        gumbel = jnp.zeros((B, D, k), jnp.float32)

    def step(prev_idx, xs):
        u_t, table_t, g_t = xs  # [B, k], [B, k, k], [B, k]
        scores = u_t + jnp.take_along_axis(table_t, prev_idx[:, None, None], axis=1)[:, 0]  # [B, k]
        greedy = jnp.argmax(scores, axis=-1)
        if uniforms is None:
            idx = greedy
        else:
            idx = jnp.where(t > 0, jnp.argmax(scores / safe_t + g_t, axis=-1), greedy)
        return idx.astype(jnp.int32), (idx.astype(jnp.int32), scores)

    xs = (jnp.moveaxis(unary, 1, 0), jnp.moveaxis(table, 1, 0), jnp.moveaxis(gumbel, 1, 0))
    _, (idx, scores) = jax.lax.scan(step, jnp.zeros((B,), jnp.int32), xs)
    return jnp.moveaxis(idx, 0, 1), jnp.moveaxis(scores, 0, 1)


def select(sel: CandidateSelector, hidden: jax.Array, logits: jax.Array, anchor: jax.Array, top_k: int, *,
           temperature=0.0, uniforms: jax.Array | None = None):
    """The whole selector: hidden [B, D, H], logits [B, D, V], anchor [B] ->
    (tokens [B, D] int32, candidate ids [B, D, k], scores [B, D, k] along the path)."""
    B, D, _ = hidden.shape
    unary, cand = candidates(logits, top_k)
    table = transition_table(sel, hidden, cand, anchor)
    idx, scores = walk(unary, table, temperature=temperature, uniforms=uniforms)
    tokens = jnp.take_along_axis(cand, idx[..., None], axis=-1)[..., 0]
    chex.assert_shape(tokens, (B, D))
    return tokens, cand, scores


def selector_probs(scores: jax.Array, temperature) -> jax.Array:
    """q over the k candidates: softmax(scores / T) ([B, D, k] f32); T <= 0 uses T = 1 (p_min's confidence)."""
    t = jnp.asarray(temperature, jnp.float32)
    return jax.nn.softmax(scores / jnp.where(t > 0, t, 1.0), axis=-1)


def scatter_to_vocab(q: jax.Array, cand: jax.Array, vocab_size: int) -> jax.Array:
    """q [B, D, k] over candidate ids cand [B, D, k] (distinct per slot) -> [B, D, V] (zero elsewhere)."""
    B, D, k = q.shape
    rows = jnp.arange(B)[:, None, None]
    slots = jnp.arange(D)[None, :, None]
    return jnp.zeros((B, D, vocab_size), jnp.float32).at[rows, slots, cand].set(q)


__all__ = ["candidates", "pair_scores", "transition_table", "walk", "select", "selector_probs", "scatter_to_vocab"]
