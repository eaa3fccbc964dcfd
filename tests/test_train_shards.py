"""train-drafter on a datagen work dir: chunks chain into one run bit for bit, a killed run resumes, a resumed run
sees shards added since (and only from where it resumed), and bad input is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from dflash_jax.train import drafter_run, shard_stream as ss
from dflash_jax.train.shards import DataError
from train_shards_data import add_shard, checkpoint, make_target, spec_of, train_args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    target = make_target(tmp / "target")
    spec = spec_of(target)
    for n in range(2):
        add_shard(tmp / "data", n, spec)
    return tmp, target, spec


def _train(setup, name, *, data=None, steps=10, extra=()):
    tmp, _, _ = setup
    work = tmp / name
    drafter_run.main(train_args(tmp / "target", data or tmp / "data", work, tmp / f"{name}_out", steps=steps,
                                extra=extra))
    return work


def _same(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


@pytest.fixture(scope="module")
def straight(setup):
    return checkpoint(_train(setup, "straight"), 10)


def test_two_chunks_of_five_steps_equal_ten_steps(setup, straight):
    """--stop-at 5, then the same command again: parameters and optimizer state (Adam moments, schedule count) at
    step 10 equal an uninterrupted 10-step run's bit for bit; the clock goes on across the chunks."""
    work = _train(setup, "chunked", extra=["--stop-at", "5"])
    first = checkpoint(work, 5)
    assert not (work / "ckpt" / "10").exists()
    _train(setup, "chunked")
    second = checkpoint(work, 10)
    assert _same(second["params"], straight["params"]) and _same(second["opt"], straight["opt"])
    assert second["clock"][0] >= first["clock"][0] > 0
    moved = jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), first["params"], second["params"])
    assert not all(jax.tree.leaves(moved))
    log = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 4, 9]  # every tenth step and the last one of each chunk


def test_a_killed_run_loses_only_the_steps_since_its_checkpoint(setup, straight, monkeypatch, capsys):
    """Killed while building the batch of step 7 (checkpoints every 5 steps): the rerun resumes at step 5, redoes
    steps 5-9 and ends where the uninterrupted run does."""
    real, seen = ss.ShardStream.host_batch, []

    def dies_at_7(self, step):
        seen.append(step)
        if step == 7 and seen.count(7) == 1:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(ss.ShardStream, "host_batch", dies_at_7)
    with pytest.raises(KeyboardInterrupt):
        _train(setup, "killed")
    capsys.readouterr()
    work = _train(setup, "killed")
    assert "resumed from step 5" in capsys.readouterr().out
    assert seen == list(range(8)) + [5, 6, 7, 8, 9]
    done = checkpoint(work, 10)
    assert _same(done["params"], straight["params"]) and _same(done["opt"], straight["opt"])


def test_a_resumed_run_reads_new_shards_from_where_it_resumes(setup):
    """Steps before the resume keep the rows they had; from the resume on, the batches draw from every shard."""
    tmp, _, spec = setup
    data = tmp / "growing"
    shutil.copytree(tmp / "data", data)
    work = _train(setup, "grows", data=data, steps=20, extra=["--stop-at", "5"])
    plan = ss.read_plan(work)
    assert [(s.start, s.rows) for s in plan] == [(0, 24)]
    add_shard(data, 2, spec)
    _train(setup, "grows", data=data, steps=20, extra=["--stop-at", "10"])
    plan = ss.read_plan(work)
    assert [(s.start, s.rows) for s in plan] == [(0, 24), (5, 36)]
    assert [s[0] for s in plan[1].shards] == ["shard_00000", "shard_00001", "shard_00002"]
    rows = np.concatenate([ss.rows_at(plan, step, 4, 0)[1] for step in range(5, 15)])
    assert rows.max() >= 24  # the new shard's rows are drawn
    assert all(ss.rows_at(plan, step, 4, 0)[1].max() < 24 for step in range(5))
    # resumed from the step-5 checkpoint again (the later one lost): the segment at 5 stands, nothing after it
    shutil.rmtree(work / "ckpt" / "10")
    assert [(s.start, s.rows) for s in ss.update_plan(work, 5, plan[1].shards, 36)] == [(0, 24), (5, 36)]


def test_the_data_plan_refuses_a_shard_that_went_away(setup):
    tmp, _, spec = setup
    work = tmp / "plan_only"
    work.mkdir()
    entries, rows = ss.complete_shards(tmp / "data", spec)
    ss.update_plan(work, 0, entries, rows)
    with pytest.raises(DataError, match="shard_00001, which this run's data plan uses, is gone"):
        ss.update_plan(work, 5, entries[:1], 12)


def test_a_data_budget_takes_the_first_answers(setup):
    tmp, _, spec = setup
    lengths = np.concatenate([np.load(tmp / "data" / f"shard_0000{n}" / "lengths.npy") for n in range(2)])
    plens = np.concatenate([np.load(tmp / "data" / f"shard_0000{n}" / "prompt_lens.npy") for n in range(2)])
    budget = int((lengths - plens)[:15].sum()) - 1  # reached by the 15th answer
    entries, rows = ss.complete_shards(tmp / "data", spec, budget)
    assert rows == 15 and [e[0] for e in entries] == ["shard_00000", "shard_00001"]


def _refused(setup, name, match, *, data=None, extra=()):
    with pytest.raises(SystemExit, match=match):
        _train(setup, name, data=data, steps=4, extra=extra)


def test_a_shard_of_another_target_is_refused_by_name(setup):
    tmp, target, spec = setup
    data = tmp / "foreign"
    shutil.copytree(tmp / "data", data)
    other = spec_of(make_target(tmp / "other_target", seed=5))
    shutil.rmtree(data / "shard_00001")
    add_shard(data, 1, other)  # written under the other target's fingerprint
    _refused(setup, "foreign", r"shard shard_00001 .* made with another target", data=data)
    add_shard(tmp / "other_data", 0, other)  # and a whole work dir made for another target
    _refused(setup, "foreign2", r"data of another target \(fingerprint", data=tmp / "other_data")


def test_a_truncated_shard_is_refused_by_name(setup):
    tmp, _, _ = setup
    data = tmp / "truncated"
    shutil.copytree(tmp / "data", data)
    feats = data / "shard_00001" / "features.npy"
    with open(feats, "r+b") as f:
        f.truncate(os.path.getsize(feats) - 64)
    _refused(setup, "truncated", r"shard shard_00001 .* is truncated: features.npy", data=data)


@pytest.fixture(scope="module")
def stopped(setup):
    """A run stopped after 5 of its 10 steps."""
    return _train(setup, "stopped", extra=["--stop-at", "5"])


@pytest.mark.parametrize("flags, named", [
    (["--block-size", "6"], "block size: 4 in the run, 6 asked"),
    (["--tap-ids", "2"], r"tap set: \[0, 2\] in the run, \[2\] asked"),
    (["--lr", "1e-3"], "learning rate"),
])
def test_a_resumed_run_with_other_settings_is_refused_by_name(setup, stopped, flags, named):
    args = train_args(setup[0] / "target", setup[0] / "data", stopped, setup[0] / "x", steps=10)
    i = args.index(flags[0])
    args[i:i + (3 if flags[0] == "--tap-ids" else 2)] = flags
    with pytest.raises(SystemExit, match=named):
        drafter_run.main(args)


def test_a_resumed_run_with_another_vocabulary_is_refused(setup):
    from dflash_jax.train.run_record import RunMismatch, check_or_record

    work = setup[0] / "vocab_record"
    work.mkdir()
    record = {"vocabulary": "aaaa", "block_size": 8}
    check_or_record(work, record, resuming=False)
    check_or_record(work, record, resuming=True)
    with pytest.raises(RunMismatch, match="vocabulary \\(fingerprint\\): 'aaaa' in the run, 'bbbb' asked"):
        check_or_record(work, dict(record, vocabulary="bbbb"), resuming=True)


def test_kept_labels_over_existing_text_are_what_greedy_decoding_produces():
    """The target's predictions over text: slot k of anchor a is kept only while the text agrees with the
    predictions at a+1..a+k-1, and then equals the token greedy decoding from tokens[:a+1] writes at a+k."""
    import dflash_jax as dj
    from dflash_jax.train import drafter_loss as tdl, text_data
    from helpers import tiny_qwen3

    cfg = tiny_qwen3(vocab_size=8)  # a small vocabulary: the text agrees with the predictions often
    target = dj.init_target(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8, 3).tolist() for _ in range(4)]
    answers = dj.generate_autoregressive(target, prompts, max_new_tokens=13).token_lists()
    for i, a in enumerate(answers):  # the target's own text, with a token the target would not write
        a[4 + i] = (a[4 + i] + 1) % 8
    pairs = list(zip(prompts, answers))
    data = text_data.predictions_over_text(target, pairs, (1, 3), seq_len=16, batch=4)
    logits, _ = dj.target_forward(target, data["tokens"])
    np.testing.assert_array_equal(data["labels"][:, 1:], np.argmax(np.asarray(logits[:, :-1]), -1))
    bs, anchors = 5, np.array([[3, 6, 9]] * 4, np.int32)
    batch = {k: jax.numpy.asarray(v) for k, v in data.items() if k != "features"}
    batch.update(anchors=jax.numpy.asarray(anchors), keep=jax.numpy.ones(anchors.shape, bool))
    labels, valid = map(np.asarray, tdl.training_labels(batch, bs))
    kept = 0
    for b in range(4):
        for n, a in enumerate(anchors[b]):
            greedy = dj.generate_autoregressive(target, [data["tokens"][b, :a + 1].tolist()],
                                                max_new_tokens=bs - 1).token_lists()[0]
            for k in range(1, bs):
                agree = all(data["agree"][b, a + j] for j in range(1, k))
                assert valid[b, n, k - 1] == agree
                if agree:
                    kept += 1
                    assert labels[b, n, k - 1] == greedy[k - 1]
    assert 12 < kept < 4 * 3 * (bs - 1)  # slot 1 always, deeper slots only sometimes


def test_a_warm_start_on_its_source_data_and_seed_is_warned_of(setup, straight, capsys):
    """--init-from a drafter trained on the same shards with the same --seed: the run says its first batches replay
    the source run's (the shard stream's order depends on the seed only); with another seed it says nothing."""
    tmp, _, _ = setup
    source = tmp / "straight_out"
    _train(setup, "warm_same_seed", steps=2, extra=["--init-from", str(source)])
    out = capsys.readouterr().out
    assert f"--init-from {source} was trained on {tmp / 'data'} with --seed 0" in out
    assert "re-reading the " in out and "give another --seed" in out
    _train(setup, "warm_other_seed", steps=2, extra=["--init-from", str(source), "--seed", "1"])
    assert "warning: --init-from" not in capsys.readouterr().out


def test_the_replay_warning_reads_older_reports(tmp_path):
    """Reports written before "seed" was recorded: the seed comes from their command line, else the default 0; other
    data or no report at all: no warning."""
    from dflash_jax.train.drafter import replayed_batches_warning

    def source(report):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "train_report.json").write_text(json.dumps(report))
        return folder

    data = tmp_path / "data"
    plain = source({"command": "dflash-jax train-drafter --data-dir x", "data": str(data)})
    assert "--seed 0" in replayed_batches_warning(plain, data, 0)
    assert replayed_batches_warning(plain, data, 2) is None
    seeded = source({"command": "dflash-jax train-drafter --seed 2", "data": str(data), "answer_tokens_seen": 1234})
    assert "re-reading the 1,234 answer tokens" in replayed_batches_warning(seeded, data, 2)
    assert replayed_batches_warning(seeded, tmp_path / "other", 2) is None
    assert replayed_batches_warning(tmp_path / "missing", data, 0) is None
    assert replayed_batches_warning(plain, None, 0) is None
