"""dflash_jax.bench.quality: the repetition metric, the hand-written set and the loss helpers."""

import ast
import math

import numpy as np
import pytest

from dflash_jax.bench import quality
from dflash_jax.config import TargetConfig
from dflash_jax.models.target import target_forward

from random_models import make_target


def test_seq_rep_n_counts_repeated_ngrams():
    assert quality.seq_rep_n(list(range(50))) == 0.0
    assert quality.seq_rep_n([7] * 20) == pytest.approx(1 - 1 / 17)
    loop = [5, 6, 7] * 10  # 27 4-grams, 3 distinct
    assert quality.seq_rep_n(loop) == pytest.approx(1 - 3 / 27)
    assert quality.seq_rep_n([1, 2, 3]) == 0.0  # shorter than n: no n-gram, no repetition
    assert quality.seq_rep_n([1, 2, 1, 2], n=2) == pytest.approx(1 - 2 / 3)


def test_handwritten_set_is_valid_python_and_not_repetitive():
    texts = quality.handwritten_texts()
    assert len(texts) == len(quality.HANDWRITTEN) >= 16
    assert len({p for p, _ in quality.HANDWRITTEN}) == len(quality.HANDWRITTEN)
    for (prompt, body), (p2, full) in zip(quality.HANDWRITTEN, texts):
        assert p2 == prompt and full.startswith(prompt) and full.endswith(body)
        ast.parse(full)  # every prompt + solution is a complete, valid definition
    # The solutions' own repetition, on characters as a stand-in for tokens: far from a loop.
    reps = [quality.seq_rep_n([ord(c) for c in full], 8) for _, full in texts]
    assert float(np.median(reps)) < 0.2


def test_text_loss_is_the_mean_next_token_nll():
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    target = make_target(cfg, seed=3, std=0.02)

    class ByteTok:
        def encode(self, text):
            return [ord(c) % 64 for c in text]

    texts = ["def f(x):\n    return x\n", "abc"]
    got = quality.text_loss(target, ByteTok(), texts)
    total, count = 0.0, 0
    for t in texts:
        ids = ByteTok().encode(t)
        logits = np.asarray(target_forward(target, np.asarray([ids], np.int32))[0][0], np.float64)[:-1]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    assert got == pytest.approx(total / count, rel=1e-5)
    assert abs(got - math.log(64)) < 0.5  # a near-identity random model is close to uniform


def test_format_report_names_every_figure():
    r = {"heldout_loss_256": 2.5, "heldout_loss_1024": 2.3, "heldout_loss_256_no_codecs": 2.9,
         "handwritten_loss": 3.1, "seq_rep_4_handwritten_solutions": 0.05,
         "seq_rep_4_heldout": {"median": 0.2, "per_prompt": [0.2] * 16},
         "seq_rep_4_handwritten": {"median": 0.1, "per_prompt": [0.1] * 16,
                                   "texts": ["    return 1\n"] * 16}}
    text = quality.format_report(r, show=1)
    for needle in ("2.500", "2.300", "2.900", "3.100", "0.200", "0.100", "0.050", quality.HANDWRITTEN[0][0].rstrip("\n")):
        assert needle in text


def test_text_loss_of_padded_batch_equals_each_text_alone():
    """text_loss runs all texts in one right-padded forward; padding must change no text's loss."""
    import jax

    import dflash_jax as dj

    cfg = dj.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    target = dj.init_target(cfg, jax.random.key(0))

    class Chars:  # a tokenizer: one id per character
        @staticmethod
        def encode(text):
            return [ord(c) % 64 for c in text]

    texts = ["def f(x):\n    return x + 1\n", "ab", "import os\n"]
    alone = [(quality.text_loss(target, Chars, [t]), len(t) - 1) for t in texts]
    want = sum(loss * n for loss, n in alone) / sum(n for _, n in alone)
    assert quality.text_loss(target, Chars, texts) == pytest.approx(want, rel=1e-5)
