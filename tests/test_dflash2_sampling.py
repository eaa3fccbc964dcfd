"""Lossless sampling with a DFlash2 drafter: the selector's softmax over its k candidates is q.

Same method as test_sampling.py (whose helpers are reused): one `generate` call over N rows of one prompt at T = 1
with a vocab-8 target, block 4 (3 drafts per step), 6 new tokens; the empirical law of the output tokens is compared
with the exact target law from enumerating every continuation. The DFlash2 drafter keeps only the top 4 of 8 tokens
as candidates (so q is zero on half the vocabulary and the residual max(p - q, 0) matters), its drafts are sampled
slot by slot from softmax(scores / T), each conditioned on the previous sampled token. Negative control: verifying
those drafts with q = softmax(draft logits) (the DFlash rule, ignoring the selector) must fail the same check.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sampling import (CFG, DCFG, L, N, NEW, PROMPT, V, _close, _random_params, assert_fails, assert_matches,
                           compare, exact_law, large_batch_programs, large_batches)  # noqa: F401 (autouse)
from dflash_jax.models.drafter import Drafter
from dflash_jax.params import abstract_drafter, abstract_target, from_named, map_named, named_leaves
from dflash_jax.models.target import Target, target_forward

import itertools

gen = importlib.import_module("dflash_jax.decode.programs")
from dflash_jax.decode import loop as decode_loop
ds = importlib.import_module("dflash_jax.decode.draft_step")

DCFG2 = dataclasses.replace(DCFG, kind="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=4)


def _to_dflash2(drafter: Drafter, seed: int, codebook_scale: float) -> Drafter:
    rng = np.random.default_rng(seed)
    named = dict(named_leaves(drafter.params))
    for name, spec in named_leaves(abstract_drafter(DCFG2)).items():
        if name in named:
            continue
        if name.endswith("base_kernel"):
            w = 0.3 * rng.standard_normal(spec.shape) + (np.arange(spec.shape[1]) == 0)[None, :, None]
        elif name.endswith("_codebook"):
            w = codebook_scale * rng.standard_normal(spec.shape)
        else:  # kernel_projection, hidden_projection
            w = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[1])
        named[name] = jnp.asarray(w, jnp.float32)
    return Drafter(params=from_named(abstract_drafter(DCFG2), named), config=DCFG2)


@pytest.fixture(scope="module")
def models():
    target = Target(params=_random_params(abstract_target(CFG), 0, 0.6), config=CFG)
    drafter = Drafter(params=_random_params(abstract_drafter(DCFG), 1, 0.6), config=DCFG)
    close_target = _close(target, 0.05)
    close_drafter = _close(drafter, 0.05, norm=close_target.params.norm)
    return {"rejecting": (target, _to_dflash2(drafter, 2, 1.0)),
            "close": (close_target, _to_dflash2(close_drafter, 3, 0.3))}


@pytest.fixture(scope="module")
def enumeration(models):
    combos = np.array(list(itertools.product(range(V), repeat=L)), np.int32)
    tokens = np.concatenate([np.tile(np.asarray(PROMPT, np.int32), (len(combos), 1)), combos], axis=1)
    return {name: np.asarray(target_forward(t, tokens)[0]) for name, (t, _) in models.items()}


_RUNS: dict = {}


def _generate(models, pair, **kw):
    key = (pair, tuple(sorted(kw.items())))
    if key not in _RUNS:
        target, drafter = models[pair]
        _RUNS[key] = gen.generate(target, drafter, [PROMPT] * N, max_new_tokens=NEW, draft_length=3,
                                  **{"temperature": 1.0, "seed": 0, **kw})
    return _RUNS[key]


@pytest.mark.parametrize("pair", ["rejecting", "close"])
def test_dflash2_speculative_output_has_target_distribution(models, enumeration, pair):
    res = _generate(models, pair)
    assert (res.num_tokens == NEW).all()
    label = f"DFlash2 speculative T=1 {pair}"
    rows = compare(res.tokens, exact_law(enumeration[pair]))
    hist = res.tau_histogram
    print(f"  tau={res.tau:.3f} steps stopping at slot 1: {hist[1] / hist.sum():.2f}, full: {hist[-1] / hist.sum():.2f}")
    assert_matches(label, rows)
    if pair == "rejecting":
        assert hist[1] / hist.sum() > 0.3 and hist[-1] > 0  # the residual path is common, full blocks occur
    else:
        assert hist[-1] / hist.sum() > 0.2  # the bonus-after-a-full-block path is common


def test_dflash2_top_k_top_p_output_has_target_distribution(models, enumeration):
    """The target's top-k / top-p do not apply to the selector's q (z-lab): drafts outside the target's allowed set
    are proposed and must always be rejected."""
    res = _generate(models, "rejecting", top_k=5, top_p=0.9)
    law = exact_law(enumeration["rejecting"], top_k=5, top_p=0.9)
    for t in range(L + 1):
        assert law[f"pos{t}"][res.tokens[:, t]].min() > 0
    assert_matches("DFlash2 speculative T=1 top_k=5 top_p=0.9", compare(res.tokens, law))


def test_dflash2_negative_control_q_from_logits_fails(models, enumeration, monkeypatch):
    """Verifying selector drafts with the logits' softmax as q (what a DFlash-only verifier would do) is biased."""
    real = ds.draft_step

    def q_from_logits(*args, **kwargs):
        drafts, logits, _, keys = real(*args, **kwargs)
        return drafts, logits, None, keys

    # A fresh jitted program (its own, empty compile cache) traced with the wrong q; monkeypatch puts the real
    # program, and its compiled executables, back afterwards.
    monkeypatch.setattr(gen, "_COMPILED", large_batch_programs())
    monkeypatch.setattr(decode_loop, "draft_step", q_from_logits)  # the name the compiled program calls
    target, drafter = models["rejecting"]
    res = gen.generate(target, drafter, [PROMPT] * N, max_new_tokens=NEW, draft_length=3, temperature=1.0, seed=0)
    assert_fails("DFlash2 q = softmax(logits)", compare(res.tokens, exact_law(enumeration["rejecting"])))


def test_greedy_draft_sampling_point_mass_with_selector(models, enumeration):
    """draft_sampling="greedy" at T = 1: the greedy selector walk verified as a point mass is lossless too."""
    res = _generate(models, "close", draft_sampling="greedy")
    assert_matches("DFlash2 greedy-walk drafts T=1", compare(res.tokens, exact_law(enumeration["close"])))
