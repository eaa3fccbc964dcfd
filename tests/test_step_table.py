"""The measured step table: generate's default draft length is its best row for the running pair; a table from
another platform or target, or without a row for the drafter's draft vocabulary, is ignored with a warning; the
table travels with the drafter's folder (save, load_drafter)."""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import execution
from dflash_jax.decode import draft_length as dl
from dflash_jax.io.step_table_file import FILE_NAME, read_step_table, write_step_table
from dflash_jax.step_table import StepRow, StepTable
from helpers import tiny_qwen3


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_qwen3(num_hidden_layers=2, max_position_embeddings=256)
    target = dj.init_target(cfg, jax.random.key(0))
    dcfg = dj.DrafterConfig(model=cfg.drafter_stack(1), block_size=6, mask_token_id=0, target_layer_ids=(0, 1),
                            num_target_layers=2)
    return target, dj.init_drafter(dcfg, jax.random.key(1))


def _table(target, rows, platform=None):
    return StepTable(platform=platform or jax.default_backend(), target=dl.target_signature(target), rows=tuple(rows))


def _with(drafter, table):
    return drafter.replace(config=drafter.config.replace(step_table=table))


def test_default_draft_length_is_the_best_measured_row(pair):
    target, drafter = pair
    rows = [StepRow(1, None, 1.5, 1.1, 0.2), StepRow(3, None, 2.4, 1.3, 0.2), StepRow(5, None, 2.6, 1.9, 0.3),
            StepRow(2, None, 3.0, 1.0, 0.1, batch=4)]
    d = _with(drafter, _table(target, rows))
    assert dl.default_draft_length(d, target) == 3  # 2.4 / 1.5 beats 1.5 / 1.3 and 2.6 / 2.2
    assert dl.default_draft_length(d, target, batch=4) == 2 and dl.default_draft_length(d, target, batch=9) == 2
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=8, eos_ids=())
    assert res.draft_length == 3
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=8, eos_ids=(), draft_length=5).draft_length == 5
    assert dl.default_draft_length(drafter, target) == 5  # no table: block_size - 1


@pytest.mark.parametrize("bad, why", [
    ("platform", "measured on 'elsewhere'"),
    ("target", "measured with target"),
    ("vocab", "no row for draft vocabulary"),
])
def test_a_table_that_does_not_apply_is_ignored_with_a_warning(pair, bad, why):
    target, drafter = pair
    rows = [StepRow(2, 32 if bad == "vocab" else None, 2.0, 1.0, 0.1)]
    table = _table(target, rows, platform="elsewhere" if bad == "platform" else None)
    if bad == "target":
        table = table.replace(target="llama-0123456789ab")
    dl._WARNED.clear()
    with pytest.warns(UserWarning, match=f"step table is ignored: .*{why}"):
        assert dl.default_draft_length(_with(drafter, table), target) == 5


def test_the_table_travels_with_the_drafter_folder(pair, tmp_path):
    target, drafter = pair
    table = _table(target, [StepRow(2, None, 2.0, 1.0, 0.1)]).replace(note="test")
    dj.save(tmp_path / "d", _with(drafter, table))
    saved = json.loads((tmp_path / "d" / "dflash_jax.json").read_text())
    assert "step_table" not in saved["config"]  # a measurement, not architecture: its own file
    back = dj.load_drafter(tmp_path / "d")
    assert back.config.step_table == table
    (tmp_path / "d" / FILE_NAME).write_text('{"rows": 3}')
    with pytest.warns(UserWarning, match="ignored"):
        assert dj.load_drafter(tmp_path / "d").config.step_table is None


def test_weight_format_changes_the_signature(pair):
    target, _ = pair
    bf = target.replace(params=jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), target.params))
    assert dl.target_signature(bf) != dl.target_signature(target)
    assert dl.target_signature(target) == dl.target_signature(target)


def test_the_best_rows_draft_pass_is_the_default_and_survives_the_file(pair, tmp_path):
    """Rows measured with the drafted slots only ("drafted") and the whole block: generate runs the best row's draft
    pass when it takes the table's layout; a drafter or a call naming a pass takes that pass's best row; the field
    survives the file, and an older file's rows (no field) read as the whole block."""
    target, drafter = pair
    rows = [StepRow(2, None, 2.0, 1.3, 0.30), StepRow(2, None, 1.98, 1.3, 0.15, draft_pass="drafted"),
            StepRow(3, None, 2.1, 1.35, 0.30)]
    d = _with(drafter, _table(target, rows))
    assert dl.default_setting(d, target) == (2, None, "drafted")
    assert dl.default_layout(d, target) == (2, None)
    block = d.replace(config=d.config.replace(draft_pass="block"))
    assert dl.default_setting(block, target) == (2, None, "block")
    want = dj.generate_autoregressive(target, [[3, 4, 5]], max_new_tokens=12, eos_ids=()).token_lists()
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=())
    assert (res.draft_length, res.draft_pass) == (2, "drafted") and res.token_lists() == want
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), draft_pass="block")
    assert (res.draft_length, res.draft_pass) == (2, "block") and res.token_lists() == want
    # an explicit draft length without a pass runs the drafter's own (None: the whole block)
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), draft_length=1).draft_pass == "block"
    write_step_table(tmp_path, d.config.step_table)
    back = read_step_table(tmp_path)
    assert back.best(None) == rows[1]
    old = json.loads((tmp_path / "step_table.json").read_text())
    for r in old["rows"]:
        r.pop("draft_pass")
    assert {r.draft_pass for r in StepTable.from_dict(old).rows} == {"block"}


def test_a_chain_rows_context_lookup_runs_with_it_and_survives_the_file(pair, tmp_path):
    """A chain row measured with context lookup (`StepRow.context_lookup`) is run with it when generate takes its
    layout from the table; a call naming a lookup, or a draft length of its own, keeps its own (an explicit chain is
    z-lab's loop unless told); a row without the field (older tables) is z-lab's loop; the field survives the file;
    a tree row leaves generate's own default (2)."""
    target, drafter = pair
    want = dj.generate_autoregressive(target, [[3, 4, 5]], max_new_tokens=12, eos_ids=()).token_lists()
    d = _with(drafter, _table(target, [StepRow(2, None, 2.0, 1.3, 0.2, context_lookup=3)]))
    assert dl.default_choice(d, target) == dl.DefaultChoice(2, None, "block", 3)
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=())
    assert (res.draft_length, res.context_lookup) == (2, 3) and res.token_lists() == want
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), context_lookup=0).context_lookup == 0
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), draft_length=2).context_lookup == 0
    old = _with(drafter, _table(target, [StepRow(2, None, 2.0, 1.3, 0.2)]))
    assert dj.generate(target, old, [[3, 4, 5]], max_new_tokens=12, eos_ids=()).context_lookup == 0
    tree = _with(drafter, _table(target, [StepRow(2, None, 2.0, 1.3, 0.2, tree_budget=2, context_lookup=0)]))
    assert dl.default_choice(tree, target).context_lookup is None
    assert dj.generate(target, tree, [[3, 4, 5]], max_new_tokens=12, eos_ids=()).context_lookup == 2
    write_step_table(tmp_path, d.config.step_table)
    assert read_step_table(tmp_path).rows[0].context_lookup == 3


def test_a_tree_row_that_wins_becomes_the_default_and_an_explicit_setting_overrides_it(pair):
    target, drafter = pair
    rows = [StepRow(3, None, 2.0, 1.3, 0.2), StepRow(4, None, 2.9, 1.4, 0.2, tree_budget=4)]
    d = _with(drafter, _table(target, rows))
    assert dl.default_layout(d, target) == (4, 4)  # a tree row's draft length is its depth
    assert dl.default_draft_length(d, target) == 3  # the best chain, for callers that need one
    want = dj.generate_autoregressive(target, [[3, 4, 5]], max_new_tokens=12, eos_ids=()).token_lists()
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=())
    assert (res.tree_budget, res.draft_length) == (4, 4) and res.token_lists() == want
    chain = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), draft_length=2)
    assert (chain.tree_budget, chain.draft_length) == (None, 2) and chain.token_lists() == want
    # a rule a tree cannot follow keeps the default a chain (p_min cuts a chain at its first unsure draft)
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=12, eos_ids=(), p_min=0.1).tree_budget is None
    # the table's row survives the file
    back = StepTable.from_dict(json.loads(json.dumps(_table(target, rows).to_dict())))
    assert back.rows[1].tree_budget == 4


def test_rows_within_the_noise_margin_are_a_tie_won_by_the_narrower_verify():
    """The two SmolLM2 tables of 2026-12-05 (third session): a noisy one put a tree of 4 at 1.04x, D 1 at 1.03x and a
    tree of 2 at 1.00x (measured 0.85x / 1.07x / 1.02x); within 5% of the top they are a tie and the narrowest verify
    (D 1: 2 tokens) runs. A row that wins by more than the margin runs whatever its width; margin 0 is the plain
    maximum."""
    noisy = StepTable(platform="cpu", target="t", rows=(
        StepRow(1, 8192, 1.40, 1.13, 0.23), StepRow(4, 8192, 1.86, 1.48, 0.30, tree_budget=4),
        StepRow(2, 8192, 1.65, 1.36, 0.30, tree_budget=2), StepRow(7, 8192, 1.59, 2.12, 0.30)))
    assert [round(r.predicted_speedup, 2) for r in noisy.rows] == [1.03, 1.04, 0.99, 0.66]
    assert noisy.best(8192).draft_length == 1 and noisy.best(8192).tree_budget is None
    assert noisy.best(8192, margin=0.0).tree_budget == 4
    quiet = StepTable(platform="cpu", target="t", rows=(
        StepRow(1, 8192, 1.40, 1.09, 0.25), StepRow(2, 8192, 1.65, 1.21, 0.26, tree_budget=2),
        StepRow(4, 8192, 1.86, 1.54, 0.29, tree_budget=4)))
    assert quiet.best(8192).tree_budget == 2  # 1.12x beats D 1's 1.04x by more than 5%
    assert quiet.best(None) is None


def test_where_even_the_best_row_is_slower_generate_decodes_plainly(pair):
    """A table whose best row at this batch predicts a slowdown: `generate` (no draft_length or tree_budget) runs
    plain decoding, says so once, and returns its exact tokens (greedy and sampled: the same program and seed as
    `generate_autoregressive`); at a batch where the table predicts a speedup, or with an explicit setting, or with
    plain_when_slower=False, it speculates."""
    target, drafter = pair
    rows = [StepRow(3, None, 2.4, 1.3, 0.2), StepRow(1, None, 1.4, 1.5, 0.1, batch=4),
            StepRow(3, None, 1.6, 2.0, 0.2, batch=4)]
    d = _with(drafter, _table(target, rows))
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [2, 3]]
    assert dl.slower_than_plain(d, target) is None and dl.slower_than_plain(d, target, batch=4) == rows[1]
    assert dl.slower_than_plain(drafter, target, batch=4) is None  # no table: nothing predicted
    kw = dict(max_new_tokens=10, eos_ids=())
    want = dj.generate_autoregressive(target, prompts, **kw).token_lists()
    dl._WARNED.clear()
    with pytest.warns(UserWarning, match=r"predicts 0\.875x for its best setting at batch 4 \(draft length 1, measured "
                                         r"at batch 4\): decoding plainly"):
        res = dj.generate(target, d, prompts, **kw)
    assert res.draft_length == 0 and res.tau == 1.0 and res.token_lists() == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        sampled = dj.generate(target, d, prompts, temperature=0.8, seed=5, **kw)
    assert sampled.token_lists() == dj.generate_autoregressive(target, prompts, temperature=0.8, seed=5,
                                                               **kw).token_lists()
    assert dj.generate(target, d, prompts[:1], **kw).draft_length == 3  # batch 1: the table predicts 1.6x
    assert dj.generate(target, d, prompts, draft_length=2, **kw).draft_length == 2
    anyway = dj.generate(target, d, prompts, plain_when_slower=False, **kw)
    assert anyway.draft_length == 1 and anyway.token_lists() == want
    with pytest.raises(TypeError, match="plain_when_slower"):
        dj.generate_autoregressive(target, prompts, plain_when_slower=False, **kw)


@pytest.fixture
def float_products():
    """Generation's products pinned to float32 (on a CPU with AVX512-BF16 they default to bfloat16 ones, a build of
    their own): the tests of which table a build reads name the build they run."""
    with execution.changed(bf16_products=False):
        yield


def test_generation_takes_bf16_products_by_default_where_the_cpu_has_them(monkeypatch):
    """Generation's default products (`generation_bf16_products`): bfloat16 where the kernel runs AVX512-BF16's
    instruction and x is not rounded to Q8, float32 elsewhere; an explicit setting wins either way; the step table's
    build follows (the "-bf16" table read by default on such a CPU)."""
    from dflash_jax.quant import cpu_kernel
    from dflash_jax.quant.products import generation_bf16_products

    if not cpu_kernel.available():
        pytest.skip(f"CPU kernel: {cpu_kernel.unavailable_reason()}")
    for native in (True, False):
        monkeypatch.setattr(cpu_kernel, "bf16_products_native", lambda native=native: native)
        assert generation_bf16_products() is native
        assert dl.running_cpu_kernel() == cpu_kernel.isa() + ("-bf16" if native else "")
        assert generation_bf16_products(q8=True) is False
        with execution.changed(q8_activations=True):
            assert generation_bf16_products() is False and dl.running_cpu_kernel().endswith("-q8")
        for explicit in (True, False):
            with execution.changed(bf16_products=explicit):
                assert generation_bf16_products() is explicit
    assert execution.current().bf16_products is None  # forwards outside generation: float32 products


def _this_and_another_build() -> tuple[str, str]:
    """The CPU kernel build running here (its float32 products) and another one (the test is skipped without the
    kernel)."""
    here = dl.running_cpu_kernel(q8=False, bf16=False)
    if here is None:
        pytest.skip("no CPU kernel here")
    return here, "portable" if here != "portable" else "avx512"


def test_a_table_of_another_cpu_kernel_build_is_applied_with_a_warning(pair, float_products):
    """A verify's cost in decode steps differs between the CPU kernel's builds (AVX-512, AVX2, portable): a CPU table
    records its build, and one measured with another build than the one running here still chooses (it is this pair's
    only measurement) but says so."""
    target, drafter = pair
    here, other = _this_and_another_build()
    table = _table(target, [StepRow(2, None, 2.0, 1.0, 0.1)]).replace(cpu_kernel=other)
    dl._WARNED.clear()
    with pytest.warns(UserWarning, match=f"CPU kernel's {other} build and this CPU runs its {here} build"):
        assert dl.default_draft_length(_with(drafter, table), target) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dl.default_draft_length(_with(drafter, table.replace(cpu_kernel=here)), target) == 2


def test_a_folder_keeps_one_cpu_table_per_kernel_build_and_reads_this_cpus(pair, tmp_path, float_products):
    from dflash_jax.io.step_table_file import build_file_name, read_step_table, write_step_table

    target, _ = pair
    here, other = _this_and_another_build()
    theirs = _table(target, [StepRow(5, None, 2.0, 1.0, 0.1)]).replace(cpu_kernel=other)
    ours = _table(target, [StepRow(1, None, 1.5, 1.0, 0.1)]).replace(cpu_kernel=here)
    assert write_step_table(tmp_path, theirs).name == FILE_NAME
    assert read_step_table(tmp_path) == theirs  # the only table: read (and warned about when applied)
    assert write_step_table(tmp_path, ours).name == build_file_name(here)  # step_table.json keeps the other build's
    assert read_step_table(tmp_path) == ours and json.loads((tmp_path / FILE_NAME).read_text())["cpu_kernel"] == other
    assert write_step_table(tmp_path, ours).name == build_file_name(here)  # rewritten in place
    same = _table(target, [StepRow(3, None, 2.0, 1.0, 0.1)]).replace(cpu_kernel=other)
    assert write_step_table(tmp_path, same).name == FILE_NAME  # the same build as step_table.json: replaces it


@pytest.mark.parametrize("field, suffix", [("q8_activations", "-q8"), ("bf16_products", "-bf16")])
def test_q8_activations_read_their_own_cpu_table_then_the_builds(pair, tmp_path, field, suffix, float_products):
    """Q8 activations (and bfloat16 products) change a step's costs: their tables are a build of their own
    ("<build>-q8", measured under `--q8-activations`; "<build>-bf16" under `--bf16-products`); under them a folder's
    own table is read first, then the same build's, and the choice is held to that build (a plain table of the build
    applies with the mismatch warned)."""
    from dflash_jax.io.step_table_file import read_step_table, write_step_table

    target, drafter = pair
    here, other = _this_and_another_build()
    plain = _table(target, [StepRow(1, None, 1.5, 1.0, 0.1)]).replace(cpu_kernel=here)
    own = _table(target, [StepRow(3, None, 2.0, 1.0, 0.1)]).replace(cpu_kernel=here + suffix)
    write_step_table(tmp_path, _table(target, [StepRow(5, None, 2.0, 1.0, 0.1)]).replace(cpu_kernel=other))
    write_step_table(tmp_path, plain)
    with execution.changed(**{field: True}):
        assert dl.running_cpu_kernel() == here + suffix
        assert read_step_table(tmp_path) == plain  # no table of its own yet: this build's
        assert write_step_table(tmp_path, own).name == f"step_table.{here}{suffix}.json"
        assert read_step_table(tmp_path) == own
    assert read_step_table(tmp_path) == plain
    dl._WARNED.clear()
    flag = {"q8": True} if field == "q8_activations" else {"bf16": True}
    with pytest.warns(UserWarning, match=f"CPU kernel's {here} build and this CPU runs its {here}{suffix} build"):
        assert dl.default_layout(_with(drafter, plain), target, **flag) == (1, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dl.default_layout(_with(drafter, own), target, **flag) == (3, None)


def test_rows_sharing_a_verify_share_its_r():
    """The verify of a (batch, D, tree) is one program whatever the draft: its rows get the mean of their r, and the
    prediction follows; rows of another layout keep their own."""
    from dflash_jax.bench.speculative import pool_verify_costs
    row = dict(batch=1, draft_length=1, tree_budget=None, tau=1.4, verify_ms=60.0)
    rows = [dict(row, r=1.2, c=0.15, draft_pass="block"), dict(row, r=1.3, c=0.1, draft_pass="drafted", verify_ms=62.0),
            dict(row, draft_length=3, r=2.0, c=0.2, tau=1.6)]
    a, b, other = pool_verify_costs(rows)
    assert a["r"] == b["r"] == pytest.approx(1.25) and a["verify_ms"] == pytest.approx(61.0)
    assert b["predicted"] == pytest.approx(1.4 / 1.35) and a["predicted"] == pytest.approx(1.4 / 1.4)
    assert other["r"] == 2.0 and other["predicted"] == pytest.approx(1.6 / 2.2)


def test_benchmarks_measure_the_tables_best_row_even_where_it_predicts_a_slowdown(pair):
    """`bench.compare` without a setting (`bench --pair-table` with none, `bench.loop_profile`) measures the table's
    best row speculatively; generate alone would decode plainly there (draft length 0, nothing drafted: the pair
    table printed 'default: D 0' and divided by it under --q8-activations)."""
    from dflash_jax.bench import speculative as bench

    target, drafter = pair
    slow = _with(drafter, _table(target, [StepRow(2, None, 1.1, 1.5, 0.3)]))  # predicts 0.61x
    assert dj.generate(target, slow, [[3, 4, 5]], max_new_tokens=8, eos_ids=()).draft_length == 0
    res = bench.compare(target, slow, [[3, 4, 5]], max_new_tokens=8, warmup=False)
    assert (res["draft_length"], res["tree_budget"]) == (2, None)
    assert res["dflash"]["drafted"] > 0 and np.isfinite(res["dflash"]["acceptance_rate"])


def test_a_sampled_run_takes_the_rows_measured_sampled(pair, tmp_path):
    """Rows measured at a temperature > 0 (`StepRow.temperature`) rank a sampled run's choices, the greedy rows a
    greedy run's (rejection sampling accepts other drafts than greedy matching, by amounts that differ between
    layouts). A table without sampled rows ranks its greedy rows for both. Saving one temperature's rows keeps the
    file's rows of the others (same platform, target and build), and replaces its own."""
    target, drafter = pair
    greedy = [StepRow(1, None, 1.6, 1.2, 0.2), StepRow(2, None, 2.0, 1.3, 0.25, tree_budget=2)]
    sampled = [StepRow(1, None, 1.6, 1.2, 0.2, temperature=0.7),
               StepRow(2, None, 1.7, 1.3, 0.25, tree_budget=2, temperature=0.7)]
    d = _with(drafter, _table(target, greedy + sampled))
    assert dl.default_layout(d, target) == (2, 2)
    assert dl.default_layout(d, target, sampled=True) == (1, None)
    assert dj.generate(target, d, [[3, 4, 5]], max_new_tokens=8, eos_ids=()).tree_budget == 2
    res = dj.generate(target, d, [[3, 4, 5]], max_new_tokens=8, eos_ids=(), temperature=0.7, seed=1)
    assert (res.draft_length, res.tree_budget) == (1, None)
    only_greedy = _with(drafter, _table(target, greedy))
    assert dl.default_layout(only_greedy, target, sampled=True) == (2, 2)

    write_step_table(tmp_path, _table(target, greedy).replace(note="greedy run"))
    write_step_table(tmp_path, _table(target, sampled).replace(note="sampled run"))
    both = read_step_table(tmp_path)
    assert sorted(r.temperature for r in both.rows) == [0.0, 0.0, 0.7, 0.7]
    assert both.note == "sampled run; the rows at T 0: an earlier run's"
    write_step_table(tmp_path, _table(target, greedy[:1]))  # a new greedy run replaces the greedy rows only
    assert sorted((r.temperature, r.draft_length) for r in read_step_table(tmp_path).rows) == [
        (0.0, 1), (0.7, 1), (0.7, 2)]
    other = StepTable(platform=jax.default_backend(), target="another-target", rows=tuple(greedy))
    write_step_table(tmp_path, other)  # another target's table replaces the file whole
    assert read_step_table(tmp_path) == other


def test_a_step_timed_inside_one_program_runs_the_whole_piece_every_time(pair):
    """`step_costs.repeated`: a piece run 3 times in one program returns what one run returns and leaves the same
    state (each rolls its lengths back), and XLA hoists none of it out of the loop: the target's matmuls and the
    embedding of the verified tokens stay in the while body, so the time per piece is the piece's."""
    from dflash_jax.bench import step_costs as sc

    target, drafter = pair
    once = sc.step_functions(target, drafter, context_len=20, draft_length=2)
    thrice = sc.step_functions(target, drafter, context_len=20, draft_length=2, repeat=3)
    for key in ("decode_ms", "verify_ms", "draft_ms"):
        (s1, c1), (s3, c3) = once.pop(key), thrice.pop(key)
        text = s3.compiled_text(c3)
        r1, n1 = s1.program(*s1.before, c1, *s1.after, 1)
        r3, n3 = s3.program(*s3.before, c3, *s3.after, 3)
        for a, b in zip(jax.tree.leaves((r1, n1)), jax.tree.leaves((r3, n3))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        entry = text[text.index("\nENTRY"):]
        assert " while(" in entry, key
        assert not any(op in entry for op in (" dot(", " gather(", "custom-call(")), key  # all inside the loop
    assert once.pop("_meta")["repeat"] == 1 and thrice.pop("_meta")["repeat"] == 3
