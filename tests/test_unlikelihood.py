"""Sequence-level unlikelihood fine-tuning (dflash_jax/train/unlikelihood.py) on a tiny target: the repeat mask marks
exactly the tokens of repeated n-grams, a step lowers their probability, the batch is the model's own greedy
continuation (a pure function of the step and the weights, so resume is exact), and bad options are named."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dflash_jax as dj
from dflash_jax.train import unlikelihood as ul
from dflash_jax.train.loop import OptimConfig, make_optimizer
from dflash_jax.train.target import main as train_target_main

CFG = dj.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0)


def test_repeat_mask_marks_every_token_of_a_repeated_ngram_after_the_prefix():
    #            prefix | continuation
    row = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 9, 9, 9]
    mask = ul.repeat_mask(np.asarray([row]), prefix_len=4, n=3)
    # (1,2,3) repeats at 5..7; (9,9,9) first occurs at 8..10 and repeats at 9..11 and 10..12.
    want = [0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(mask[0].astype(int), want)
    # A repeat inside the prefix alone is not the model's doing: nothing is marked.
    assert not ul.repeat_mask(np.asarray([[7, 8, 7, 8, 1, 2]]), prefix_len=4, n=2).any()
    # Only the generated part of a repeat that straddles the boundary is marked.
    np.testing.assert_array_equal(ul.repeat_mask(np.asarray([[5, 6, 5, 6]]), prefix_len=3, n=2)[0].astype(int),
                                  [0, 0, 0, 1])
    with pytest.raises(ValueError, match="batch, length"):
        ul.repeat_mask(np.asarray(row), prefix_len=4)


def _batch(params, prefix_len=4, new_tokens=12, seed=0):
    rng = np.random.default_rng(seed)
    text_batch = lambda step: rng.integers(0, 64, (2, 17))
    prefixes = lambda r: r.integers(0, 64, (3, prefix_len))
    fn = ul.make_batch_fn(CFG, text_batch, prefixes, prefix_len=prefix_len, new_tokens=new_tokens, ngram=2, seed=0)
    return fn(0, params)


def test_batch_is_the_models_own_greedy_continuation():
    params = dj.init_target(CFG, jax.random.key(0)).params
    b = _batch(params)
    chex.assert_shape(b["generated"], (3, 16))
    chex.assert_shape(b["repeated"], (3, 16))
    rows = np.asarray(b["generated"])
    ar = dj.generate_autoregressive(dj.Target(params=params, config=CFG), rows[:, :4].tolist(), max_new_tokens=12)
    np.testing.assert_array_equal(rows[:, 4:], np.asarray(ar.token_lists()))
    np.testing.assert_array_equal(np.asarray(b["repeated"]), ul.repeat_mask(rows, 4, 2))
    assert not np.asarray(b["generated_positions"])[:, :4].any() and np.asarray(b["generated_positions"])[:, 4:].all()
    # Same step, same weights: the same batch (what resuming from a checkpoint relies on).
    again = _batch(params)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, b), jax.tree.map(np.asarray, again))


def test_steps_lower_the_probability_of_repeated_tokens_only_where_marked():
    params = dj.init_target(CFG, jax.random.key(1)).params
    b = _batch(params)
    assert np.asarray(b["repeated"]).any(), "a random tiny model should loop in 12 greedy tokens"
    loss_fn = ul.unlikelihood_loss(CFG, weight=10.0)
    tx = make_optimizer(OptimConfig(steps=20, lr=3e-3, warmup_ratio=0.0))

    def repeated_p(p):
        logits = dj.target_forward(dj.Target(params=p, config=CFG), b["generated"][:, :-1])[0]
        probs = jax.nn.softmax(logits, -1)
        pt = jnp.take_along_axis(probs, b["generated"][:, 1:, None], -1)[..., 0]
        m = b["repeated"][:, 1:]
        return float((pt * m).sum() / m.sum())

    @jax.jit
    def step(p, s):
        grads = jax.grad(lambda q: loss_fn(q, b)[0])(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    before, state = repeated_p(params), tx.init(params)
    for _ in range(20):
        params, state = step(params, state)
    after = repeated_p(params)
    assert after < 0.5 * before, (before, after)
    _, metrics = loss_fn(params, b)
    assert 0.0 < float(metrics["repeated_fraction"]) <= 1.0 and np.isfinite(float(metrics["lm_loss"]))


def test_bad_fine_tuning_options_are_named(tmp_path):
    with pytest.raises(SystemExit, match="--unlikelihood must be >= 0"):
        train_target_main(["--unlikelihood", "-1", "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w")])
    with pytest.raises(SystemExit, match="--ul-batch"):
        train_target_main(["--unlikelihood", "1", "--ul-new-tokens", "0", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="no such folder"):
        train_target_main(["--init-from", str(tmp_path / "missing"), "--no-packages", "--steps", "1",
                           "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w")])


def test_init_from_a_target_of_another_tokenizer_is_refused(tmp_path):
    from dflash_jax.io.shipped import checkpoints_dir
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.train.target import load_init_target
    tok = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    dj.save(tmp_path / "t", dj.init_target(CFG, jax.random.key(0)))
    with pytest.raises(SystemExit, match="another tokenizer"):
        load_init_target(tmp_path / "t", tok)


def test_fine_tune_command_end_to_end(tmp_path):
    """`train-target --init-from X --unlikelihood W` starts from X's weights and shape, trains on both losses, and
    reports the held-out repetition it is for."""
    import json

    from dflash_jax.io.shipped import checkpoints_dir
    from dflash_jax.io.tokenizer import Tokenizer
    tok = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    small = CFG.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    start = dj.init_target(small, jax.random.key(0))
    dj.save(tmp_path / "start", start)
    train_target_main(["--init-from", str(tmp_path / "start"), "--unlikelihood", "1", "--steps", "2", "--batch", "2",
                       "--seq-len", "32", "--long-fraction", "0", "--ul-batch", "2", "--ul-prefix", "8",
                       "--ul-new-tokens", "8", "--eval-every", "0", "--no-packages",
                       "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")])
    report = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert report["unlikelihood"] == 1.0 and report["init_from"] == str(tmp_path / "start")
    assert 0.0 <= report["seq_rep_4"] <= 1.0 and np.isfinite(report["heldout_loss"])
    tuned = dj.load_target(tmp_path / "out")
    assert tuned.config.num_hidden_layers == 2 and tuned.config.hidden_size == 32  # the start's shape, not defaults
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(start.params), jax.tree.leaves(tuned.params)))
