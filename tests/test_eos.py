"""EOS: greedy speculative decoding stops exactly where autoregressive decoding does (tokens, num_tokens,
finish_reason), wherever in a block the EOS falls.

Cases, on mixed-length batches (prompts of 10, 13 and 11 tokens) with the hand-built "copy" pair of
tests/test_generate.py (a perfect drafter, and a flawed one whose row 0 stops at step-dependent slots):
  * EOS as an accepted draft in the middle of a block, in one row while the others continue;
  * EOS as the correction token right after a rejection;
  * EOS as the bonus token after a fully accepted block;
  * EOS ids that occur only in the REJECTED part of a verified block (the target's argmax after a wrong draft): they
    must neither end the row nor be emitted (negative control: searching EOS over the whole block breaks this);
  * EOS beyond the token budget inside the last block (the row ends on length, EOS not emitted), and at the budget;
  * random target/drafter pairs with several EOS ids.
`generate_autoregressive(eos_ids=...)` is itself checked against the EOS-free decode (cut after the first EOS).
Sampled rows are tested statistically in tests/test_sampling.py (`test_sampled_eos_has_target_distribution`).
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from random_models import make_drafter, make_target
from helpers import COPY_MAX_NEW, COPY_PROMPTS, FLAW, PBS, SETUPS, build_copy_pair, cycle_next

gen = importlib.import_module("dflash_jax.decode.programs")
from dflash_jax.decode import loop
PAD = -1
PROMPTS = [COPY_PROMPTS[2], COPY_PROMPTS[1], COPY_PROMPTS[0] + [cycle_next(COPY_PROMPTS[0][-1])]]  # cycles 2, 5, 0


@pytest.fixture(scope="module")
def copy():
    target, perfect = build_copy_pair()
    _, flawed = build_copy_pair(FLAW)
    ar = dj.generate_autoregressive(target, PROMPTS, max_new_tokens=COPY_MAX_NEW)
    fl = dj.generate(target, flawed, PROMPTS, max_new_tokens=COPY_MAX_NEW)
    np.testing.assert_array_equal(fl.tokens, ar.tokens)
    return dict(target=target, perfect=perfect, flawed=flawed, ar=ar, flawed_sp=fl)


def cut_at_eos(tokens: np.ndarray, eos, max_new: int):
    """What decoding with `eos` must give, from an EOS-free decode: (tokens, num_tokens, finish_reason)."""
    out = np.full((tokens.shape[0], max_new), PAD)
    n, reasons = [], []
    for b, row in enumerate(tokens[:, :max_new]):
        hits = np.flatnonzero(np.isin(row, list(eos)))
        k = int(hits[0]) + 1 if hits.size else max_new
        out[b, :k] = row[:k]
        n.append(k)
        reasons.append("eos" if hits.size else "length")
    return out, np.array(n), tuple(reasons)


def assert_same_result(spec, ar, what=""):
    np.testing.assert_array_equal(spec.tokens, ar.tokens, err_msg=what)
    np.testing.assert_array_equal(spec.num_tokens, ar.num_tokens, err_msg=what)
    assert spec.finish_reason == ar.finish_reason, (what, spec.finish_reason, ar.finish_reason)


def run_both(target, drafter, prompts, eos, max_new=COPY_MAX_NEW, **kw):
    """Speculative and autoregressive runs with the same EOS ids; both must equal the EOS-free decode cut at EOS."""
    spec = dj.generate(target, drafter, prompts, max_new_tokens=max_new, eos_ids=eos, **kw)
    ar = dj.generate_autoregressive(target, prompts, max_new_tokens=max_new, eos_ids=eos)
    free = dj.generate_autoregressive(target, prompts, max_new_tokens=max_new)
    want, n, reasons = cut_at_eos(free.tokens, eos, max_new)
    np.testing.assert_array_equal(ar.tokens, want)  # generate_autoregressive(eos_ids=...) itself
    np.testing.assert_array_equal(ar.num_tokens, n)
    assert ar.finish_reason == reasons
    assert_same_result(spec, ar, f"eos={eos}")
    return spec, ar


def test_eos_as_an_accepted_draft_in_one_row_while_the_others_continue(copy):
    """Perfect drafter: the EOS is row 1's token 3, an accepted draft in the middle of its first block; it occurs in
    no other row's cycle, so rows 0 and 2 run to the budget."""
    ar = copy["ar"].tokens
    eos = (int(ar[1, 3]),)
    assert eos[0] not in ar[[0, 2]].ravel().tolist() and eos[0] not in ar[1, :3].tolist()
    spec, _ = run_both(copy["target"], copy["perfect"], PROMPTS, eos)
    np.testing.assert_array_equal(spec.num_tokens, [COPY_MAX_NEW, 4, COPY_MAX_NEW])
    assert spec.finish_reason == ("length", "eos", "length")
    assert spec.acceptance_lengths[1, 0] == PBS  # the EOS came inside a fully accepted block...
    assert (spec.acceptance_lengths[1, 1:] == 0).all()  # ...and the row stopped there
    assert (spec.acceptance_lengths[[0, 2]] > 0).sum() > 2  # while the others kept stepping


def test_eos_as_the_correction_token_after_a_rejection(copy):
    """Flawed drafter: row 2 (cycle 0) rejects a draft in every step; the EOS is the token sampled right after the
    first rejection."""
    fl = copy["flawed_sp"]
    a1 = int(fl.acceptance_lengths[2, 0])  # drafts kept + 1
    assert 1 < a1 < PBS, fl.acceptance_lengths[2]
    eos = (int(fl.tokens[2, a1]),)  # output 0 is the prefill token; step 1 wrote outputs 1..a1, the last a correction
    assert eos[0] not in fl.tokens[2, :a1].tolist() and eos[0] not in fl.tokens[:2].ravel().tolist()
    spec, _ = run_both(copy["target"], copy["flawed"], PROMPTS, eos)
    assert spec.finish_reason == ("length", "length", "eos") and spec.num_tokens[2] == a1 + 1
    assert spec.acceptance_lengths[2, 0] == a1 and (spec.acceptance_lengths[2, 1:] == 0).all()


def test_eos_as_the_bonus_token(copy):
    """Perfect drafter with 5 drafts per step: step 1 commits outputs 1..6, output 6 being the bonus token. EOS ids
    end rows 0 and 1 there; row 2 continues."""
    ar = copy["ar"].tokens
    eos = (int(ar[0, 6]), int(ar[1, 6]))
    for b in (0, 1):
        assert not set(eos) & set(ar[b, :6].tolist())
    assert not set(eos) & set(ar[2].tolist())
    spec, _ = run_both(copy["target"], copy["perfect"], PROMPTS, eos, draft_length=5)
    np.testing.assert_array_equal(spec.num_tokens, [7, 7, COPY_MAX_NEW])
    assert spec.finish_reason == ("eos", "eos", "length")
    np.testing.assert_array_equal(spec.acceptance_lengths[:, 0], [6, 6, 6])  # full blocks: 5 drafts + the bonus


# Drafts that copy token 1 / 5 of cycle 0 come out as 34 / 30 (FLAW); the target's argmax after such a wrong draft is
# 35 / 31: tokens of cycles 4 and 3, which no row's text contains. They occur in verified blocks only after the first
# rejected draft.
ONLY_REJECTED = (35, 31)


def test_eos_only_in_the_rejected_part_of_a_block_is_ignored(copy):
    free = copy["ar"].tokens
    assert not set(ONLY_REJECTED) & set(free.ravel().tolist())
    spec, _ = run_both(copy["target"], copy["flawed"], PROMPTS, ONLY_REJECTED)
    assert spec.finish_reason == ("length",) * 3
    np.testing.assert_array_equal(spec.tokens, copy["flawed_sp"].tokens)


def _eos_of(rest):
    """The EOS ids a `_commit` call receives (a static tuple, or an array padded with -1 in a Budget)."""
    first = rest[0]
    return jnp.asarray(first if isinstance(first, tuple) else first.eos, jnp.int32)


def test_control_eos_searched_in_the_whole_block_fails(copy, monkeypatch):
    """Negative control: an EOS search over the whole verified block (not the committed prefix) ends row 2 at a
    rejected argmax, and the comparison above catches it."""
    real = loop._commit

    def whole_block(state, new_tokens, n_new, *rest):
        eos = _eos_of(rest)
        if eos.size:
            is_eos = (new_tokens[:, :, None] == eos[None, None, :]).any(-1)  # no `j < n` mask
            n_new = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, n_new)
        return real(state, new_tokens, n_new, *rest)

    monkeypatch.setattr(gen, "_COMPILED", {})  # fresh programs: traced with the flawed commit
    monkeypatch.setattr(loop, "_commit", whole_block)
    spec = dj.generate(copy["target"], copy["flawed"], PROMPTS, max_new_tokens=COPY_MAX_NEW, eos_ids=ONLY_REJECTED)
    with pytest.raises(AssertionError):
        assert_same_result(spec, copy["ar"])
    assert spec.finish_reason[2] == "eos" and spec.tokens[2, spec.num_tokens[2] - 1] in ONLY_REJECTED


@pytest.mark.parametrize("max_new", [6, 7])
def test_eos_and_the_budget_in_the_same_block(copy, max_new):
    """EOS at output 6 of row 0, inside the first (full) block: with a budget of 6 tokens the block is cut before it
    (ends on length, EOS not emitted); with 7 the EOS is the last token allowed (ends on EOS)."""
    ar = copy["ar"].tokens
    eos = (int(ar[0, 6]),)
    spec, _ = run_both(copy["target"], copy["perfect"], PROMPTS, eos, max_new=max_new)
    assert spec.num_tokens[0] == max_new
    assert spec.finish_reason[0] == ("length" if max_new == 6 else "eos")
    assert (spec.num_tokens <= max_new).all()


@pytest.mark.parametrize("setup", SETUPS[:2], ids=lambda s: s.name)
def test_random_pairs_with_several_eos_ids(setup):
    """Random drafters (almost every step rejects at slot 1): EOS ids taken from the EOS-free text so that rows end
    at different steps, mixed prompt lengths."""
    rng = np.random.default_rng(11)
    for seed in range(2):
        target = make_target(setup.target, seed)
        drafter = make_drafter(setup.drafter, 50 + seed)
        prompts = [rng.integers(0, setup.target.vocab_size, n).tolist() for n in (3, 16, 9)]
        free = dj.generate_autoregressive(target, prompts, max_new_tokens=20).tokens
        eos = tuple(sorted({int(free[0, 5]), int(free[1, 12])}))
        spec, _ = run_both(target, drafter, prompts, eos, max_new=20, draft_length=setup.draft_length)
        assert "eos" in spec.finish_reason
