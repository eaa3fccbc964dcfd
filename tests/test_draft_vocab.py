"""A draft vocabulary (`DrafterConfig.draft_vocab_size`): the drafter drafts over the first n token ids only.

What must hold: the draft logits over ids < n are the full head's, ids >= n are impossible (-inf, so q = 0 there at
any temperature); greedy output stays identical to autoregressive; acceptance falls exactly where the right draft
lies outside the prefix; the one matmul computes the prefix of an NVFP4 head with its own scales; the setting
round-trips through every drafter format and bad sizes are refused by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from helpers import COPY_MAX_NEW, COPY_PROMPTS, PDCFG, assert_same, build_copy_pair, context_and_block
from dflash_jax.bench import tree as bench_tree
from dflash_jax.decode import draft_step as draft_step_mod
from dflash_jax.decode.draft_step import draft_step
from dflash_jax.decode.prefill import prefill
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.io.gguf_drafter import load_drafter_gguf, save_gguf
from dflash_jax.io.zlab_config import drafter_config_from_hf, drafter_config_to_hf
from dflash_jax.models.drafter import cached_context, draft_block, head_logits
from dflash_jax.quant.linear import linear
from dflash_jax.quant.nvfp4 import quantize

N = 24  # copy pair: cycles 0..2 (ids 0..23) draftable, cycles 3..5 not


def _with_vocab(drafter, n):
    return drafter.replace(config=drafter.config.replace(draft_vocab_size=n))


@pytest.fixture(scope="module")
def copy_pair():
    return build_copy_pair()


def test_logits_are_the_full_heads_prefix_and_impossible_beyond(copy_pair):
    target, drafter = copy_pair
    feats, block = context_and_block(target, drafter.config, batch=3, length=20)
    full = np.asarray(dj.draft_logits(target, drafter, feats, block))
    cut = np.asarray(dj.draft_logits(target, _with_vocab(drafter, N), feats, block))
    assert cut.shape == full.shape  # [B, bs-1, V]: the rest of the loop is unchanged
    np.testing.assert_allclose(cut[..., :N], full[..., :N], rtol=1e-6, atol=1e-6)
    assert np.all(cut[..., N:] == -np.inf)
    drafts = np.asarray(dj.draft_tokens(target, _with_vocab(drafter, N), feats, block))
    assert drafts.max() < N


def test_greedy_identical_and_acceptance_lost_only_outside_the_prefix(copy_pair):
    """The copy drafter is perfect: with ids < 24 draftable, rows 0 (cycle 0) and 2 (cycle 2) keep their whole
    blocks, and row 1 (cycle 5, ids 40..47) can never draft its next token: every step there accepts nothing."""
    target, drafter = copy_pair
    ar = dj.generate_autoregressive(target, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    full = dj.generate(target, drafter, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    cut = dj.generate(target, _with_vocab(drafter, N), COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    assert_same(target, COPY_PROMPTS, ar, cut, "draft vocab 24")
    tau_full, tau_cut = full.tau_per_row, cut.tau_per_row
    np.testing.assert_array_equal(tau_cut[[0, 2]], tau_full[[0, 2]])
    assert tau_full[1] > 4 and tau_cut[1] == 1.0, (tau_full, tau_cut)


def test_sampled_drafts_and_their_q_stay_inside_the_prefix(copy_pair):
    """At T > 0 the drafts are drawn from, and verified against, the same padded logits: q is 0 at ids >= n."""
    target, drafter = copy_pair
    d = _with_vocab(drafter, N)
    feats, block = context_and_block(target, d.config, batch=4, length=20, seed=3)
    cache = cached_context(d, jnp.asarray(feats))
    sp = SamplingParams.make(temperature=1.5)
    keys = jnp.zeros((4, 2), jnp.uint32).at[:, 0].set(jnp.arange(4, dtype=jnp.uint32))
    step = jax.jit(draft_step, static_argnums=(4,))  # one program rather than op-by-op dispatch
    drafts, logits, _, _ = step(d, target, jnp.asarray(block), cache, 7, keys, sp)
    assert int(drafts.max()) < N
    q = jax.nn.softmax(logits / 1.5, axis=-1)
    assert float(q[..., N:].max()) == 0.0 and np.allclose(np.asarray(q.sum(-1)), 1.0, atol=1e-5)


@pytest.mark.parametrize("n", [16, 33])
def test_linear_out_rows_of_an_nvfp4_weight_is_the_prefix_with_its_scales(n):
    w = jax.random.normal(jax.random.key(0), (48, 64), jnp.float32) * jnp.linspace(0.1, 3.0, 48)[:, None]
    q = quantize(w)
    x = jax.random.normal(jax.random.key(1), (5, 64), jnp.float32)
    lin = jax.jit(linear, static_argnames="out_rows")
    full = np.asarray(lin(x, q))
    # XLA:CPU's dot sums a 33-row and a 48-row product in different orders on an AVX2 CPU (1.8e-6 apart at |y| ~0.5):
    # a float32 tolerance, far below what a dropped scale changes (checked below)
    np.testing.assert_allclose(np.asarray(lin(x, q, out_rows=n)), full[:, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lin(x, w, out_rows=n)), np.asarray(lin(x, w))[:, :n], rtol=1e-5, atol=1e-5)
    # the prefix keeps the tensor scale: dropping it would change the result (the bug this project exists for)
    broken = np.asarray(lin(x, q.replace(global_scale=jnp.float32(1.0)), out_rows=n))
    assert not np.allclose(broken, full[:, :n], rtol=1e-2)
    with pytest.raises(ValueError, match="out_rows 49 outside 1..48"):
        linear(x, q, out_rows=49)


def test_config_validation_and_canonical_form():
    V = PDCFG.model.vocab_size
    assert PDCFG.replace(draft_vocab_size=V).draft_vocab_size is None  # the whole vocabulary
    assert PDCFG.replace(draft_vocab_size=N).drafted_vocab == N
    for bad in (0, -3, V + 1, 2.5, True):
        with pytest.raises(ValueError, match="draft_vocab_size must be an integer"):
            PDCFG.replace(draft_vocab_size=bad)
    d2 = dataclasses.replace(PDCFG, kind="dflash2", selector_top_k=16)
    with pytest.raises(ValueError, match="selector_top_k 16 is larger than the draft vocabulary \\(8\\)"):
        d2.replace(draft_vocab_size=8)


def test_round_trips_through_hf_orbax_and_gguf(copy_pair, tmp_path):
    target, drafter = copy_pair
    d = _with_vocab(drafter, N)
    assert drafter_config_from_hf(drafter_config_to_hf(d.config)).draft_vocab_size == N
    dj.save_hf(tmp_path / "hf", d)
    assert dj.load_drafter(tmp_path / "hf").config.draft_vocab_size == N
    dj.save(tmp_path / "orbax", d)
    assert dj.load_drafter(tmp_path / "orbax").config.draft_vocab_size == N
    save_gguf(tmp_path / "d.gguf", d)
    assert load_drafter_gguf(tmp_path / "d.gguf").config.draft_vocab_size == N
    # a drafter without one keeps drafting over everything after a round trip
    dj.save_hf(tmp_path / "hf_full", drafter)
    assert dj.load_drafter(tmp_path / "hf_full").config.draft_vocab_size is None


def test_the_step_tables_tree_draft_ranks_the_draft_vocabulary_alone(copy_pair, monkeypatch):
    """The step table times a tree's draft as the loop's tree step runs it (both call `decode.draft_step.draft_tree`):
    the tree is built from the draft vocabulary's n logits, not from them padded to the whole vocabulary (whose
    log-softmax and top-k cost SmolLM2's tree step ~0.5 ms the loop never pays: c overstated by ~0.04 per decode
    step). Control: the padded logits do put V-wide rows in the program."""
    target, drafter = copy_pair
    drafter = _with_vocab(drafter, N)
    V, depth, budget = drafter.config.model.vocab_size, 3, 4
    prompt = jnp.asarray(np.arange(12)[None] % N, jnp.int32)
    _, feats, _, dcache = prefill(target, prompt, jnp.array([12], jnp.int32), 32, drafter=drafter)
    args = (drafter, target, dcache, feats[:, -(depth + 1):], draft_block(drafter, prompt[:, -1], depth), depth, budget)

    def widths():  # the last axis of every value the program makes, nested programs included
        def walk(jaxpr):
            for eq in jaxpr.eqns:
                yield from (v.aval.shape[-1] for v in eq.outvars if getattr(v.aval, "shape", ()))
                for sub in jax.extend.core.jaxprs_in_params(eq.params):
                    yield from walk(sub)
        fresh = lambda *a: bench_tree._draft_tree(*a, depth, budget)  # a new function: no cached trace
        return set(walk(jax.make_jaxpr(fresh)(*args[:5]).jaxpr))

    assert V not in widths() and N in widths()
    monkeypatch.setattr(draft_step_mod, "head_logits", lambda *a, **k: head_logits(*a, **{**k, "padded": True}))
    assert V in widths()  # the control: padded logits are seen
