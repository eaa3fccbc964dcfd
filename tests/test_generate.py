"""End-to-end speculative generation (z-lab dflash/model.py `dflash_generate`'s decode loop).

Greedy `generate` must equal `generate_autoregressive` token for token (float32 on CPU). Three kinds of drafter:
  * random drafters on random targets (acceptance ~0: every step is the bonus token only);
  * a hand-built "copy" pair whose drafter is exact by construction (whole blocks accepted, bonus after a full
    block), and a deliberately flawed copy of it (partial acceptance that differs per row);
  * a tiny drafter trained inside the test on the target's own outputs (tau > 1.2), whose per-step acceptance
    lengths are checked against a cache-free reference loop built on `draft_logits` and `target_forward`.

Compile cost dominates on CPU, so tests share static shapes (batch 3, prompts <= 16 tokens -> one padded bucket,
max_new_tokens 20 or 24) and module-scoped fixtures; params are runtime arguments, so seeds never recompile.
"""

from __future__ import annotations

import functools
import importlib
import math
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from random_models import make_drafter, make_target
from helpers import (COPY_MAX_NEW, COPY_PROMPTS, FLAW, PBS, PMASK, PV, SETUPS, assert_same, build_copy_pair, cycle_next,
                     cycle_prompt, host_ops, no_work, pad_to, primitives, prompt_batches, reference_acceptance)
import report  # tests/report.py

G = importlib.import_module("dflash_jax.decode.programs")  # the package re-exports the function under the same name
from dflash_jax.decode import prefill
PAD = -1
STATS: dict[str, object] = report.section("generate")  # figures printed at the end of the run (tests/report.py)


C1 = SETUPS[0]
MAX_NEW = 20


@pytest.fixture(scope="module")
def copy_runs():
    target, perfect = build_copy_pair()
    _, flawed = build_copy_pair(FLAW)
    ar = dj.generate_autoregressive(target, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    for row in ar.token_lists():  # the construction works: greedy is the cycle map
        assert all(cycle_next(a) == b for a, b in zip(row, row[1:]))
    sp = dj.generate(target, perfect, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)
    fl = dj.generate(target, flawed, COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW)  # same static shapes: no compile
    return dict(target=target, perfect=perfect, flawed=flawed, ar=ar, sp=sp, flawed_sp=fl)


# -- 1. exactness ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_runs():
    """setup name -> list of (target, prompts, ar, sp) over 3 seeds x 3 prompt batches."""
    out = {}
    for s in SETUPS:
        runs = []
        for seed in range(3):
            target = make_target(s.target, seed)
            drafter = make_drafter(s.drafter, 100 + seed)
            for prompts in prompt_batches(s.target.vocab_size, seed):
                ar = dj.generate_autoregressive(target, prompts, max_new_tokens=MAX_NEW)
                sp = dj.generate(target, drafter, prompts, max_new_tokens=MAX_NEW, draft_length=s.draft_length)
                runs.append((target, prompts, ar, sp))
        out[s.name] = runs
    return out


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_greedy_equals_autoregressive_random_drafter(random_runs, setup):
    runs = random_runs[setup.name]
    D = setup.drafter.block_size - 1 if setup.draft_length is None else setup.draft_length
    for target, prompts, ar, sp in runs:
        assert_same(target, prompts, ar, sp, setup.name)
        assert sp.draft_length == D and sp.acceptance_lengths.max() <= D + 1
        assert (ar.num_tokens == MAX_NEW).all()
    taus = [sp.tau for *_, sp in runs]
    distinct = len({t for *_, ar, _ in runs for t in ar.tokens.ravel().tolist()})
    tokens = int(sum(ar.num_tokens.sum() for *_, ar, _ in runs))
    STATS[f"exact/{setup.name}"] = dict(models=3, prompts=3 * len(runs), tokens=tokens, tau=float(np.mean(taus)),
                                         distinct_tokens=distinct)
    assert np.mean(taus) < 1.3, "a random drafter should accept almost nothing"
    assert distinct > setup.target.vocab_size // 3, "greedy text too repetitive to be a meaningful comparison"


def test_autoregressive_oracle_equals_cache_free_greedy(random_runs):
    """The oracle itself: generate_autoregressive (KV cache, one token per step) == argmax of a fresh cache-free
    target_forward over the whole sequence at every step (one batch of the untied GQA 4:1 setup)."""
    target, prompts, ar, _ = random_runs[SETUPS[2].name][0]
    width = 16 + MAX_NEW  # right padding never changes earlier positions of a causal model: one compile
    for b, p in enumerate(prompts):
        seq = list(p)
        for _ in range(MAX_NEW):
            logits, _ = dj.target_forward(target, pad_to(seq, width))
            seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
        assert seq[len(p):] == ar.tokens[b].tolist(), f"row {b}"


def test_greedy_equals_autoregressive_perfect_drafter(copy_runs):
    r = copy_runs
    assert_same(r["target"], COPY_PROMPTS, r["ar"], r["sp"], "perfect")
    acc = r["sp"].acceptance_lengths
    # every step accepts the whole block (7 drafts + bonus) until the budget
    steps = math.ceil((COPY_MAX_NEW - 1) / PBS)
    assert acc.shape == (3, steps) and (acc == PBS).all(), acc
    assert r["sp"].tau == PBS
    np.testing.assert_array_equal(r["sp"].position_acceptance, np.ones(PBS - 1))
    STATS["exact/perfect"] = dict(prompts=3, tokens=int(r["sp"].num_tokens.sum()), tau=r["sp"].tau)


def test_greedy_equals_autoregressive_flawed_drafter_partial_acceptance(copy_runs):
    r = copy_runs
    assert_same(r["target"], COPY_PROMPTS, r["ar"], r["flawed_sp"], "flawed")
    acc = r["flawed_sp"].acceptance_lengths
    row0 = acc[0][acc[0] > 0]
    assert ((row0 > 1) & (row0 < PBS)).all() and len(set(row0.tolist())) > 1, f"row 0 acceptance {row0}"
    assert (acc[1][acc[1] > 0] == PBS).all() and (acc[2][acc[2] > 0] == PBS).all()  # other rows unaffected
    assert acc[0][acc[0] > 0].size > acc[1][acc[1] > 0].size  # rows finish after different numbers of steps
    STATS["exact/flawed"] = dict(prompts=3, acceptance_row0=row0.tolist())


@pytest.mark.parametrize("max_new", [1, 2, PBS - 1, PBS, PBS + 1])
def test_max_new_tokens_block_boundaries(copy_runs, max_new):
    """Whole blocks are accepted from the first step on, so budgets around one block exercise the cut inside an
    accepted block (7 = bs-1: bonus and one draft dropped; 8 = bs: bonus dropped; 9 = bs+1: exactly one block)."""
    r = copy_runs
    res = dj.generate(r["target"], r["perfect"], COPY_PROMPTS, max_new_tokens=max_new)
    want = r["ar"].tokens[:, :max_new]  # greedy decoding of k tokens = the first k of a longer greedy decode
    np.testing.assert_array_equal(res.tokens, want)
    assert res.tokens.shape == (3, max_new)
    assert (res.num_tokens == max_new).all() and res.finish_reason == ("length",) * 3
    steps = math.ceil((max_new - 1) / PBS)
    assert res.num_steps == steps and res.acceptance_lengths.shape == (3, steps)
    assert (res.acceptance_lengths == PBS).all()


def test_eos_inside_accepted_block_and_mask_id_as_eos(copy_runs):
    """EOS ids: a token that first appears at slot 3 of row 0's first accepted block, the mask id (a real token of
    row 1's cycle, at slot 2, and present in every draft block as the filler), and row 2's very first token."""
    r = copy_runs
    ar = r["ar"].tokens
    e0 = int(ar[0, 3])
    assert e0 not in ar[0, :3].tolist() and r["sp"].acceptance_lengths[0, 0] == PBS  # index 3 is mid-block
    assert int(ar[1, 2]) == PMASK and PMASK not in ar[1, :2].tolist()
    e2 = int(ar[2, 0])
    eos = (e0, PMASK, e2)
    res = dj.generate(r["target"], r["perfect"], COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW, eos_ids=eos)
    for b, stop in enumerate([3, 2, 0]):
        want = np.full(COPY_MAX_NEW, PAD)
        want[:stop + 1] = ar[b, :stop + 1]
        np.testing.assert_array_equal(res.tokens[b], want)  # EOS emitted, nothing after it, -1 padding
    np.testing.assert_array_equal(res.num_tokens, [4, 3, 1])
    assert res.finish_reason == ("eos", "eos", "eos")
    # row 2 ended in prefill: no step is recorded for it; rows 0 and 1 ended inside the first block
    assert res.num_steps == 1
    np.testing.assert_array_equal(res.acceptance_lengths[:, 0], [PBS, PBS, 0])
    STATS["eos"] = dict(eos_ids=eos, num_tokens=res.num_tokens.tolist())


def test_mixed_batch_rows_equal_single_prompt_runs(copy_runs):
    """Rows with different acceptance (flawed drafter: row 0 partial, rows 1-2 full) equal each prompt alone."""
    r = copy_runs
    batch = r["flawed_sp"]
    for b, p in enumerate(COPY_PROMPTS):
        alone = dj.generate(r["target"], r["flawed"], [p], max_new_tokens=COPY_MAX_NEW)
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])
        assert alone.num_tokens[0] == batch.num_tokens[b] and alone.finish_reason[0] == batch.finish_reason[b]
        acc = batch.acceptance_lengths[b]
        np.testing.assert_array_equal(alone.acceptance_lengths[0], acc[:alone.num_steps])
        assert (acc[alone.num_steps:] == 0).all()


# -- 2. a trained drafter and the cache-free reference loop ----------------------------------------------------------

TRAIN_PROMPT_LEN = 8


@pytest.fixture(scope="module")
def trained():
    from dflash_jax.train import drafter_data as tdd, drafter_loss as tdl
    from dflash_jax.train.loop import OptimConfig, run

    target = make_target(C1.target, 0, std=0.15)  # std 0.15: tau ~1.6 with steps of every length (0.02: all 8s)
    rng = np.random.default_rng(0)
    lens = [TRAIN_PROMPT_LEN] * 6 + rng.integers(3, 11, 58).tolist()
    prompts = [rng.integers(0, 63, n).tolist() for n in lens]
    data = tdd.make_sequences(target, prompts, max_new_tokens=40, seq_len=48, batch=64)
    p0 = make_drafter(C1.drafter, 1, std=0.02).params
    with tempfile.TemporaryDirectory() as ckpt:
        params, hist = run(params=p0, loss_fn=tdl.drafter_loss(C1.drafter, C1.target),
                           batch_fn=tdd.make_batch_fn(data, target.params, batch=8, num_anchors=8, seed=0),
                           optim=OptimConfig(steps=300, lr=3e-3), ckpt_dir=ckpt, ckpt_every=10 ** 9,
                           desc="test-drafter")
    drafter = dj.Drafter(params=params, config=C1.drafter)
    runs = []
    for batch in (prompts[0:3], prompts[3:6]):  # same shapes as the random-model runs of C1: no new compile
        ar = dj.generate_autoregressive(target, batch, max_new_tokens=MAX_NEW)
        sp = dj.generate(target, drafter, batch, max_new_tokens=MAX_NEW)
        runs.append((batch, ar, sp))
    return dict(target=target, drafter=drafter, runs=runs, loss=(hist[0]["loss"], hist[-1]["loss"]))


def test_trained_drafter_tau_and_exactness(trained):
    taus = []
    for batch, ar, sp in trained["runs"]:
        assert_same(trained["target"], batch, ar, sp, "trained")
        taus.append(sp.acceptance_lengths[sp.acceptance_lengths > 0])
    tau = float(np.concatenate(taus).mean())
    STATS["trained"] = dict(tau=tau, loss=trained["loss"],
                            histogram=np.bincount(np.concatenate(taus), minlength=PBS + 1).tolist())
    assert tau > 1.2, f"trained drafter tau {tau:.3f} <= 1.2"



def test_acceptance_lengths_match_cache_free_reference_loop(trained):
    """Step-by-step acceptance lengths of `generate` (caches, rollback, pending context) == the reference loop, on the
    two rows (of six, all with 8-token prompts) with the most accepted drafts in their first 6 steps. Capped at 6
    steps per row because draft_logits compiles once per context length (~1 s each on a busy 2-core machine)."""
    rows = [(batch[b], sp, b) for batch, _, sp in trained["runs"] for b in range(len(batch))]
    rows.sort(key=lambda r: -int((r[1].acceptance_lengths[r[2], :6] > 1).sum()))
    compared, seen = 0, []
    for prompt, sp, b in rows[:2]:
        ref_acc, ref_out = reference_acceptance(trained["target"], trained["drafter"], prompt, max_new=MAX_NEW,
                                                max_steps=6)
        got = sp.acceptance_lengths[b, :len(ref_acc)].tolist()
        assert got == ref_acc, f"generate {got} vs reference {ref_acc}"
        np.testing.assert_array_equal(sp.tokens[b, :len(ref_out)], ref_out)
        compared += len(ref_acc)
        seen += ref_acc
    STATS["reference-loop/trained"] = dict(steps_compared=compared, acceptance=seen)
    assert any(a > 1 for a in seen), "the reference check saw no accepted draft"


@pytest.mark.parametrize("draft_pass", ["block", "drafted"])
def test_short_chain_drafts_from_the_block_its_draft_pass_names(trained, draft_pass):
    """At D < block_size - 1 the loop drafts from the whole block ("block", z-lab's) or from [last, D mask tokens]
    ("drafted"; `DrafterConfig.draft_pass`, `models.drafter.draft_block`): the step-by-step acceptance of generate at
    D 2 equals the cache-free reference drafting from that block on the row with the most accepted drafts, greedy
    output stays identical to autoregressive, and the two blocks give the drafted slots different logits (so a loop
    that ignored the setting would fail one of the two cases)."""
    from dflash_jax.models.drafter import draft_block
    target, drafter = trained["target"], trained["drafter"]
    batch = trained["runs"][0][0]
    sp = dj.generate(target, drafter, batch, max_new_tokens=MAX_NEW, draft_length=2, draft_pass=draft_pass)
    assert sp.draft_pass == draft_pass
    ar = dj.generate_autoregressive(target, batch, max_new_tokens=MAX_NEW)
    assert sp.token_lists() == ar.token_lists()
    b = int(np.argmax([(sp.acceptance_lengths[i, :6] > 1).sum() for i in range(len(batch))]))
    ref_acc, ref_out = reference_acceptance(target, drafter, batch[b], max_new=MAX_NEW, max_steps=6, draft_length=2,
                                            draft_pass=draft_pass)
    got = sp.acceptance_lengths[b, :len(ref_acc)].tolist()
    assert got == ref_acc, f"generate {got} vs reference {ref_acc}"
    np.testing.assert_array_equal(sp.tokens[b, :len(ref_out)], ref_out)
    assert any(a > 1 for a in ref_acc), "the check saw no accepted draft"
    M, bs = C1.drafter.mask_token_id, C1.drafter.block_size
    last = jnp.asarray([5, 7], jnp.int32)
    short = drafter.replace(config=drafter.config.replace(draft_pass="drafted"))
    assert draft_block(short, last, 2).tolist() == [[5, M, M], [7, M, M]]
    assert draft_block(short, last, bs - 1).shape == (2, bs)
    assert draft_block(drafter, last, 2).shape == (2, bs)  # None: the whole block
    _, feats = dj.target_forward(target, jnp.asarray([batch[b]]), layer_ids=C1.drafter.target_layer_ids)
    full = np.full((1, bs), M, np.int32)
    full[0, 0] = batch[b][-1]
    narrow = dj.draft_logits(target, drafter, feats, full[:, :3])
    whole = dj.draft_logits(target, drafter, feats, full)[:, :2]
    assert narrow.shape == whole.shape and not np.array_equal(np.asarray(narrow), np.asarray(whole))


def test_draft_pass_is_refused_where_it_cannot_run(trained):
    """An unknown draft pass, and the drafted-slots pass for a DFlash2 drafter, are refused before anything compiles,
    naming the setting; autoregressive decoding does not take one."""
    target, drafter = trained["target"], trained["drafter"]
    with pytest.raises(ValueError, match=r"draft_pass='half'.*must be one of \('block', 'drafted'\)"):
        dj.generate(target, drafter, [[1, 2, 3]], max_new_tokens=4, draft_pass="half")
    with pytest.raises(TypeError, match="draft_pass"):
        dj.generate_autoregressive(target, [[1, 2, 3]], max_new_tokens=4, draft_pass="block")
    with pytest.raises(ValueError, match="DFlash2"):
        dj.DrafterConfig(**{**{f: getattr(C1.drafter, f) for f in ("model", "block_size", "mask_token_id",
                                                                   "target_layer_ids", "num_target_layers")},
                            "kind": "dflash2", "draft_pass": "drafted"})


def test_acceptance_lengths_match_reference_loop_position_sensitive(copy_runs):
    """The same reference check on the flawed copy drafter (row 0), whose drafts depend on exact context positions:
    an off-by-one in the drafter's context bookkeeping (e.g. appending a accepted rows instead of a + 1) changes its
    acceptance from the second step on, which the trained drafter above is too position-blind to show."""
    r = copy_runs
    ref_acc, ref_out = reference_acceptance(r["target"], r["flawed"], COPY_PROMPTS[0], max_new=COPY_MAX_NEW,
                                            max_steps=4)
    got = r["flawed_sp"].acceptance_lengths[0, :len(ref_acc)].tolist()
    assert got == ref_acc, f"generate {got} vs reference {ref_acc}"
    np.testing.assert_array_equal(r["flawed_sp"].tokens[0, :len(ref_out)], ref_out)
    STATS["reference-loop/copy-flawed"] = dict(steps_compared=len(ref_acc), acceptance=ref_acc)


# -- 3. one generate call = one compiled program ---------------------------------------------------------------------

def _call(target, drafter, prompts, max_new, **kw):
    """What `generate` hands to the compiled program (its own host-side preparation, not run)."""
    return G.speculative_call(target, drafter, prompts, max_new_tokens=max_new, **kw)



def test_speculative_program_is_one_while_loop_without_host_sync():
    s = C1
    target, drafter = make_target(s.target, 0), make_drafter(s.drafter, 100)
    call = _call(target, drafter, prompt_batches(64, 0)[0], MAX_NEW)
    closed = jax.make_jaxpr(call.unjitted)(*call.args)
    top = [e.primitive.name for e in closed.jaxpr.eqns]
    assert top.count("while") == 1, f"expected exactly one top-level while, got {top.count('while')}"
    loop = closed.jaxpr.eqns[top.index("while")]
    inside = primitives(loop.params["body_jaxpr"].jaxpr) + primitives(loop.params["cond_jaxpr"].jaxpr)
    # the body really is the draft + verify step: its products (XLA's, or the CPU kernel's calls in the CPU loops)
    assert {"dot_general", "ffi_call"} & set(inside), sorted(set(inside))
    assert not host_ops(inside), f"host round trip inside the decode loop: {host_ops(inside)}"
    STATS["jaxpr"] = dict(top_level_host_ops=host_ops(primitives(closed.jaxpr)), body_ops=len(inside),
                          nested_whiles=inside.count("while"))
    # the only host op of the whole program is the single prefill-timing callback, outside the loop
    assert host_ops(top) == ["io_callback"] and top.count("io_callback") == 1


def test_jaxpr_walker_detects_a_per_step_sync():
    """Negative control for the test above: a debug callback in a loop body is found."""
    def f(x):
        def body(c):
            jax.debug.callback(lambda v: None, c[1])
            return c[0] + 1, c[1] * 2
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
    closed = jax.make_jaxpr(f)(jnp.ones(3))
    loop = [e for e in closed.jaxpr.eqns if e.primitive.name == "while"][0]
    assert host_ops(primitives(loop.params["body_jaxpr"].jaxpr)) == ["debug_callback"]


@pytest.fixture(scope="module")
def sampled_runs(copy_runs):
    """Temperature-1 runs of one fresh static config: 4 calls (same prompts twice with seed 0, seed 1, other prompts
    with seed 0). While it is traced, `_stamp` (the prefill-timing host callback) is replaced by a wrapper that counts
    calls and runs the real one on another thread, as a GPU runtime does with host callbacks."""
    r = copy_runs
    calls, orig = [], prefill._stamp

    def stamp_elsewhere(x):
        calls.append(threading.current_thread().name)
        out = []
        t = threading.Thread(target=lambda: out.append(orig(x)))
        t.start()
        t.join()
        return out[0]

    other = [cycle_prompt(8, 9), cycle_prompt(33, 14), cycle_prompt(20, 12)]  # same padded shape (16)
    traces0, prefill0 = G.TRACE_COUNTS["speculative"], G.TRACE_COUNTS["prefill"]
    prefill._stamp = stamp_elsewhere
    # prefill holds the stamp: a fresh prefill program (the loop programs kept) traces the wrapper in
    compiled = G._COMPILED
    G._COMPILED = {k: v for k, v in compiled.items() if k != "prefill"}
    try:
        kw = dict(max_new_tokens=COPY_MAX_NEW, temperature=1.0)
        res = [dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=0, **kw)]
        traces1, prefill1 = G.TRACE_COUNTS["speculative"], G.TRACE_COUNTS["prefill"]
        res += [dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=0, **kw),
                dj.generate(r["target"], r["flawed"], COPY_PROMPTS, seed=1, **kw),
                dj.generate(r["target"], r["flawed"], other, seed=0, **kw)]
    finally:
        prefill._stamp = orig
        G._COMPILED = compiled
    return dict(res=res, traces=(traces0, traces1, G.TRACE_COUNTS["speculative"]), stamp_calls=calls,
                prefill_traced=prefill1 - prefill0)


def test_traced_and_compiled_once_for_prompts_of_one_shape(sampled_runs):
    t0, t1, t2 = sampled_runs["traces"]
    assert t1 - t0 <= 1 and t2 == t1, f"retraced: trace counts {t0} -> {t1} -> {t2}"
    res = sampled_runs["res"]
    assert all(r.timings["compile_s"] == 0.0 for r in res[1:])
    if sampled_runs["prefill_traced"]:  # prefill (which holds the stamp) traced here, so the counting wrapper
        # is in the program: one host callback per call,
        assert len(sampled_runs["stamp_calls"]) == 4  # not one per decode step
        assert all(r.num_steps > 1 for r in res)


def test_compiled_program_runs_under_transfer_guard(copy_runs):
    """The compiled program (not the host wrapper) runs with implicit transfers disallowed. Note: on the CPU backend
    device->host guards are inert (np.asarray of a device array is not caught), so this only proves there is no
    implicit host->device transfer; the prefill io_callback does not trip the guard."""
    r = copy_runs
    call = _call(r["target"], r["perfect"], COPY_PROMPTS, COPY_MAX_NEW)
    traces = dict(G.TRACE_COUNTS)
    args = jax.device_put(call.args)
    with jax.transfer_guard("disallow"):
        out = call(*args)  # compiled by copy_runs
        jax.block_until_ready(out)
    assert G.TRACE_COUNTS == traces
    # the programs run a batch bucket (inert padding rows after the caller's rows)
    np.testing.assert_array_equal(np.asarray(out[0])[:len(COPY_PROMPTS), :COPY_MAX_NEW], r["sp"].tokens)


# -- 4. GenerationResult fields --------------------------------------------------------------------------------------

def test_generation_result_fields(copy_runs):
    res = copy_runs["flawed_sp"]
    B, N = len(COPY_PROMPTS), COPY_MAX_NEW
    assert res.tokens.shape == (B, N) and res.tokens.dtype.kind == "i"
    for b in range(B):  # -1 exactly after each row's end
        n = res.num_tokens[b]
        assert (res.tokens[b, :n] >= 0).all() and (res.tokens[b, n:] == PAD).all()
    acc = res.acceptance_lengths
    assert acc.shape == (B, res.num_steps)
    for b in range(B):  # positive while the row runs, then 0; the committed count covers the emitted tokens
        live = int((acc[b] > 0).sum())
        assert live > 0 and (acc[b, :live] > 0).all() and (acc[b, live:] == 0).all()
        assert acc[b].sum() + 1 >= res.num_tokens[b] > acc[b].sum() + 1 - acc[b, live - 1]
    steps = acc[acc > 0]
    assert res.tau == pytest.approx(steps.mean())
    hist = res.tau_histogram
    assert hist.shape == (res.draft_length + 2,) and hist[0] == 0 and hist.sum() == steps.size
    np.testing.assert_array_equal(hist, [np.sum(steps == k) for k in range(res.draft_length + 2)])
    pa = res.position_acceptance
    assert pa.shape == (res.draft_length,) and (np.diff(pa) <= 0).all() and 0 < pa[0] <= 1
    np.testing.assert_allclose(pa, [(steps - 1 >= k).mean() for k in range(1, res.draft_length + 1)])
    assert res.acceptance_rate == pytest.approx((steps - 1).sum() / (steps.size * res.draft_length))
    assert res.token_lists() == [res.tokens[b, :res.num_tokens[b]].tolist() for b in range(B)]
    t = res.timings
    assert {"prefill_s", "decode_s", "total_s", "compile_s"} <= set(t)
    assert t["total_s"] > 0 and t["decode_s"] > 0 and t["prefill_s"] > 0
    assert t["prefill_s"] + t["decode_s"] == pytest.approx(t["total_s"])


def test_prefill_timing_survives_callback_on_another_thread(sampled_runs):
    if not sampled_runs["prefill_traced"]:
        pytest.skip("prefill was compiled before the fixture installed its thread-switching stamp wrapper")
    for r in sampled_runs["res"]:
        assert r.timings["prefill_s"] > 0, r.timings


# -- 5. bad input: a clear ValueError before any work ------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    return make_target(C1.target, 0), make_drafter(C1.drafter, 100)


@pytest.mark.parametrize("prompt,match", [
    ([], r"empty prompt: the batch has no rows"),
    (np.zeros((0, 4), np.int32), r"empty prompt: the batch has no rows"),
    ([[]], r"empty prompt: row 0 has no tokens"),
    ([[1, 2], []], r"empty prompt: row 1 has no tokens"),
    (np.zeros((2, 0), np.int32), r"empty prompt: row 0 has no tokens"),
    ([[1, 2, 64]], r"token id 64 at row 0, position 2 is outside the vocabulary \[0, 64\)"),
    ([[1], [5, -1]], r"token id -1 at row 1, position 1 is outside the vocabulary"),
    (np.array([[1, 2], [3, 1000]]), r"token id (np\.int64\()?1000\)? at row 1, position 1"),  # numpy repr: cosmetic
    (np.array([[1.0, 2.0]]), r"token ids must be integers, got dtype float64"),
    (jnp.array([[1.0, 2.0]]), r"token ids must be integers, got dtype float32"),
    ([1, 2, 3], r"1-D array of shape \(3,\) \(wrap a single prompt in a list\)"),
], ids=["no-rows", "no-rows-array", "one-empty-row", "second-row-empty", "zero-width-array", "id>=vocab", "id<0",
        "array-id>=vocab", "float-array", "float-jax-array", "1-D"])
@pytest.mark.parametrize("fn", ["generate", "generate_autoregressive"])
def test_bad_prompts(pair, no_work, prompt, match, fn):
    target, drafter = pair
    call = (functools.partial(dj.generate, target, drafter) if fn == "generate"
            else functools.partial(dj.generate_autoregressive, target))
    with pytest.raises(ValueError, match=match):
        call(prompt, max_new_tokens=4)


def test_float_token_in_list_message_says_integer(pair, no_work):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"integer"):
        dj.generate(target, drafter, [[1, 2.0, 3]], max_new_tokens=4)


def test_float_token_in_list_is_rejected(pair, no_work):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"2\.0 at row 0, position 1"):  # rejected today, wording aside
        dj.generate(target, drafter, [[1, 2.0, 3]], max_new_tokens=4)


@pytest.mark.parametrize("max_new", [0, -3, 2.5, None])
def test_bad_max_new_tokens(pair, no_work, max_new):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive integer, got " + repr(max_new)):
        dj.generate(target, drafter, [[1, 2]], max_new_tokens=max_new)
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive integer"):
        dj.generate_autoregressive(target, [[1, 2]], max_new_tokens=max_new)


def test_context_overflow(pair, no_work):
    target, drafter = pair
    small = target.replace(config=target.config.replace(max_position_embeddings=40))
    with pytest.raises(ValueError, match=r"context overflow: prompt length 30 \+ max_new_tokens 11 = 41 exceeds "
                                         r"the context limit of 40 tokens"):
        dj.generate(small, drafter, [[1] * 30, [2] * 5], max_new_tokens=11)
    with pytest.raises(ValueError, match=r"context overflow"):
        dj.generate_autoregressive(small, [[1] * 30], max_new_tokens=11)
    with pytest.raises(ValueError, match=r"context overflow: .* limit of 32 tokens"):
        dj.generate(target, drafter, [[1] * 30], max_new_tokens=3, max_cache_len=32)


@pytest.mark.parametrize("D", [0, 8, -1, 9])
def test_bad_draft_length(pair, no_work, D):
    target, drafter = pair  # block size 8: draft lengths 1..7
    with pytest.raises(ValueError, match=r"draft_length must be in 1..block_size-1 = 1..7, got " + str(D)):
        dj.generate(target, drafter, [[1, 2]], max_new_tokens=4, draft_length=D)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=48), r"hidden size: drafter 32 vs target 48"),
    (dict(vocab_size=128), r"vocab size: drafter 64 vs target 128"),
    (dict(num_hidden_layers=6), r"num_target_layers: drafter expects 4, target has 6"),
])
def test_drafter_built_for_another_target(no_work, change, match):
    target = make_target(C1.target.replace(**change), 0)
    drafter = make_drafter(C1.drafter, 100)
    with pytest.raises(ValueError, match=r"drafter does not match target: .*" + match):
        dj.generate(target, drafter, [[1, 2]], max_new_tokens=4)


def test_bad_eos_ids(pair, no_work):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"eos_ids \[64\] outside the vocabulary \[0, 64\)"):
        dj.generate(target, drafter, [[1, 2]], max_new_tokens=4, eos_ids=(3, 64))


# -- 6. sampling smoke (the statistical tests live elsewhere) --------------------------------------------------------

def test_sampling_runs_reproducible_and_seed_dependent(sampled_runs):
    a, a2, b, other = sampled_runs["res"]
    for r in (a, b, other):
        assert r.tokens.shape == (3, COPY_MAX_NEW) and (r.num_tokens == COPY_MAX_NEW).all()
        assert ((r.tokens >= 0) & (r.tokens < PV)).all()
    np.testing.assert_array_equal(a.tokens, a2.tokens)
    np.testing.assert_array_equal(a.acceptance_lengths, a2.acceptance_lengths)
    assert not np.array_equal(a.tokens, b.tokens)
    assert a.tau > 1.5  # the target is confident (p(pi(x)) ~ 0.9) and the drafter mostly right


def test_top_k_1_at_temperature_1_equals_greedy(copy_runs):
    r = copy_runs
    res = dj.generate(r["target"], r["flawed"], COPY_PROMPTS, max_new_tokens=COPY_MAX_NEW, temperature=1.0, top_k=1,
                      seed=3)
    np.testing.assert_array_equal(res.tokens, r["ar"].tokens)
    np.testing.assert_array_equal(res.acceptance_lengths, r["flawed_sp"].acceptance_lengths)
