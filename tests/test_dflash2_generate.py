"""End-to-end greedy generation with DFlash2 drafters: `generate` == `generate_autoregressive` token for token.

Three kinds of DFlash2 drafter, all with a non-trivial convolution and selector:
  * random drafters on random targets (sliding-window layers shorter than the context; acceptance ~0);
  * the hand-built "copy" pair of test_generate.py turned into DFlash2 (random conv taps around the identity, a
    random selector whose pair term is small next to the copy's logit margin): whole blocks accepted;
  * its flawed variant: partial acceptance that differs per row, with step-by-step acceptance lengths checked
    against a cache-free reference loop built on `draft_tokens` (the selector walk) and `target_forward`.
Plus: one compiled program with the selector walk inside the single while loop and no host sync.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import jax
import numpy as np
import pytest

import dflash_jax as dj
from random_models import make_target, nontrivial_dflash2, random_params
from helpers import (COPY_MAX_NEW, as_dflash2, COPY_PROMPTS, FLAW, PBS, assert_same, build_copy_pair, host_ops, pad_to,
                     primitives, prompt_batches, reference_acceptance, tiny_qwen3)
from dflash_jax.config import DrafterConfig
from dflash_jax.models.drafter import draft_tokens
from dflash_jax.params import abstract_drafter
import report  # tests/report.py

G = importlib.import_module("dflash_jax.decode.programs")
MAX_NEW = 20
STATS: dict = report.section("dflash2 generation")  # printed at the end of the run (tests/report.py)


C1 = tiny_qwen3(tie_word_embeddings=True)
C2 = tiny_qwen3(vocab_size=96, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16)
SETUPS = {
    # non-causal sliding layers with a 6-token window (prompts up to 16 tokens + 20 new: the window really cuts)
    "bs8-D7-window6": (C1, DrafterConfig(C1.replace(num_hidden_layers=2), 8, 63, (1, 2), 4, kind="dflash2",
                                         layer_types=("sliding_attention",) * 2, sliding_window=6, is_causal=False,
                                         conv_group_size=8, selector_rank=8, selector_top_k=6,
                                         output_multiplier=0.8, final_logit_softcapping=4.0), None),
    # z-lab default causality for a sliding layer + a full layer; Kc 3; draft length 3 of block 6
    "bs6-D3-causal-sliding": (C2, DrafterConfig(C2.replace(num_hidden_layers=2), 6, 95, (0, 2), 3, kind="dflash2",
                                                layer_types=("sliding_attention", "full_attention"), sliding_window=9,
                                                conv_kernel_size=3, conv_group_size=16, selector_rank=4,
                                                selector_top_k=3, input_embedding_scale=1.3), 3),
}


def _nontrivial(params, seed, **scales):
    return nontrivial_dflash2(params, seed, **scales)


def make_dflash2(cfg: DrafterConfig, seed: int) -> dj.Drafter:
    return dj.Drafter(params=_nontrivial(random_params(abstract_drafter(cfg), seed), seed + 50), config=cfg)


@pytest.fixture(scope="module")
def random_runs():
    out = {}
    for name, (tcfg, dcfg, D) in SETUPS.items():
        runs = []
        for seed in range(2):
            target = make_target(tcfg, seed)
            drafter = make_dflash2(dcfg, 100 + seed)
            for prompts in prompt_batches(tcfg.vocab_size, seed, n_batches=2):
                ar = dj.generate_autoregressive(target, prompts, max_new_tokens=MAX_NEW)
                sp = dj.generate(target, drafter, prompts, max_new_tokens=MAX_NEW, draft_length=D)
                runs.append((target, drafter, prompts, ar, sp))
        out[name] = runs
    return out


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_equals_autoregressive_random_dflash2(random_runs, setup):
    dcfg, D = SETUPS[setup][1], SETUPS[setup][2]
    D = dcfg.block_size - 1 if D is None else D
    for target, _, prompts, ar, sp in random_runs[setup]:
        assert_same(target, prompts, ar, sp, setup)
        assert sp.draft_length == D and (ar.num_tokens == MAX_NEW).all()
    STATS[setup] = float(np.mean([r[-1].tau for r in random_runs[setup]]))
    assert STATS[setup] < 1.3


def test_selector_is_active_in_random_runs(random_runs):
    """The random drafters' selector really reranks: the greedy walk differs from the argmax of the logits."""
    target, drafter, prompts, _, _ = random_runs["bs8-D7-window6"][0]
    feats = dj.target_forward(target, pad_to(prompts[1], 16), drafter.config.target_layer_ids)[1]
    block = np.full((1, 8), 63, np.int32)
    block[0, 0] = prompts[1][-1]
    tok = np.asarray(draft_tokens(target, drafter, feats[:, :15], block))
    arg = np.asarray(dj.draft_logits(target, drafter, feats[:, :15], block)).argmax(-1)
    assert (tok != arg).any()


@pytest.fixture(scope="module")
def copy_runs():
    target, perfect = build_copy_pair()
    _, flawed = build_copy_pair(FLAW)
    # conv taps 0.05 around the identity and a weak selector: the copy mechanism still dominates
    kw = dict(codebook_scale=0.3, tap_scale=0.05, proj_scale=0.05)
    perfect2, flawed2 = as_dflash2(perfect, 1, **kw), as_dflash2(flawed, 1, **kw)
    ar = dj.generate_autoregressive(target, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    sp = dj.generate(target, perfect2, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    fl = dj.generate(target, flawed2, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    return dict(target=target, perfect=perfect2, flawed=flawed2, ar=ar, sp=sp, flawed_sp=fl)


def test_perfect_dflash2_accepts_whole_blocks(copy_runs):
    r = copy_runs
    assert_same(r["target"], COPY_PROMPTS, r["ar"], r["sp"], "perfect dflash2")
    steps = math.ceil((COPY_MAX_NEW - 1) / PBS)
    assert (r["sp"].acceptance_lengths == PBS).all() and r["sp"].acceptance_lengths.shape == (3, steps)


def test_flawed_dflash2_partial_acceptance_and_reference_loop(copy_runs):
    r = copy_runs
    assert_same(r["target"], COPY_PROMPTS, r["ar"], r["flawed_sp"], "flawed dflash2")
    acc = r["flawed_sp"].acceptance_lengths
    row0 = acc[0][acc[0] > 0]
    assert ((row0 > 1) & (row0 < PBS)).all() and len(set(row0.tolist())) > 1, row0
    assert (acc[1][acc[1] > 0] == PBS).all()
    ref_acc, ref_out = reference_acceptance(r["target"], r["flawed"], COPY_PROMPTS[0], max_new=COPY_MAX_NEW,
                                            max_steps=4, propose=draft_tokens)
    assert acc[0, :len(ref_acc)].tolist() == ref_acc
    np.testing.assert_array_equal(r["flawed_sp"].tokens[0, :len(ref_out)], ref_out)
    STATS["flawed-row0"] = row0.tolist()


def test_dflash2_program_is_one_while_loop_with_the_walk_inside(copy_runs):
    r = copy_runs
    call = G.speculative_call(r["target"], r["flawed"], COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW,
                              draft_length=PBS - 1, temperature=1.0)
    closed = jax.make_jaxpr(call.unjitted)(*call.args)
    top = [e.primitive.name for e in closed.jaxpr.eqns]
    assert top.count("while") == 1
    loop = closed.jaxpr.eqns[top.index("while")]
    inside = primitives(loop.params["body_jaxpr"].jaxpr) + primitives(loop.params["cond_jaxpr"].jaxpr)
    assert "scan" in inside  # the selector walk (the attention chunk loop is a while, so that would not tell)
    assert "top_k" in inside
    assert not host_ops(inside), host_ops(inside)


def test_sampled_dflash2_runs_and_is_reproducible(copy_runs):
    r = copy_runs
    kw = dict(max_new_tokens=COPY_MAX_NEW, temperature=1.0)
    a = dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=0, **kw)
    b = dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=0, **kw)
    c = dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=1, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert a.tau > 1.5  # the copy target is near-deterministic at T=1: sampled proposals are still accepted


def test_dflash_and_dflash2_copy_drafters_give_the_same_text(copy_runs):
    """The DFlash and DFlash2 copy drafters give identical greedy text (both exact)."""
    r = copy_runs
    target, flawed = build_copy_pair(FLAW)
    res = dj.generate(target, flawed, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    np.testing.assert_array_equal(res.tokens, r["flawed_sp"].tokens)
