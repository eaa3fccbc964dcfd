"""Context lookup: a draft tree step's nodes copied from the row's own text where its last tokens recur.

Answers repeat themselves and their requests (a function's name in its docstring and its body, a loop's header, an
argument list, quoted code): when the last k >= `min_match` committed tokens occurred before in the row's text, what
followed them then is a draft that the target often confirms token for token, where a one-layer drafter's best guess
does not (held-out SmolLM2 answers, 256 tokens: with a match of 4+ tokens the copied first token is right 78-88% of
the time and the drafter's 45-61%; docs/cpu-step.md, "Context lookup"). So on a row where such a match exists, the
step's tree is that continuation, a chain of up to the tree's depth nodes, instead of the drafter's tree: the verify
runs the same root + N nodes either way (same cost), and the walk takes the target's own tokens as for any tree, so
the output law is unchanged at every temperature (greedy: token for token).

Found on device, inside the loop, with static shapes: every earlier end position j of the row's text is scored by
how many tokens before it (up to `MAX_MATCH`) equal the tokens before the row's last one; the longest match wins,
then the most recent. The search reads the row's committed text: the last PROMPT_WINDOW tokens of its prompt (handed
over by prefill, `prompt_tail`) followed by its output so far, so a request that quotes code or text ("add type
hints to this function: ...") is copied from as soon as the answer starts repeating it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from dflash_jax.decode.buckets import PAD
from dflash_jax.decode.tree import NO_TOKEN, DraftTree

MAX_MATCH = 6  # longest suffix compared: longer matches rank the same (they are as reliable, measured)
# the default shortest repeat: held-out tau with trees of 2 / 4 / 7 nodes 1.90 / 2.23 / 2.46 at 2, 1.80 / 2.12 / 2.31
# at 1 (single tokens recur too often to predict), 1.89 / 2.20 / 2.40 at 3 (simulated on the greedy answers)
DEFAULT_MIN_MATCH = 2
PROMPT_WINDOW = 512  # prompt tokens searched (its last ones): a static width, so one loop program serves every prompt
NOT_TEXT = PAD  # left padding of a short prompt's window: never matches (never a token)


def prompt_tail(prompt: jax.Array, lens: jax.Array, width: int = PROMPT_WINDOW) -> jax.Array:
    """[B, width] int32: each row's last `width` prompt tokens (prompt [B, Tp], its first lens[b] tokens real),
    right-aligned, NOT_TEXT before a shorter prompt's first token."""
    i = jnp.arange(width, dtype=jnp.int32)[None, :]
    at = lens[:, None].astype(jnp.int32) - width + i  # [B, width] index into the row's prompt
    got = jnp.take_along_axis(prompt.astype(jnp.int32), jnp.clip(at, 0, prompt.shape[1] - 1), axis=1)
    return jnp.where(at >= 0, got, NOT_TEXT)


def continuation(out: jax.Array, n_out: jax.Array, width: int, min_match: int, prefix: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """What followed the last earlier occurrence of each row's final tokens.

    out [B, L] int32 committed tokens (entries at n_out and past are never read), n_out [B] how many; prefix [B, P]
    (optional) text before them, NOT_TEXT where there is none. In the row's text = prefix + out[:n_out], a match
    ends at j < t (t: the last token) where text[j - i] == text[t - i] for i = 0..k-1, k >= min_match, every compared
    entry text. Returns (tokens [B, width] text[j + 1 ...], n [B] how many of them exist: min(width, t - j), 0 where
    no match)."""
    if prefix is not None:
        out, n_out = jnp.concatenate([prefix.astype(out.dtype), out], axis=1), n_out + prefix.shape[1]
    B, L = out.shape
    t = n_out - 1  # [B] the row's last committed token (the step's root)
    j = jnp.arange(L, dtype=jnp.int32)[None, :]  # [1, L] candidate match ends
    run = jnp.ones((B, L), bool)
    length = jnp.zeros((B, L), jnp.int32)
    for i in range(min(MAX_MATCH, L)):  # static: a few elementwise passes over the buffer
        a, b = j - i, t[:, None] - i
        at_a = jnp.take_along_axis(out, jnp.clip(a, 0, L - 1), axis=1)
        at_b = jnp.take_along_axis(out, jnp.clip(b, 0, L - 1), axis=1)
        same = (a >= 0) & (b >= 0) & (at_a == at_b) & (at_b != NOT_TEXT)
        run = run & same
        length = length + run.astype(jnp.int32)
    ok = (j < t[:, None]) & (length >= min_match)
    rank = jnp.where(ok, length * L + j, -1)  # longest first, then the latest
    best = jnp.argmax(rank, axis=1).astype(jnp.int32)  # [B]
    found = ok.any(axis=1)
    k = jnp.arange(width, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(out, jnp.clip(best[:, None] + 1 + k, 0, L - 1), axis=1)
    n = jnp.where(found, jnp.minimum(t - best, width), 0).astype(jnp.int32)
    chex.assert_shape(tokens, (B, width))
    return tokens, n


def chain_tree(root: jax.Array, tokens: jax.Array, n: jax.Array, budget: int) -> DraftTree:
    """A draft tree of `budget` nodes that is the chain tokens[:, :n] under root [B] (node i at depth i, its parent
    i - 1); nodes past n (and past the chain's width) are absent."""
    B, width = tokens.shape
    i = jnp.arange(1, budget + 1, dtype=jnp.int32)[None, :]  # [1, N]
    here = i <= jnp.minimum(n, width)[:, None]  # [B, N]
    drafted = jnp.take_along_axis(tokens, jnp.clip(i - 1, 0, width - 1), axis=1)
    col0 = lambda v: jnp.full((B, 1), v, jnp.int32)
    return DraftTree(
        tokens=jnp.concatenate([root[:, None].astype(jnp.int32), jnp.where(here, drafted, NO_TOKEN)], axis=1),
        parents=jnp.concatenate([col0(0), jnp.where(here, i - 1, 0)], axis=1),
        depths=jnp.concatenate([col0(0), jnp.where(here, i, 1)], axis=1),
        scores=jnp.zeros((B, 1 + budget), jnp.float32))


def prefer_context(tr: DraftTree, out: jax.Array, n_out: jax.Array, depth: int, min_match: int,
                   prompt: jax.Array | None = None) -> tuple[DraftTree, jax.Array]:
    """The drafter's tree `tr`, or on rows whose text (prompt [B, P] from `prompt_tail`, then the output) ends in a
    repeat of >= min_match tokens the copied continuation (a chain of up to `depth` nodes, the rest absent). Returns
    (tree, found [B])."""
    B, T = tr.tokens.shape
    tokens, n = continuation(out, n_out, min(depth, T - 1), min_match, prompt)
    found = n > 0
    chain = chain_tree(tr.tokens[:, 0], tokens, n, T - 1)
    pick = lambda a, b: jnp.where(found[:, None], a, b)
    return jax.tree_util.tree_map(pick, chain, tr), found


__all__ = ["DEFAULT_MIN_MATCH", "MAX_MATCH", "NOT_TEXT", "PROMPT_WINDOW", "chain_tree", "continuation",
           "prefer_context", "prompt_tail"]
