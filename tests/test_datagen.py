"""The refilling data generator (train.refill), its shards (train.shards) and runs (train.datagen), on a tiny float32
target: answers equal `generate_autoregressive`'s token for token, features equal `target_forward`'s, shards append,
resume and read back, and bad work dirs are refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from helpers import tiny_qwen3
from dflash_jax.decode.programs import generate_autoregressive
from dflash_jax.models.target import init_target, target_forward
from dflash_jax.train import datagen, shards
from dflash_jax.train.drafter_data import target_fingerprint
from dflash_jax.train.refill import Job, RefillSettings, RefillStats, generate_answers, prompt_keys
from dflash_jax.train.shards import DataError, DataSpec

EOS = (5, 7)
TAPS = (1, 3)
MAX_NEW, MAX_PROMPT = 12, 20
N_PROMPTS = 11


@pytest.fixture(scope="module")
def target():
    return init_target(tiny_qwen3(), jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
    """Ragged prompts (1..19 tokens): more prompts than rows, some answers end at EOS, some at the budget."""
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(3, 64, size=int(n)).tolist()) for n in rng.integers(1, 20, size=N_PROMPTS)]


SETTINGS = RefillSettings(layer_ids=TAPS, eos_ids=EOS, max_new_tokens=MAX_NEW, max_prompt_tokens=MAX_PROMPT, rows=4,
                          steps=5, refill_min=1, max_refill=4, prompt_multiple=8)
FRACTION, TEMP, SEED = 0.5, 0.9, 0


def _jobs(prompts):
    keys = prompt_keys(SEED, range(len(prompts)))
    return [Job(i, p, datagen.temperature_of(i, FRACTION, TEMP), keys[i]) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def answers(target, prompts):
    stats = RefillStats()
    out = {a.index: a for a in generate_answers(target, _jobs(prompts), SETTINGS, stats)}
    assert stats.refill_calls > 1 and stats.answers == N_PROMPTS  # rows were refilled
    return out


def test_answers_equal_autoregressive(target, prompts, answers):
    """Greedy rows equal greedy `generate_autoregressive`; sampled rows equal its sampled rows (prompt i draws from
    fold_in(key(seed), i), as its row i does)."""
    greedy = generate_autoregressive(target, list(prompts), max_new_tokens=MAX_NEW, eos_ids=EOS)
    sampled = generate_autoregressive(target, list(prompts), max_new_tokens=MAX_NEW, eos_ids=EOS, temperature=TEMP,
                                      seed=SEED)
    reasons = set()
    for i, p in enumerate(prompts):
        ref = sampled if datagen.temperature_of(i, FRACTION, TEMP) else greedy
        a = answers[i]
        assert a.prompt_len == len(p) and tuple(a.tokens[:len(p)]) == p
        assert a.tokens[len(p):].tolist() == ref.token_lists()[i], f"prompt {i}"
        reasons.add(ref.finish_reason[i])
    assert reasons == {"eos", "length"}


def test_features_equal_target_forward(target, answers):
    for a in answers.values():
        _, f = target_forward(target, a.tokens[None], TAPS)
        assert a.features.dtype == np.float16 and a.features.shape == (len(a.tokens), 2 * 32)
        np.testing.assert_allclose(a.features.astype(np.float32), np.asarray(f[0]), atol=2e-3, rtol=2e-3)


def _spec(target, **changes) -> DataSpec:
    spec = DataSpec(target_fingerprint=target_fingerprint(target), layer_ids=TAPS, hidden_size=32, vocab_size=64,
                    vocabulary="v0", block_size=8, max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW,
                    eos_ids=EOS, sampled_fraction=FRACTION, temperature=TEMP, seed=SEED)
    return dataclasses.replace(spec, **changes)


def _run(target, work, prompts, **kw):
    spec = kw.pop("spec", None) or _spec(target)
    return datagen.run(target, work, spec, SETTINGS, source={"kind": "test"}, prompts=list(prompts),
                       shard_answers=kw.pop("shard_answers", 3), log=lambda m: None, **kw)


def _check_dataset(data, prompts, answers, n):
    assert data["tokens"].shape == (n, MAX_PROMPT + MAX_NEW) and data["features"].shape == (n, 32, 64)
    assert data["prompt_index"].tolist() == list(range(n))
    feats = data["features"][np.arange(n)]  # as `make_batch_fn` indexes it
    for i in range(n):
        a, L = answers[i], int(data["lengths"][i])
        assert L == len(a.tokens) and data["prompt_lens"][i] == len(prompts[i])
        assert data["tokens"][i, :L].tolist() == a.tokens.tolist() and not data["tokens"][i, L:].any()
        # equal up to float rounding: a resumed run groups the rows of a refill or a step differently
        np.testing.assert_allclose(feats[i, :L].astype(np.float32), a.features.astype(np.float32), atol=1e-3)
        assert not feats[i, L:].any()


def test_shards_append_and_read_back(target, prompts, answers, tmp_path):
    rec = _run(target, tmp_path, prompts, limit=5)
    assert rec["answers"] == 5 and len(shards.shard_dirs(tmp_path)) == 2  # 3 + 2
    _check_dataset(shards.read_dataset(tmp_path), prompts, answers, 5)
    rec = _run(target, tmp_path, prompts)  # appends the rest: resumes where the queue stopped
    assert (rec["done_before"], rec["todo"], rec["answers"]) == (5, N_PROMPTS - 5, N_PROMPTS - 5)
    data = shards.read_dataset(tmp_path, spec=_spec(target))
    _check_dataset(data, prompts, answers, N_PROMPTS)
    assert _run(target, tmp_path, prompts)["answers"] == 0  # nothing left: no prompt twice
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["totals"]["answers"] == N_PROMPTS and len(man["runs"]) == 3 and len(man["sources"]) == 1
    # a source with more prompts extends the queue with the new ones only
    more = list(prompts) + [(9, 9, 9)]
    assert _run(target, tmp_path, more)["answers"] == 1
    assert len(shards.read_queue(tmp_path)) == N_PROMPTS + 1


def test_bad_inputs_refused_by_name(target, prompts, tmp_path):
    _run(target, tmp_path, prompts[:4], shard_answers=2)
    for change, name in [(dict(layer_ids=(0, 3)), "tap layer ids"), (dict(block_size=16), "block size"),
                         (dict(vocabulary="v1"), "vocabulary"), (dict(target_fingerprint="0" * 16), "target")]:
        with pytest.raises(DataError, match=name):
            _run(target, tmp_path, prompts, spec=_spec(target, **change))
        with pytest.raises(DataError, match=name):
            shards.read_dataset(tmp_path, spec=_spec(target, **change))
        with pytest.raises(DataError, match=name):  # a trainer's check of the fields it cares about
            shards.read_dataset(tmp_path, **change)
    first, second = shards.shard_dirs(tmp_path)
    # a shard from another target
    meta = json.loads((second / "meta.json").read_text())
    (second / "meta.json").write_text(json.dumps(dict(meta, target_fingerprint="f" * 16)))
    with pytest.raises(DataError, match=f"shard {second.name} .* another target"):
        shards.read_dataset(tmp_path)
    with pytest.raises(DataError, match=f"shard {second.name} .* another target"):
        _run(target, tmp_path, prompts)
    (second / "meta.json").write_text(json.dumps(meta))
    # a truncated shard
    feats = first / "features.npy"
    feats.write_bytes(feats.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"shard {first.name} .* truncated: features.npy"):
        shards.read_dataset(tmp_path)
    with pytest.raises(DataError, match=f"shard {first.name} .* truncated"):
        _run(target, tmp_path, prompts)
    shutil.rmtree(first)  # deleting it: its prompts are done again
    assert _run(target, tmp_path, prompts[:4])["answers"] == 2
    assert shards.read_dataset(tmp_path)["prompt_index"].tolist() == [0, 1, 2, 3]


def test_killed_run_resumes(target, prompts, answers, tmp_path, monkeypatch):
    """A run killed while writing its second shard: the first shard and nothing else survives (the half-written
    shard is discarded, the answers in flight are dropped); the work dir reads; the rerun completes it exactly."""
    real = shards.write_shard

    def dies_in_second(work, number, batch, spec):
        if number == 1:
            tmp = work / f"shard_{number:05d}.partial"
            tmp.mkdir()
            (tmp / "tokens.npy").write_bytes(b"\x93NUMPY half")
            raise KeyboardInterrupt  # as kill -9 would leave it, minus the process
        return real(work, number, batch, spec)

    monkeypatch.setattr(shards, "write_shard", dies_in_second)
    with pytest.raises(KeyboardInterrupt):
        _run(target, tmp_path, prompts)
    monkeypatch.setattr(shards, "write_shard", real)
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == ["shard_00000", "shard_00001.partial"]
    assert len(shards.read_dataset(tmp_path)["tokens"]) == 3
    rec = _run(target, tmp_path, prompts)
    assert rec["done_before"] == 3 and rec["answers"] == N_PROMPTS - 3
    assert not list(tmp_path.glob("*.partial"))
    data = shards.read_dataset(tmp_path)
    assert sorted(data["prompt_index"].tolist()) == list(range(N_PROMPTS))
    _check_dataset(data, prompts, answers, N_PROMPTS)
