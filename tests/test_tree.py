"""Draft trees inside the loop (`generate(..., tree_budget=N)`, decode/tree.py): built on device, verified in one
target pass, walked with the target's own tokens; lossless at every temperature, hybrid targets included.

1. The tree's pieces against plain-Python references: the best-first build (a heap with an insertion counter, ties
   and -inf logits included), the set it selects (the N best prefixes, by enumeration), ancestors / mask /
   positions / the hybrid conv taps on a hand-built tree, the walk (token 0 is a token like any other).
2. One verify pass against cache-free forwards: every node's logits and features equal a `target_forward` over the
   prompt, the root and the node's path; after `commit_tree` the cache equals a prefill of the accepted tokens
   (K/V in consecutive slots, DeltaNet states). Qwen3, Llama and hybrid targets. Planted bugs (positions by node
   index, a sibling visible, compaction one slot off, a DeltaNet node run from its predecessor) each break it.
3. Greedy generation with a tree == `generate_autoregressive` on ragged batches in two prompt-length buckets, with
   EOS inside an accepted path (Qwen3, Llama, hybrid copy targets whose tokens depend on the whole context); the
   perfect copy drafter accepts the whole depth every step (the bonus counted once).
4. The law at temperature > 0 (tests/test_sampling.py's exact enumeration and G tests, this module's share of the
   false-alarm budget): T 1.0 and 0.6, top-k / top-p, a hybrid target; one uniform shared by every node (a planted
   bug) fails the same checks.
5. Bad input refused before any compile; one loop program per cache / batch bucket; no host sync in the loop and,
   exported for CUDA, no data-dependent loop or conditional inside a step.
"""

from __future__ import annotations

import copy
import functools
import heapq
import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
import helpers as H
from helpers import no_work  # noqa: F401 (a fixture)
import stats
import test_sampling as ts
from dflash_jax.decode import loop as decode_loop
from dflash_jax.decode import tree as T
from dflash_jax.decode.sampling import SamplingParams, _categorical, _draw, processed_probs, sample_tokens
from dflash_jax.models import deltanet as dn
from dflash_jax.models import layers as layers_mod
from dflash_jax.models.cache import AttentionCache
from dflash_jax.models.target import KVCache, TreeLayout, commit_tree, forward_tree, forward_with_cache
from random_models import make_drafter, make_target
from test_hybrid import hybrid_copy_target

G = importlib.import_module("dflash_jax.decode.programs")
MODULE = "test_tree"
PAD = -1


# -- 1. the tree's pieces --------------------------------------------------------------------------------------------

def heap_build(logp: np.ndarray, N: int) -> list[tuple[int, int, int, float]]:
    """DDTree's construction with a heap (float32 sums, insertion counter on ties): (token, parent, depth, score) per
    node in pop order, node 0 being the root."""
    D, V = logp.shape
    K = min(N, V)
    order = np.argsort(-logp, axis=1, kind="stable")[:, :K]
    lp = np.take_along_axis(logp, order, axis=1).astype(np.float32)
    scores = [np.float32(0.0)]
    heap, counter, nodes = [(-lp[0, 0], 0, 1, 0, 0)], 1, []
    while heap and len(nodes) < N:
        s, _, d, r, p = heapq.heappop(heap)
        if not np.isfinite(s):
            break
        score = np.float32(-s)
        nodes.append((int(order[d - 1, r]), p, d, float(score)))
        scores.append(score)
        i = len(nodes)
        if r + 1 < K:  # the next sibling, then the first child
            heapq.heappush(heap, (-(scores[p] + lp[d - 1, r + 1]), counter, d, r + 1, p))
            counter += 1
        if d < D:
            heapq.heappush(heap, (-(score + lp[d, 0]), counter, d + 1, 0, i))
            counter += 1
    return nodes


_build = jax.jit(T.build, static_argnums=2)


def _random_logp(rng, B, D, V, ties=False, holes=False):
    x = rng.standard_normal((B, D, V)).astype(np.float32) * 2
    if ties:
        x = np.round(x)  # equal log-probabilities within a position
    if holes:
        x[..., V // 2:] = -np.inf  # a draft vocabulary: these ids are never drafted
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


@pytest.mark.parametrize("ties,holes", [(False, False), (True, False), (False, True)])
def test_build_is_the_best_first_heap(ties, holes):
    rng = np.random.default_rng(int(ties) + 2 * int(holes))
    for _ in range(12):
        D, V, N = int(rng.integers(1, 6)), int(rng.integers(2, 12)), int(rng.integers(1, 24))
        logp = _random_logp(rng, 2, D, V, ties, holes)
        tree = _build(jnp.asarray(logp), jnp.asarray([5, 0]), N)
        for b in range(2):
            want = heap_build(logp[b], N)
            got = [(int(tree.tokens[b, i]), int(tree.parents[b, i]), int(tree.depths[b, i]),
                    float(tree.scores[b, i])) for i in range(1, N + 1)]
            assert got[:len(want)] == want, (D, V, N, want, got)
            # fewer finite prefixes than the budget: absent nodes hang off the root, never a token
            assert all(t == T.NO_TOKEN and p == 0 and d == 1 for t, p, d, _ in got[len(want):])


def test_tree_holds_the_best_prefixes_parents_first():
    """The nodes are the N highest-scoring prefixes (by enumeration of every prefix), each node's parent comes
    before it at one depth less, its score is the parent's plus its own log-probability, siblings differ."""
    rng = np.random.default_rng(7)
    D, V, N = 3, 5, 17
    logp = _random_logp(rng, 1, D, V)
    tree = jax.tree.map(np.asarray, _build(jnp.asarray(logp), jnp.asarray([2]), N))
    prefixes = [sum(logp[0, k, t] for k, t in enumerate(p)) for d in range(1, D + 1)
                for p in itertools.product(range(V), repeat=d)]
    np.testing.assert_allclose(np.sort(tree.scores[0, 1:])[::-1], np.sort(prefixes)[::-1][:N], rtol=1e-5)
    for i in range(1, N + 1):
        p = tree.parents[0, i]
        assert p < i and tree.depths[0, i] == tree.depths[0, p] + 1
        assert tree.scores[0, i] == pytest.approx(tree.scores[0, p] + logp[0, tree.depths[0, i] - 1,
                                                                         tree.tokens[0, i]], rel=1e-6)
    for p in range(N + 1):
        kids = tree.tokens[0, 1:][tree.parents[0, 1:] == p]
        assert len(set(kids.tolist())) == len(kids)


# A hand-built tree (index != depth, siblings interleaved, token 0 twice) under root token 5:
#   0 (root) -> 1, 2;  1 -> 3, 5;  2 -> 4;  3 -> 6;  4 -> 7;  6 -> 8
HAND_PARENTS = [0, 0, 0, 1, 2, 1, 3, 4, 6]
HAND_DEPTHS = [0, 1, 1, 2, 2, 2, 3, 3, 4]
HAND_TOKENS = [5, 0, 9, 12, 0, 7, 33, 1, 2]


def hand_tree(tokens=HAND_TOKENS, parents=HAND_PARENTS, depths=HAND_DEPTHS, batch=1) -> T.DraftTree:
    arr = lambda x: jnp.asarray(np.tile(np.asarray(x, np.int32), (batch, 1)))
    return T.DraftTree(tokens=arr(tokens), parents=arr(parents), depths=arr(depths),
                       scores=jnp.zeros((batch, len(tokens)), jnp.float32))


def test_ancestors_mask_positions_and_conv_taps():
    tree = hand_tree()
    anc = T.ancestors(tree, 4)
    mask = np.asarray(T.ancestor_mask(anc))[0]
    for i in range(9):
        path, j = {i}, i
        while j:
            j = HAND_PARENTS[j]
            path.add(j)
        assert set(np.flatnonzero(mask[i]).tolist()) == path, i
    np.testing.assert_array_equal(T.positions(tree, jnp.asarray([40]))[0], 40 + np.asarray(HAND_DEPTHS))
    taps = np.asarray(T.conv_taps(tree, anc, 4))[0]  # into [window of 3 | nodes]: node t is entry 3 + t
    assert taps[0].tolist() == [0, 1, 2, 3]  # the root reads the window
    assert taps[2].tolist() == [1, 2, 3, 5]  # depth 1: two window entries, the root, itself
    assert taps[8].tolist() == [3 + 1, 3 + 3, 3 + 6, 3 + 8]  # depth 4: its path 0-1-3-6-8, the last four
    chain = hand_tree(tokens=list(range(6)), parents=[0, 0, 1, 2, 3, 4], depths=list(range(6)))
    np.testing.assert_array_equal(T.conv_taps(chain, T.ancestors(chain, 5), 4)[0],
                                  np.arange(6)[:, None] + np.arange(4)[None, :])  # a chain: causal_conv's taps


def test_walk_follows_the_target_and_token_zero_is_a_token():
    tree = hand_tree(batch=4)
    anc = T.ancestors(tree, 4)
    own = np.full((4, 9), 40, np.int32)  # the target's token at every node (40: no child has it)
    own[0, [0, 1, 3, 6]] = [0, 12, 33, 2]  # root -> node 1 (token 0) -> 3 -> 6 -> 8: the whole depth
    own[1, [0, 2, 4]] = [9, 0, 3]  # root -> 2 -> 4 (token 0); 7 has token 1, not 3: stop at depth 2
    own[2, 0] = 12  # 12 is a grandchild's token, not a child's: nothing accepted
    own[3, [0, 1]] = [0, 7]  # root -> 1 -> 5 (a second sibling): depth 2
    path, n_acc = map(np.asarray, T.walk(tree, anc, jnp.asarray(own)))
    assert n_acc.tolist() == [4, 2, 0, 2]
    assert path.tolist() == [[0, 1, 3, 6, 8], [0, 2, 4, 4, 4], [0, 0, 0, 0, 0], [0, 1, 5, 5, 5]]
    committed = np.take_along_axis(own, path, axis=1)  # drafts, then the bonus at n_acc
    assert committed[0].tolist() == [0, 12, 33, 2, 40] and committed[1, :3].tolist() == [9, 0, 3]
    # an absent node (NO_TOKEN) is never reached, whatever the target says
    absent = hand_tree(tokens=HAND_TOKENS[:2] + [T.NO_TOKEN] + HAND_TOKENS[3:])
    _, n = T.walk(absent, T.ancestors(absent, 4), jnp.asarray(np.where(np.arange(9) == 0, -1, 40)[None]))
    assert int(n[0]) == 0


# -- 2. one verify pass against cache-free forwards ------------------------------------------------------------------

def _targets():
    return {"qwen3": H.build_copy_pair(H.FLAW, scale=0.3)[0], "llama": H.build_copy_pair(H.FLAW, family="llama",
                                                                                         scale=0.3)[0],
            "hybrid": hybrid_copy_target()}


@pytest.fixture(scope="module")
def targets():
    return _targets()


VERIFY_PROMPTS = [H.cycle_prompt(3, 11), H.cycle_prompt(42, 6)]  # ragged: rows of 11 and 6 committed tokens
TAPS = (1, 0)  # the copy drafter's taps (both layers)


def _verify(target, tree, *, positions=T.positions, mask=T.ancestor_mask, commit=commit_tree, path=None, n=None):
    """Prefill VERIFY_PROMPTS, run `tree` (its root = the next token) through `forward_tree`, then `commit` the
    given path's first n nodes: (logits [B, T, V], features, the cache after the commit). The keywords swap in
    planted bugs."""
    cfg = target.config
    lens = jnp.asarray([len(p) for p in VERIFY_PROMPTS], jnp.int32)
    prompt = jnp.asarray([p + [0] * (16 - len(p)) for p in VERIFY_PROMPTS], jnp.int32)

    @jax.jit
    def run(target, prompt, lens, tree, path, n):
        cache = KVCache.empty(cfg, 2, 64)
        _, _, cache = forward_with_cache(target, prompt, cache, empty_cache=True,
                                         state_keep=lens if cfg.is_hybrid else None)
        cache = cache.replace(lengths=lens)
        anc = T.ancestors(tree, 4)
        layout = TreeLayout(positions=positions(tree, lens), mask=mask(anc),
                            conv_taps=T.conv_taps(tree, anc, cfg.linear_conv_kernel_dim) if cfg.is_hybrid else None)
        logits, feats, pending = forward_tree(target, T.verify_tokens(tree), cache, TAPS, layout)
        return logits, feats, commit(cache, pending, path, n, cfg)

    return run(target, prompt, lens, tree, path, n)


def _reference(target, row, tokens):
    """Cache-free: logits and features of the last of prompt row + tokens."""
    seq = VERIFY_PROMPTS[row] + list(tokens)
    logits, feats = dj.target_forward(target, H.pad_to(seq, 24), TAPS)
    return np.asarray(logits)[0, len(seq) - 1], np.asarray(feats)[0, len(seq) - 1]


def _node_path(i):
    path = [i]
    while path[-1]:
        path.append(HAND_PARENTS[path[-1]])
    return path[::-1]


PATHS = jnp.asarray([[0, 1, 3, 6, 8], [0, 2, 4, 7, 7]], jnp.int32)
KEEP = jnp.asarray([4, 3], jnp.int32)  # row 0 keeps root, 1, 3, 6; row 1 root, 2, 4


def _verify_gaps(target, **bugs) -> tuple[float, float]:
    """(largest logit / feature gap of any node against its cache-free reference, largest gap of the committed
    cache against a prefill of the kept tokens)."""
    tree = hand_tree(batch=2)
    tokens = np.asarray(HAND_TOKENS)
    logits, feats, cache = _verify(target, tree, path=PATHS, n=KEEP, **bugs)
    gap = 0.0
    for b in range(2):
        for i in range(9):
            want_l, want_f = _reference(target, b, tokens[_node_path(i)])
            gap = max(gap, float(np.abs(np.asarray(logits)[b, i] - want_l).max()),
                      float(np.abs(np.asarray(feats)[b, i] - want_f).max()))
    cfg = target.config
    kept = [tokens[np.asarray(PATHS[b, :int(KEEP[b])])].tolist() for b in range(2)]
    seqs = [VERIFY_PROMPTS[b] + kept[b] for b in range(2)]
    lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
    full = KVCache.empty(cfg, 2, 64)
    _, _, full = forward_with_cache(target, jnp.asarray([s + [0] * (24 - len(s)) for s in seqs], jnp.int32), full,
                                    empty_cache=True, state_keep=lens if cfg.is_hybrid else None)
    np.testing.assert_array_equal(cache.lengths, lens)
    cache_gap = 0.0
    for got, want in zip(cache.layers, full.layers):
        if isinstance(got, AttentionCache):
            for b in range(2):
                n = int(lens[b])
                cache_gap = max(cache_gap,  # [B, nKV, S, hd]
                                float(np.abs(np.asarray(got.k)[b, :, :n] - np.asarray(want.k)[b, :, :n]).max()),
                                float(np.abs(np.asarray(got.v)[b, :, :n] - np.asarray(want.v)[b, :, :n]).max()))
        else:
            cache_gap = max(cache_gap, float(np.abs(np.asarray(got.conv) - np.asarray(want.conv)).max()),
                            float(np.abs(np.asarray(got.state) - np.asarray(want.state)).max()))
    return gap, cache_gap


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_tree_verify_equals_cache_free_forwards(targets, family):
    gap, cache_gap = _verify_gaps(targets[family])
    print(f"\n[{family}] tree verify vs cache-free forwards: logits / features {gap:.1e}, cache {cache_gap:.1e}")
    assert gap < 1e-4 and cache_gap < 1e-4


def _positions_by_index(tree, start):
    return start[:, None] + jnp.arange(tree.depths.shape[1], dtype=jnp.int32)[None, :]


def _sibling_visible(anc):
    """The ancestor mask plus every earlier sibling (same parent)."""
    T_ = anc.shape[1]
    sibling = (anc[:, :, None, 1] == anc[:, None, :, 1]) & jnp.tril(jnp.ones((T_, T_), bool), -1)
    return T.ancestor_mask(anc) | sibling


def _compaction_off_by_one(cache, pending, path, n, cfg):
    out = commit_tree(cache.replace(lengths=cache.lengths + 1), pending, path, n, cfg)
    return out.replace(lengths=out.lengths - 1)


def _from_predecessor(p, h, cfg, conv, state, *, mask, taps):
    """A DeltaNet node run from the node before it (index order) instead of its parent."""
    T_ = mask.shape[1]
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((T_, T_), bool)), mask.shape)
    steps = jnp.arange(T_, dtype=jnp.int32)[:, None] + jnp.arange(taps.shape[-1], dtype=jnp.int32)[None, :]
    return dn.deltanet_tree(p, h, cfg, conv, state, mask=chain, taps=jnp.broadcast_to(steps, taps.shape))


@pytest.mark.parametrize("bug", ["positions by node index", "a sibling visible", "compaction one slot off",
                                 "hybrid state from the predecessor"])
def test_planted_verify_bugs_are_caught(targets, monkeypatch, bug):
    family = "hybrid" if bug.startswith("hybrid") else "qwen3"
    kw = {"positions by node index": dict(positions=_positions_by_index), "a sibling visible":
          dict(mask=_sibling_visible), "compaction one slot off": dict(commit=_compaction_off_by_one)}.get(bug, {})
    if bug.startswith("hybrid"):
        monkeypatch.setattr(layers_mod, "deltanet_tree", _from_predecessor)  # the name linear_attn_layer calls
    gap, cache_gap = _verify_gaps(targets[family], **kw)
    print(f"\n[planted: {bug}] logits / features {gap:.1e}, cache {cache_gap:.1e}")
    assert max(gap, cache_gap) > 1e-2


# -- 3. greedy generation == autoregressive --------------------------------------------------------------------------

SHORT = H.COPY_PROMPTS + [H.cycle_prompt(27, 12)]  # prompt bucket 16: lengths 11, 13, 10, 12
LONG = [H.cycle_prompt(5, 37), H.cycle_prompt(44, 20), H.cycle_prompt(30, 51)]  # prompt bucket 64
MAX_NEW = 40
BUDGET = 8


@pytest.fixture(scope="module")
def greedy_runs(targets):
    """family -> list of (prompts, autoregressive, tree) results, flawed copy drafter, two prompt buckets."""
    _, flawed = H.build_copy_pair(H.FLAW)
    out = {}
    for family, target in targets.items():
        out[family] = [(p, dj.generate_autoregressive(target, p, max_new_tokens=MAX_NEW),
                        dj.generate(target, flawed, p, max_new_tokens=MAX_NEW, tree_budget=BUDGET))
                       for p in (SHORT, LONG)]
    return dict(runs=out, drafter=flawed)


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_greedy_tree_equals_autoregressive(targets, greedy_runs, family):
    accepted = []
    for prompts, ar, sp in greedy_runs["runs"][family]:
        H.assert_same(targets[family], prompts, ar, sp, f"{family} tree")
        assert sp.tree_budget == BUDGET and sp.draft_length == H.PBS - 1
        accepted.append(sp.acceptance_lengths[sp.acceptance_lengths > 0])
    acc = np.concatenate(accepted)
    print(f"\n[{family} tree N={BUDGET}] tau {acc.mean():.2f}, steps by committed tokens "
          f"{np.bincount(acc, minlength=H.PBS + 1)[1:].tolist()}")
    assert acc.max() >= 3 and (acc == 1).any()  # deep paths and rejections at the root both happen


@pytest.mark.parametrize("family", ["qwen3", "hybrid"])
def test_greedy_shallow_tree_over_the_drafted_slots_equals_autoregressive(targets, greedy_runs, family):
    """A tree of 2 nodes (depth 2, shallower than the block) drafted over [last, 2 mask tokens] (draft_pass
    "drafted"): greedy output identical to autoregressive on both prompt buckets."""
    for prompts, ar, _ in greedy_runs["runs"][family]:
        sp = dj.generate(targets[family], greedy_runs["drafter"], prompts, max_new_tokens=MAX_NEW, tree_budget=2,
                         draft_pass="drafted")
        assert sp.draft_pass == "drafted" and sp.draft_length == 2 < H.PBS - 1
        H.assert_same(targets[family], prompts, ar, sp, f"{family} tree of 2, drafted slots")


def _accepted_draft(res):
    """(row, output index, token) of the first accepted draft (inside a path, not its bonus) whose token has not
    appeared before in its row, or None."""
    for b in range(res.tokens.shape[0]):
        row, pos = res.tokens[b].tolist(), 1  # output index 0 comes from prefill
        for a in res.acceptance_lengths[b][res.acceptance_lengths[b] > 0]:
            for k in range(pos, pos + int(a) - 1):  # this step's drafts; index pos + a - 1 is its bonus
                if 0 <= k < res.num_tokens[b] and row[k] not in row[:k]:
                    return b, k, row[k]
            pos += int(a)
    return None


@pytest.mark.parametrize("family", ["qwen3", "llama", "hybrid"])
def test_eos_inside_an_accepted_path(targets, greedy_runs, family):
    """An EOS id that first appears strictly inside an accepted path (not its bonus) of one row: that row stops
    there, every row equals the autoregressive run with the same EOS."""
    target = targets[family]
    prompts, ar, sp = greedy_runs["runs"][family][0]
    found = _accepted_draft(sp)
    assert found is not None, "no accepted draft to put an EOS on"
    b, k, eos = found
    ar_e = dj.generate_autoregressive(target, prompts, max_new_tokens=MAX_NEW, eos_ids=[eos])
    sp_e = dj.generate(target, greedy_runs["drafter"], prompts, max_new_tokens=MAX_NEW, eos_ids=[eos],
                       tree_budget=BUDGET)
    H.assert_same(target, prompts, ar_e, sp_e, f"{family} tree eos")
    assert sp_e.finish_reason[b] == "eos" and sp_e.num_tokens[b] == k + 1


@pytest.fixture(scope="module")
def copy_pair():
    target, perfect = H.build_copy_pair()
    return target, perfect, dj.generate_autoregressive(target, H.COPY_PROMPTS, max_new_tokens=H.COPY_MAX_NEW)


@pytest.mark.parametrize("budget", [4, 8, 20])
def test_perfect_drafter_accepts_the_whole_depth(copy_pair, budget):
    """The copy drafter is exact: every step accepts the tree's whole depth min(N, block_size - 1) and the bonus
    once (tau = depth + 1), and the output is autoregressive's."""
    target, perfect, ar = copy_pair
    depth = min(budget, H.PBS - 1)
    max_new = 1 + 2 * (depth + 1)  # the prefill token, then two whole steps
    res = dj.generate(target, perfect, H.COPY_PROMPTS, max_new_tokens=max_new, tree_budget=budget)
    np.testing.assert_array_equal(res.tokens, ar.tokens[:, :max_new])
    assert res.num_steps == 2 and (res.acceptance_lengths == depth + 1).all(), res.acceptance_lengths
    assert res.tau == depth + 1 and res.draft_length == depth
    assert (res.acceptance_lengths.sum(axis=1) + 1 == res.num_tokens).all()  # the bonus counted once per step


def test_mixed_batch_rows_equal_single_prompt_runs(targets, greedy_runs):
    prompts, _, batch = greedy_runs["runs"]["hybrid"][0]
    for b in (0, 3):
        alone = dj.generate(targets["hybrid"], greedy_runs["drafter"], [prompts[b]], max_new_tokens=MAX_NEW,
                            tree_budget=BUDGET)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])
        np.testing.assert_array_equal(alone.acceptance_lengths[0], batch.acceptance_lengths[b, :alone.num_steps])


# -- 4. the law at temperature > 0 -----------------------------------------------------------------------------------

SAMPLED_BUDGET = 6  # block 4: depth 3, so paths of every length and siblings at each depth
HYBRID_ROWS = 10_000


@pytest.fixture(scope="module")
def sampled():
    """test_sampling's two pairs (vocab 8, block 4), their exact laws' logits, and decode programs compiled for
    large batches (shared by the runs)."""
    models = ts.build_models()
    return models, {name: ts._enumerate(t, ts.PROMPT) for name, (t, _) in models.items()}, ts.large_batch_programs()


def _tree_run(target, drafter, programs, rows=ts.N, **kw):
    with ts.large_batch_execution(programs):
        return dj.generate(target, drafter, [ts.PROMPT] * rows, max_new_tokens=ts.NEW, tree_budget=SAMPLED_BUDGET,
                           seed=0, **kw)


SAMPLED = [("close", dict(temperature=1.0)), ("close", dict(temperature=0.6)), ("distant", dict(temperature=1.0)),
           ("close", dict(temperature=1.0, top_k=6, top_p=0.8)),
           # context lookup from single-token repeats: on a vocabulary of 8 most steps past the third token copy
           ("close", dict(temperature=1.0, context_lookup=1))]


@pytest.mark.parametrize("pair,kw", SAMPLED, ids=[ts._label(*c).replace(" ", ",") for c in SAMPLED])
def test_tree_output_has_the_target_distribution(sampled, pair, kw):
    models, logits, programs = sampled
    res = _tree_run(*models[pair], programs, **kw)
    assert (res.num_tokens == ts.NEW).all()
    law = ts.exact_law(logits[pair], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    hist = res.tau_histogram
    print(f"\n  tau={res.tau:.3f}, steps by committed tokens {hist[1:].tolist()}")
    stats.assert_matches(MODULE, f"tree {ts._label(pair, kw)}", ts.compare(res.tokens, law))
    assert hist[2:].sum() > 0.05 * hist.sum()  # accepted paths
    if "top_k" not in kw:  # (top-k / top-p leave the target so few tokens that depth 1 holds them all)
        assert hist[1] > 0  # rejections at the root
    if pair == "close":
        assert hist[-1] > 0.05 * hist.sum()  # whole-depth paths (the bonus after the deepest node)


def _one_uniform_per_row(logits, keys, sp, draft=False):
    """sample_tokens with one uniform per row shared by every node (so a path's draws are not independent)."""
    if sp.greedy or logits.ndim == 2:
        return sample_tokens(logits, keys, sp, draft)
    keys, u = _draw(keys, 1)
    return _categorical(jnp.broadcast_to(u, logits.shape[:2]), processed_probs(logits, sp)), keys


def test_control_one_uniform_for_every_node_fails(sampled, monkeypatch):
    models, logits, _ = sampled
    monkeypatch.setattr(decode_loop, "sample_tokens", _one_uniform_per_row)  # the name the loop program calls
    res = _tree_run(*models["close"], ts.large_batch_programs(), temperature=1.0)  # fresh programs: traced with it
    stats.assert_fails("tree, one uniform per row", ts.compare(res.tokens, ts.exact_law(logits["close"], 1.0)))


def test_hybrid_tree_output_has_the_target_distribution():
    """T = 1 on test_hybrid's sampled hybrid pair: DeltaNet states along the tree by parent, the accepted path's
    committed; every position and two joints match the exact law."""
    import test_hybrid
    _, target, drafter = test_hybrid._sampled_pair()
    logits = np.asarray(dj.target_forward(target, np.asarray(
        [ts.PROMPT + list(c) for c in itertools.product(range(ts.V), repeat=ts.L)], np.int32))[0])
    res = _tree_run(target, drafter, ts.large_batch_programs(), rows=HYBRID_ROWS, temperature=1.0)
    hist = res.tau_histogram
    print(f"\n  hybrid tree tau={res.tau:.3f}, steps by committed tokens {hist[1:].tolist()}")
    assert hist[1] > 0 and hist[2:].sum() > 0.05 * hist.sum()
    stats.assert_matches(MODULE, "hybrid tree T=1.0", ts.compare(res.tokens, ts.exact_law(logits, 1.0)))


def test_top_k_1_at_temperature_1_equals_greedy(targets, greedy_runs):
    prompts, ar, _ = greedy_runs["runs"]["qwen3"][0]
    res = dj.generate(targets["qwen3"], greedy_runs["drafter"], prompts, max_new_tokens=MAX_NEW, temperature=1.0,
                      top_k=1, seed=3, tree_budget=BUDGET)
    np.testing.assert_array_equal(res.tokens, ar.tokens)


def test_zz_false_alarm_budget():
    stats.assert_within_budget(MODULE)


# -- 5. bad input, programs, lowering --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    s = H.SETUPS[0]
    return make_target(s.target, 0), make_drafter(s.drafter, 100)


@pytest.mark.parametrize("budget", [0, -2, 2.5, True, "8"])
def test_bad_tree_budget(pair, no_work, budget):
    with pytest.raises(ValueError, match=r"tree_budget must be an integer >= 1"):
        dj.generate(*pair, [[1, 2]], max_new_tokens=4, tree_budget=budget)


def test_tree_budget_above_the_cache_bucket(pair, no_work):
    small = pair[0].replace(config=pair[0].config.replace(max_position_embeddings=40))  # caches of 64 slots
    with pytest.raises(ValueError, match=r"tree_budget 64: the verify of the root \+ 64 nodes needs 65 slots, more "
                                         r"than the cache bucket of this call holds \(64 slots\)"):
        dj.generate(small, pair[1], [[1, 2]], max_new_tokens=4, tree_budget=64)
    with pytest.raises(ValueError, match=r"more than the cache bucket"):
        dj.generate(*pair, [[1, 2]], max_new_tokens=4, tree_budget=5000)


def test_tree_budget_with_draft_length(pair, no_work):
    with pytest.raises(ValueError, match=r"tree_budget and draft_length are one choice"):
        dj.generate(*pair, [[1, 2]], max_new_tokens=4, tree_budget=4, draft_length=3)
    with pytest.raises(ValueError, match=r"one choice"):
        G.speculative_call(*pair, [[1, 2]], options=dj.GenerationOptions(max_new_tokens=4, tree_budget=4,
                                                                         draft_length=7))


def test_dflash2_drafter_refuses_a_tree(pair, no_work):
    d2 = H.as_dflash2(pair[1], 1)
    with pytest.raises(ValueError, match=r"DFlash2 drafter cannot draft a tree: its candidate selector drafts "
                                         r"sequentially"):
        dj.generate(pair[0], d2, [[1, 2]], max_new_tokens=4, tree_budget=4)


def test_a_block_too_short_for_any_depth(pair, no_work):
    """The depth of a tree is at most block_size - 1: a block of one slot (which configs refuse on their own) has
    no depth to give."""
    cfg = copy.copy(pair[1].config)
    object.__setattr__(cfg, "block_size", 1)
    with pytest.raises(ValueError, match=r"a draft tree needs depth >= 1, but the drafter's block of 1 proposes "
                                         r"block_size - 1 = 0 positions"):
        dj.generate(pair[0], pair[1].replace(config=cfg), [[1, 2]], max_new_tokens=4, tree_budget=4)


@pytest.mark.parametrize("kw,match", [(dict(p_min=0.3), r"p_min cuts a chain"),
                                      (dict(temperature=1.0, draft_sampling="greedy"), r"draft_sampling chooses")])
def test_chain_only_sampling_settings_are_refused(pair, no_work, kw, match):
    with pytest.raises(ValueError, match=match):
        dj.generate(*pair, [[1, 2]], max_new_tokens=4, tree_budget=4, **kw)


def test_autoregressive_takes_no_tree(pair, no_work):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tree_budget'"):
        dj.generate_autoregressive(pair[0], [[1, 2]], max_new_tokens=4, tree_budget=4)
    with pytest.raises(ValueError, match=r"tree_budget is a speculative setting"):
        dj.generate_autoregressive(pair[0], [[1, 2]], options=dj.GenerationOptions(max_new_tokens=4, tree_budget=4))


def test_one_loop_program_per_bucket_with_a_tree(pair, monkeypatch):
    """100 prompt lengths over 1..1000 give as many loop programs with a tree as with the chain (one: the cache and
    batch buckets do not move), and running two prompt buckets traces the tree loop once."""
    target, drafter = pair
    big = target.replace(config=target.config.replace(max_position_embeddings=4096))

    def loop_key(n, **kw):
        call = G.speculative_call(big, drafter, [[1] * int(n)], max_new_tokens=2, **kw)
        return (tuple(sorted(call.loop_static.items())), call.context, call.prefill_static["cache_len"],
                call.args[2].shape[0])

    lens = np.unique(np.linspace(1, 1000, 100).astype(int))
    chain, trees = {loop_key(n) for n in lens}, {loop_key(n, tree_budget=8) for n in lens}
    print(f"\n[programs] {len(lens)} prompt lengths: {len(chain)} chain loop key(s), {len(trees)} tree loop key(s)")
    assert len(trees) == len(chain) == 1
    monkeypatch.setattr(G, "_COMPILED", {})
    before = G.TRACE_COUNTS["speculative"]
    for n in (5, 40):  # prompt buckets 16 and 64: two prefill programs, one loop program
        dj.generate(big, drafter, [list(range(1, n + 1))], max_new_tokens=3, tree_budget=8)
    assert G.TRACE_COUNTS["speculative"] - before == G.compiled_counts()["speculative"] == 1


def test_tree_loop_is_one_while_without_host_sync(pair):
    call = G.speculative_call(*pair, H.prompt_batches(64, 0)[0], max_new_tokens=8, tree_budget=8)
    closed = jax.make_jaxpr(call.unjitted)(*call.args)
    top = [e.primitive.name for e in closed.jaxpr.eqns]
    assert top.count("while") == 1
    loop = closed.jaxpr.eqns[top.index("while")]
    inside = H.primitives(loop.params["body_jaxpr"].jaxpr) + H.primitives(loop.params["cond_jaxpr"].jaxpr)
    # the tree step is in there: its products and its top-k (XLA's, or the CPU kernel's calls in the CPU loops:
    # tests/test_device_lowering.py names them)
    assert {"dot_general", "ffi_call"} & set(inside) and {"top_k", "ffi_call"} & set(inside), sorted(set(inside))
    assert not H.host_ops(inside), H.host_ops(inside)


def test_tree_build_takes_the_top_k_without_sorting_the_vocabulary():
    """The construction's per-position top-K is XLA:CPU's TopK call, not a sort of the whole vocabulary (a 3-D
    `lax.top_k` inside the build became one: 138 ms per step at SmolLM2's 49,152 ids, against 0.4 ms)."""
    logp = jnp.zeros((1, 7, 4096), jnp.float32)
    text = jax.jit(T.build, static_argnums=2).lower(logp, jnp.zeros((1,), jnp.int32), 8).compile().as_text()
    assert '"TopK"' in text and " sort(" not in text


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_draft_top_is_the_top_k_of_the_draft_scores(temperature):
    """The loop's tree takes each position's best ids and log-probabilities from `draft_top` (the top k of the logits
    minus the row's log-sum-exp: the kernel's in the CPU loops) instead of a log-softmax of the whole row: the same
    ids as the top k of `draft_scores`, the same values to float rounding, -inf ids (a draft vocabulary) never among
    them, and in the CPU loops the kernel's log-sum-exp in the program."""
    from dflash_jax import execution
    from dflash_jax.quant import cpu_kernel
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 300)).astype(np.float32) * 3
    x[..., 200:] = -np.inf
    x = jnp.asarray(x)
    sp = SamplingParams.make(temperature=temperature)
    want_lp, want_id = T._top_k(T.draft_scores(x, sp), 6)
    runs = [jax.jit(lambda v: T.draft_top(v, sp, 6))(x)]
    if cpu_kernel.available():
        with execution.changed(cpu_kernel=True):
            top = jax.jit(lambda v: T.draft_top(v, sp, 6))
            assert cpu_kernel.LOGSUMEXP_TARGET in top.lower(x).as_text()
            runs.append(top(x))
    for lp, ids in runs:
        np.testing.assert_array_equal(ids, want_id)
        np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-5)
        assert (np.asarray(ids) < 200).all()


@pytest.mark.parametrize("family", ["dense", "hybrid"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_tree_step_lowers_for_cuda_without_data_dependent_loops(targets, family, sampling):
    """Exported for CUDA (accelerator execution settings): one data-dependent while (the generation loop), no
    conditional; the tree build and the attention block loops have static trip counts."""
    from dflash_jax.bench.lowering import loop_report, speculative_module
    _, flawed = H.build_copy_pair(H.FLAW)
    target = targets["hybrid" if family == "hybrid" else "qwen3"]
    kw = dict(temperature=0.8, top_k=5, top_p=0.9) if sampling == "sampled" else {}
    rep = loop_report(speculative_module(target, flawed, SHORT, chunk=8, max_new_tokens=16, tree_budget=8, **kw))
    assert rep["conditionals"] == 0 and rep["dynamic"] == 1 and rep["dynamic_at_top"] == 1, rep
    assert rep["static"] >= 2, rep  # the build's pops and attention's blocks are there, with static trip counts
