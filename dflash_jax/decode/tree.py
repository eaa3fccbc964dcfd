"""Draft trees (DDTree, Ringel & Romano, arXiv 2604.12989) built, laid out and walked on device, inside the loop.

One DFlash pass gives an independent distribution per block position (none is conditioned on an earlier draft), so
the score of a draft prefix is the sum of its positions' log-probabilities, and the N best prefixes form a tree
(prefix-closed: a prefix never outscores its parent) that maximises the surrogate expected acceptance. `build` finds
them best first with a static trip count: each depth keeps its top K = min(N, V) tokens; a candidate is (parent node,
depth, rank at that depth), scored by its parent's score plus its own log-probability; each of the N pops takes the
best candidate as the next node and offers two new ones, its next sibling (same parent and depth, rank + 1) and its
first child (one depth down, rank 0). Nodes come out parent before child (a node's parent has a smaller index) and
siblings carry distinct tokens (distinct ranks).

Node 0 is the root (the last committed token, depth 0, not counted in the budget); nodes 1..N are drafts at depths
1..D, D = min(N, block_size - 1). The target verifies root + N nodes in one pass at positions start + depth
(`positions`) under `ancestor_mask` (a node sees the committed cache, its ancestors and itself), and a hybrid
target's DeltaNet runs along the tree by parent index (`conv_taps`, the same mask). `walk` then follows from the
root the child whose token equals the target's own token at the current node (its argmax at temperature 0, its own
draw under its own rule at temperature > 0): what is committed is the target's tokens along the accepted path, the
last of them the bonus, so the output law is the target's at every temperature.

A node that does not exist (fewer finite-scored prefixes than the budget, e.g. a draft vocabulary smaller than the
budget) has the token NO_TOKEN, hangs off the root and is never matched; it runs through the verify as token 0.
Token 0 itself is an ordinary token: the size of a tree is never read from its token ids.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from dflash_jax.decode.sampling import SamplingParams, in_cpu_kernel
from dflash_jax.quant import cpu_kernel
from dflash_jax.frozen import Replaceable

NO_TOKEN = -1  # a node that does not exist: never equal to a target token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree(Replaceable):
    tokens: jax.Array  # [B, 1 + N] int32: node 0 = the root (the last committed token); NO_TOKEN for absent nodes
    parents: jax.Array  # [B, 1 + N] int32: parent node index (< the node's own); 0 for the root and absent nodes
    depths: jax.Array  # [B, 1 + N] int32: 0 for the root, 1..D for drafts, 1 for absent nodes
    scores: jax.Array  # [B, 1 + N] float32: summed draft log-probability of the node's prefix (0 at the root)

    @property
    def valid(self) -> jax.Array:
        """[B, 1 + N] bool: the node exists."""
        return self.tokens != NO_TOKEN


def tree_depth(budget: int, block_size: int) -> int:
    """The deepest a tree of `budget` nodes can reach with a drafter of this block: one node per depth at most, and
    a block proposes block_size - 1 positions."""
    return min(int(budget), int(block_size) - 1)


def draft_scores(d_logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Draft log-probabilities [B, D, V] the tree ranks prefixes by: the drafter's softmax at the sampling temperature
    (at 1 when greedy), so a prefix's score estimates how likely the target is to draw it. Ids the drafter may not
    propose (-inf logits: a draft vocabulary) get -inf and never become nodes."""
    x = d_logits.astype(jnp.float32)
    if not sp.greedy:
        x = x / sp.temperature
    return jax.nn.log_softmax(x, axis=-1)


def draft_top(d_logits: jax.Array, sp: SamplingParams, k: int) -> tuple[jax.Array, jax.Array]:
    """(log-probabilities [B, D, k], ids [B, D, k]): each position's k best ids under `draft_scores`, best first,
    without writing the log-softmax of the whole row: the top k of the logits (the same order), minus the row's
    log-sum-exp. In the CPU loops both are the kernel's, one pass over each row each (`cpu_kernel.top_k`,
    `row_logsumexp`): XLA's log-softmax and TopK over a tree of 2's two 8,192-id rows took ~65 us of a step."""
    x = d_logits.astype(jnp.float32)
    t = 1.0 if sp.greedy else sp.temperature
    if in_cpu_kernel(x):
        (vals, ids), lse = cpu_kernel.top_k(x, k), cpu_kernel.row_logsumexp(x, t)  # [B, D, k] x 2, [B, D]
    else:
        (vals, ids), lse = _top_k(x, k), jax.nn.logsumexp(x / t, axis=-1)
    return vals / t - lse[..., None], ids


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis, taken on a 2-D view: XLA:CPU lowered the 3-D one inside `build` to a full sort
    of the vocabulary (138 ms for 7 x 49,152 logits, against 0.4 ms for its TopK call on the 2-D view)."""
    vals, ids = jax.lax.top_k(x.reshape(-1, x.shape[-1]), k)
    return vals.reshape(x.shape[:-1] + (k,)), ids.reshape(x.shape[:-1] + (k,))


def build(logp: jax.Array, root: jax.Array, budget: int) -> DraftTree:
    """The `budget` best prefixes of the per-position draft log-probabilities logp [B, D, V] (position k is depth
    k + 1) as a tree under root [B]; best first, N pops (a static trip count)."""
    return build_from_top(*_top_k(logp, min(int(budget), logp.shape[-1])), root, budget)


def build_from_top(top_lp: jax.Array, top_id: jax.Array, root: jax.Array, budget: int) -> DraftTree:
    """`build` from each position's K = min(budget, V) best log-probabilities and ids [B, D, K], best first (ties:
    the lower id first), as `_top_k` or `draft_top` give them."""
    B, D, K = top_lp.shape
    N = int(budget)
    C = 2 * N + 1  # candidate slots: the root's first child, then two per pop
    neg = jnp.float32(-jnp.inf)
    rows = jnp.arange(B)
    # the candidate pool (score, parent, depth 1..D, rank 0..K-1), slot c filled in order: on equal scores the
    # earlier candidate wins (argmax takes the first), as a heap with an insertion counter would
    pool = (jnp.full((B, C), neg).at[:, 0].set(top_lp[:, 0, 0]), jnp.zeros((B, C), jnp.int32),
            jnp.ones((B, C), jnp.int32), jnp.zeros((B, C), jnp.int32))
    tree = DraftTree(tokens=jnp.full((B, 1 + N), NO_TOKEN, jnp.int32).at[:, 0].set(root.astype(jnp.int32)),
                     parents=jnp.zeros((B, 1 + N), jnp.int32), depths=jnp.zeros((B, 1 + N), jnp.int32),
                     scores=jnp.zeros((B, 1 + N), jnp.float32))

    def pop(i, carry):
        (cs, cp, cd, cr), t = carry
        best = jnp.argmax(cs, axis=1)  # [B]
        score, parent, depth, rank = cs[rows, best], cp[rows, best], cd[rows, best], cr[rows, best]
        alive = score > neg  # False once fewer finite-scored prefixes than the budget remain
        t = t.replace(tokens=t.tokens.at[:, i].set(jnp.where(alive, top_id[rows, depth - 1, rank], NO_TOKEN)),
                      parents=t.parents.at[:, i].set(jnp.where(alive, parent, 0)),
                      depths=t.depths.at[:, i].set(jnp.where(alive, depth, 1)),
                      scores=t.scores.at[:, i].set(score))
        cs = cs.at[rows, best].set(neg)
        # Scores are sums from the parent's own score (not a difference from the popped one): no cancellation.
        sib = jnp.where(alive & (rank + 1 < K),
                        t.scores[rows, parent] + top_lp[rows, depth - 1, jnp.minimum(rank + 1, K - 1)], neg)
        kid = jnp.where(alive & (depth < D), score + top_lp[rows, jnp.minimum(depth, D - 1), 0], neg)
        s1, s2 = 2 * i - 1, 2 * i  # this pop's two slots
        cs = cs.at[:, s1].set(sib).at[:, s2].set(kid)
        cp = cp.at[:, s1].set(parent).at[:, s2].set(i)
        cd = cd.at[:, s1].set(depth).at[:, s2].set(depth + 1)
        cr = cr.at[:, s1].set(rank + 1).at[:, s2].set(0)
        return (cs, cp, cd, cr), t

    _, tree = jax.lax.fori_loop(1, N + 1, pop, (pool, tree))
    chex.assert_shape(tree.tokens, (B, 1 + N))
    return tree


def ancestors(tree: DraftTree, n: int) -> jax.Array:
    """[B, 1 + N, n + 1] int32: column j is each node's j-th ancestor (column 0 the node itself; the root once j
    reaches the node's depth, the root being its own parent). n >= the tree's depth gives every ancestor."""
    cols = [jnp.broadcast_to(jnp.arange(tree.parents.shape[1], dtype=jnp.int32), tree.parents.shape)]
    for _ in range(n):  # static and short (n <= block_size - 1): pointer jumps along the parents
        cols.append(jnp.take_along_axis(tree.parents, cols[-1], axis=1))
    return jnp.stack(cols, axis=-1)


def ancestor_mask(anc: jax.Array) -> jax.Array:
    """[B, 1 + N, 1 + N] bool: node i sees node j iff j is i or one of its ancestors (from `ancestors` with n >= the
    depth: the root is everyone's ancestor)."""
    T = anc.shape[1]
    return (anc[..., None] == jnp.arange(T, dtype=jnp.int32)).any(axis=2)


def positions(tree: DraftTree, start: jax.Array) -> jax.Array:
    """[B, 1 + N] absolute positions: the committed length + the node's depth (never its index)."""
    return start[:, None] + tree.depths


def verify_tokens(tree: DraftTree) -> jax.Array:
    """[B, 1 + N] the tokens the target runs: absent nodes as token 0 (their results are never read)."""
    return jnp.where(tree.valid, tree.tokens, 0)


def conv_taps(tree: DraftTree, anc: jax.Array, kernel: int) -> jax.Array:
    """[B, 1 + N, kernel] int32: where a hybrid target's DeltaNet conv reads each node's inputs, as indices into
    [its conv window (kernel - 1 entries) | the nodes' inputs]: tap j of node i is the input `kernel - 1 - j`
    steps up its path (its ancestors by parent index, then the window before the root). `anc` needs n >=
    kernel - 1."""
    w = kernel - 1
    cols = []
    for j in range(kernel):
        back = w - j  # steps up the path
        up = anc[..., back]  # the ancestor `back` steps up (the root once past it)
        cols.append(jnp.where(tree.depths >= back, w + up, w + tree.depths - back))
    return jnp.stack(cols, axis=-1)


def walk(tree: DraftTree, anc: jax.Array, target_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Follow the target's tokens [B, 1 + N] (its token at every node) down the tree, in one vectorised pass.

    A node is reached iff every edge on its path matches: the child's token equals the target's token at the
    parent. Siblings hold distinct tokens, so the reached nodes form one path from the root. Returns (path
    [B, 1 + D] int32 node indices of that path, root first, the last node repeated after its end; n_acc [B] its
    accepted drafts). The committed tokens are then the target's tokens at the path's first n_acc + 1 nodes (the
    last of them the bonus)."""
    B, T, cols = anc.shape
    D = cols - 1
    at_parent = jnp.take_along_axis(target_tokens, tree.parents, axis=1)  # [B, T] the target's token at the parent
    edge_ok = ((tree.tokens == at_parent) & tree.valid).at[:, 0].set(True)
    # every edge from the node up to the root (the root's own counts as matched)
    reached = jnp.take_along_axis(edge_ok, anc.reshape(B, -1), axis=1).reshape(anc.shape).all(axis=2)
    depth = jnp.where(reached, tree.depths, -1)
    last = jnp.argmax(depth, axis=1)  # [B] the deepest reached node (the root at least)
    n_acc = jnp.max(depth, axis=1)  # [B] its depth
    j = jnp.arange(D + 1, dtype=jnp.int32)[None, :]
    up = jnp.clip(n_acc[:, None] - j, 0, D)  # node at depth j is `n_acc - j` steps above the last
    path = jnp.where(j <= n_acc[:, None], jnp.take_along_axis(anc[jnp.arange(B), last], up, axis=1), last[:, None])
    chex.assert_shape(path, (B, D + 1))
    return path.astype(jnp.int32), n_acc.astype(jnp.int32)


__all__ = ["DraftTree", "NO_TOKEN", "ancestor_mask", "ancestors", "build", "build_from_top", "conv_taps",
           "draft_scores", "draft_top", "positions", "tree_depth", "verify_tokens", "walk"]
