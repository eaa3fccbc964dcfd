"""Context lookup (`generate(..., context_lookup=k)`, decode/lookup.py): a row whose text (its prompt's tail, then
its output) ends in a repeat of k+ tokens verifies the continuation of the repeat's last occurrence instead of the
drafter's tree (or a chain's first drafts) that step.

1. The search against a plain-Python reference (the longest match up to MAX_MATCH, then the latest; token 0 is a
   token; entries past the row's length are never read; the prompt's tail searched first, its padding never a
   match), and the chain it becomes.
2. Greedy generation with lookup == autoregressive on ragged batches (Qwen3, Llama, hybrid), trees and chains,
   where lookup fires (tau rises over the same runs without it); a planted bug (the copied nodes hung off the root
   instead of each other) breaks it. The law at temperature > 0 with lookup firing is test_tree.py's for trees (its
   SAMPLED cases include context_lookup=1) and test_sampling.py's for chains (its PROOF cases, and a control whose
   copied drafts keep the drafter's q).
3. Bad settings refused before any compile.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
import helpers as H
from helpers import no_work  # noqa: F401 (a fixture)
from dflash_jax.decode import lookup as L
from dflash_jax.decode import tree as T
from random_models import make_drafter, make_target
from test_hybrid import hybrid_copy_target

G = importlib.import_module("dflash_jax.decode.programs")


# -- 1. the search ---------------------------------------------------------------------------------------------------

def reference(row: list[int], width: int, min_match: int) -> list[int]:
    """What followed the last occurrence of the longest (up to MAX_MATCH) repeated suffix of `row`."""
    t = len(row) - 1
    for k in range(L.MAX_MATCH, min_match - 1, -1):
        for j in range(t - 1, k - 2, -1):
            if j - k + 1 >= 0 and row[j - k + 1:j + 1] == row[t - k + 1:t + 1]:
                return row[j + 1:j + 1 + width]
    return []


def run(rows: list[list[int]], width: int, min_match: int, size: int = 24, junk: int = 7):
    out = np.full((len(rows), size), junk, np.int32)  # entries past a row's length hold junk, never read
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    tokens, n = L.continuation(jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32), width, min_match)
    return [np.asarray(tokens)[b, :int(n[b])].tolist() for b in range(len(rows))]


CASES = [
    ([5, 6, 7, 9, 5, 6], [7, 9, 5]),  # a 2-token repeat; the copy stops at the row's end (width 3 here)
    ([1, 2, 3, 4, 9, 3, 4, 8, 2, 3, 4], [9, 3, 4]),  # the longest match wins over a later, shorter one
    ([3, 4, 1, 3, 4, 2, 3, 4], [2, 3, 4]),  # equally long: the latest wins
    ([0, 0, 7, 0, 0], [7, 0, 0]),  # token 0 is a token
    ([7, 7], []),  # the earlier 7 is a 1-token match: below min_match 2
    ([4, 7, 7, 7], [7]),  # overlapping: [7, 7] at j = 2 is followed by the last token itself
    ([1, 2, 3], []),
    ([9], []),
]


def test_continuation_is_the_reference_search():
    got = run([c for c, _ in CASES], 3, 2)
    assert got == [want for _, want in CASES]
    assert got == [reference(c, 3, 2) for c, _ in CASES]


def test_continuation_on_random_rows_and_min_matches():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 4, size=int(rng.integers(1, 20))).tolist() for _ in range(200)]
    for min_match in (1, 2, 3):
        assert run(rows, 5, min_match) == [reference(r, 5, min_match) for r in rows]


def test_junk_past_the_row_is_never_read():
    # junk that would extend the repeat ([5, 6] followed by 5, 6 ...) must not count
    assert run([[5, 6, 1, 5, 6]], 4, 2, junk=5) == [[1, 5, 6]]


def test_prompt_tail_right_aligns_the_last_prompt_tokens():
    prompt = jnp.asarray([[4, 5, 6, 7, 0, 0], [1, 2, 3, 4, 5, 6], [9, 0, 0, 0, 0, 0]], jnp.int32)  # right-padded
    tail = L.prompt_tail(prompt, jnp.asarray([4, 6, 0], jnp.int32), 5)
    N = L.NOT_TEXT
    assert tail.tolist() == [[N, 4, 5, 6, 7], [2, 3, 4, 5, 6], [N, N, N, N, N]]


def test_the_prompt_is_searched_before_the_output_and_its_padding_never_matches():
    N = L.NOT_TEXT
    prefix = jnp.asarray([[N, N, 3, 8, 9, 4], [N, N, N, N, N, N], [N, N, N, N, 5, 6]], jnp.int32)
    out = jnp.asarray([[8, 9, 0, 0], [5, 5, 0, 0], [1, 5, 6, 0]], jnp.int32)
    tokens, n = L.continuation(out, jnp.asarray([2, 2, 3], jnp.int32), 3, 2, prefix)
    got = [np.asarray(tokens)[b, :int(n[b])].tolist() for b in range(3)]
    # row 0: [8, 9] occurred in the prompt, followed by 4 and then the output's 8, 9; row 1: the padding's run of
    # NOT_TEXT never counts as a repeat; row 2: [5, 6] ends the prompt and the output, followed by the output's 1, 5
    assert got == [[4, 8, 9], [], [1, 5, 6]]
    # the same rows as one list each, against the reference search
    rows = [[3, 8, 9, 4, 8, 9], [5, 5], [5, 6, 1, 5, 6]]
    assert got == [reference(r, 3, 2) for r in rows]


def test_prefer_context_takes_the_chain_where_a_row_matches():
    logp = jnp.log(jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(6), size=(2, 3)), jnp.float32))
    drafted = T.build(logp, jnp.asarray([9, 9]), 4)
    out = jnp.asarray([[5, 6, 7, 8, 5, 6, 9], [1, 2, 3, 4, 5, 6, 9]], jnp.int32)
    tr, found = L.prefer_context(drafted, out, jnp.asarray([6, 7], jnp.int32), depth=3, min_match=2)
    assert found.tolist() == [True, False]
    assert tr.tokens[0].tolist() == [9, 7, 8, 5, T.NO_TOKEN]  # root, then the copy (3 = the depth), then absent
    assert tr.parents[0].tolist() == [0, 0, 1, 2, 0] and tr.depths[0].tolist() == [0, 1, 2, 3, 1]
    for field in ("tokens", "parents", "depths", "scores"):  # the other row keeps the drafter's tree
        np.testing.assert_array_equal(getattr(tr, field)[1], getattr(drafted, field)[1])


# -- 2. greedy generation --------------------------------------------------------------------------------------------

PROMPTS = H.COPY_PROMPTS + [H.cycle_prompt(27, 12), H.cycle_prompt(5, 37)]  # ragged, two prompt buckets
MAX_NEW = 40


@pytest.fixture(scope="module")
def targets():
    """test_tree.py's copy targets (Qwen3, Llama, hybrid): their greedy answers repeat, as real answers do."""
    return {"qwen3": H.build_copy_pair(H.FLAW, scale=0.3)[0],
            "llama": H.build_copy_pair(H.FLAW, family="llama", scale=0.3)[0], "hybrid": hybrid_copy_target()}


@pytest.fixture(scope="module")
def runs(targets):
    """family -> (autoregressive, tree without lookup, tree with lookup); a drafter that knows little."""
    _, weak = H.build_copy_pair(H.FLAW)
    out, chains = {}, {}
    for family, target in targets.items():
        kw = dict(max_new_tokens=MAX_NEW, tree_budget=4)
        out[family] = (dj.generate_autoregressive(target, PROMPTS, max_new_tokens=MAX_NEW),
                       dj.generate(target, weak, PROMPTS, context_lookup=0, **kw),
                       dj.generate(target, weak, PROMPTS, **kw))
        kw = dict(max_new_tokens=MAX_NEW, draft_length=3)
        chains[family] = (dj.generate(target, weak, PROMPTS, **kw), dj.generate(target, weak, PROMPTS,
                                                                                context_lookup=2, **kw))
    return dict(runs=out, chains=chains, drafter=weak)


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_greedy_with_lookup_equals_autoregressive(targets, runs, family):
    ar, off, on = runs["runs"][family]
    H.assert_same(targets[family], PROMPTS, ar, off, f"{family} tree, no lookup")
    H.assert_same(targets[family], PROMPTS, ar, on, f"{family} tree with lookup")
    assert off.context_lookup == 0 and on.context_lookup == L.DEFAULT_MIN_MATCH
    print(f"\n[{family}] tau without lookup {off.tau:.2f}, with {on.tau:.2f}")
    assert on.tau > off.tau  # it fired (the copy targets' answers repeat) and its copies were accepted


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_greedy_chain_with_lookup_equals_autoregressive(targets, runs, family):
    """A chain's first drafts copied where the text repeats (`decode.loop._copied_drafts`): the same tokens."""
    ar = runs["runs"][family][0]
    off, on = runs["chains"][family]
    H.assert_same(targets[family], PROMPTS, ar, off, f"{family} chain, no lookup")
    H.assert_same(targets[family], PROMPTS, ar, on, f"{family} chain with lookup")
    assert off.context_lookup == 0 and on.context_lookup == 2  # a chain's default is off
    print(f"\n[{family}] chain of 3: tau without lookup {off.tau:.2f}, with {on.tau:.2f}")
    assert on.tau > off.tau


_chain_tree = L.chain_tree


def _chain_off_the_root(root, tokens, n, budget):
    """A planted bug: the copied tokens as siblings under the root, each claiming its depth along the chain."""
    tr = _chain_tree(root, tokens, n, budget)
    return tr.replace(parents=jnp.zeros_like(tr.parents))


def test_planted_chain_off_the_root_is_caught(targets, runs, monkeypatch):
    monkeypatch.setattr(G, "_COMPILED", {})  # fresh programs, traced with the bug
    monkeypatch.setattr(L, "chain_tree", _chain_off_the_root)
    ar, _, _ = runs["runs"]["qwen3"]
    bad = dj.generate(targets["qwen3"], runs["drafter"], PROMPTS, max_new_tokens=MAX_NEW, tree_budget=4)
    assert not np.array_equal(bad.tokens, ar.tokens)


# -- 3. bad settings -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    s = H.SETUPS[0]
    return make_target(s.target, 0), make_drafter(s.drafter, 100)


@pytest.mark.parametrize("value", [-1, L.MAX_MATCH + 1, True, "2", 1.5])
def test_bad_context_lookup(pair, no_work, value):
    with pytest.raises(ValueError, match=rf"context_lookup must be an integer in 0..{L.MAX_MATCH}"):
        dj.generate(*pair, [[1, 2]], max_new_tokens=4, tree_budget=2, context_lookup=value)


def test_context_lookup_with_a_dflash2_chain(no_work):
    s = H.SETUPS[0]
    dflash2 = H.as_dflash2(make_drafter(s.drafter, 100), 1)
    with pytest.raises(ValueError, match=r"context_lookup=2: a chain's copied drafts are verified against a "
                                         r"point-mass q, and a DFlash2 drafter's q lives on its selector's"):
        dj.generate(make_target(s.target, 0), dflash2, [[1, 2]], max_new_tokens=4, draft_length=2, context_lookup=2)


def test_autoregressive_takes_no_context_lookup(pair, no_work):
    with pytest.raises(TypeError, match="unexpected keyword argument 'context_lookup'"):
        dj.generate_autoregressive(pair[0], [[1, 2]], max_new_tokens=4, context_lookup=2)
