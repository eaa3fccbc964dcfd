"""The training commands end to end on tiny shapes: bad inputs get clear messages, and an interrupted run resumes
exactly where it stopped (same parameters as an uninterrupted run)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dflash_jax.io.checkpoint import load_target
from dflash_jax.train import target as train_target

TINY = ["--no-packages", "--steps", "6", "--batch", "2", "--seq-len", "32", "--long-seq-len", "64",
        "--long-fraction", "0.5", "--layers", "1", "--hidden", "64", "--intermediate", "64", "--heads", "1",
        "--kv-heads", "1", "--eval-every", "1000", "--ckpt-every", "1"]


def _run(tmp, name, extra=()):
    out = tmp / name
    train_target.main(TINY + ["--work-dir", str(tmp / "work"), "--out", str(out)] + list(extra))
    return load_target(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    return _run(tmp, "out")


def test_interrupted_run_resumes_to_the_same_parameters(tmp_path, monkeypatch, uninterrupted):
    calls = {"n": 0}
    real = train_target.mixed_windows

    def flaky(*a, **k):  # the process dies while building the 5th batch (after checkpoint 4)
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_target, "mixed_windows", flaky)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "out")
    monkeypatch.setattr(train_target, "mixed_windows", real)
    resumed = _run(tmp_path, "out")
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["long_from_step"] == 3 and report["steps"] == 6
    for x, y in zip(jax.tree.leaves(uninterrupted.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_tokenizer_without_mask_token_says_what_to_do(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models
    hf = HF(models.BPE())
    hf.add_special_tokens(["<|endoftext|>"])
    bad = tmp_path / "tok.json"
    hf.save(str(bad))
    with pytest.raises(SystemExit, match=r"mask.*train a tokenizer"):
        train_target.main(TINY + ["--tokenizer", str(bad), "--work-dir", str(tmp_path / "w"),
                                  "--out", str(tmp_path / "o")])


def test_missing_tokenizer_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="no tokenizer at"):
        train_target.main(TINY + ["--tokenizer", str(tmp_path / "none.json"), "--work-dir", str(tmp_path / "w"),
                                  "--out", str(tmp_path / "o")])


def test_corpus_extra_missing_says_what_to_do(tmp_path, monkeypatch):
    from dflash_jax.train import corpus
    monkeypatch.setattr(corpus, "CORPUS_PACKAGES", {"surely-not-an-installed-distribution": "1.0"})
    args = [a for a in TINY if a != "--no-packages"]
    with pytest.raises(SystemExit, match=r"not installed.*\[corpus\]"):
        train_target.main(args + ["--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
