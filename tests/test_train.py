"""The trainers on tiny configs: losses fall, and the drafter's training forward is exactly its inference forward."""

import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.train import drafter as td, drafter_data as tdd, drafter_loss as tdl
from dflash_jax.train.loop import OptimConfig, run
from dflash_jax.train.target import lm_loss, random_windows
from helpers import inference_at_anchors, training_batch

CFG = dj.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0)


def test_target_training_loss_falls():
    rng = np.random.default_rng(0)
    # A learnable stream: a repeated random "vocabulary" of 8-token phrases.
    phrases = rng.integers(0, 64, (12, 8))
    stream = phrases[rng.integers(0, 12, 800)].ravel().astype(np.int32)
    params = dj.init_target(CFG, jax.random.key(0)).params
    _, hist = run(params=params, loss_fn=lm_loss(CFG),
                  batch_fn=lambda s: jnp.asarray(random_windows(stream, 8, 33, np.random.default_rng(s))),
                  optim=OptimConfig(steps=60, lr=3e-3), ckpt_dir=tempfile.mkdtemp(), ckpt_every=10 ** 9,
                  desc="tiny-target")
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"], (hist[0]["loss"], hist[-1]["loss"])


def test_training_resumes_from_checkpoint(tmp_path):
    stream = np.arange(2000, dtype=np.int32) % 64
    params = dj.init_target(CFG, jax.random.key(0)).params
    kw = dict(loss_fn=lm_loss(CFG), ckpt_dir=tmp_path, ckpt_every=5,
              batch_fn=lambda s: jnp.asarray(random_windows(stream, 4, 17, np.random.default_rng(s))))
    straight, _ = run(params=params, optim=OptimConfig(steps=10, lr=1e-3), **kw, desc="a")
    # a second run with the same directory resumes at step 10 and has nothing left to do
    again, hist = run(params=params, optim=OptimConfig(steps=10, lr=1e-3), **kw, desc="b")
    assert hist == []
    chex_equal = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), straight, again)
    assert all(jax.tree.leaves(chex_equal))


class Interrupted(Exception):
    pass


def test_training_resumes_after_an_interruption_mid_run(tmp_path, capsys):
    """A run killed at step 7 (checkpoints every 3 steps) and started again resumes from its step-6 checkpoint and ends
    with exactly the parameters of an uninterrupted run: params, optimizer state (Adam moments, step count of the
    schedule) and the batch sequence all come back."""
    stream = np.arange(2000, dtype=np.int32) % 64
    params = dj.init_target(CFG, jax.random.key(0)).params
    batches = lambda s: jnp.asarray(random_windows(stream, 4, 17, np.random.default_rng(s)))
    kw = dict(params=params, loss_fn=lm_loss(CFG), optim=OptimConfig(steps=10, lr=1e-3), ckpt_every=3)
    straight, _ = run(batch_fn=batches, ckpt_dir=tmp_path / "straight", desc="straight", **kw)

    seen, raised = [], []

    def flaky(step):
        seen.append(step)
        if step == 7 and not raised:
            raised.append(step)
            raise Interrupted(f"killed at step {step}")
        return batches(step)

    with pytest.raises(Interrupted):
        run(batch_fn=flaky, ckpt_dir=tmp_path / "resumed", desc="first", **kw)
    assert seen == list(range(8))
    seen.clear()
    capsys.readouterr()
    resumed, _ = run(batch_fn=flaky, ckpt_dir=tmp_path / "resumed", desc="second", **kw)
    assert "[second] resumed from step 6" in capsys.readouterr().out
    assert seen == [6, 7, 8, 9]  # steps 6 and 7 redone from the checkpoint, nothing skipped
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), straight, resumed)
    assert all(jax.tree.leaves(same)), "resumed run differs from the uninterrupted one"
    moved = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, resumed)
    assert not all(jax.tree.leaves(moved))  # and training did something


def test_sample_anchors():
    rng = np.random.default_rng(0)
    lengths = np.array([40, 12, 9])
    plens = np.array([10, 10, 9])
    anchors, keep = tdd.sample_anchors(lengths, plens, 6, rng)
    assert anchors.shape == keep.shape == (3, 6)
    a0 = anchors[0][keep[0]]
    assert len(a0) == 6 and np.all(np.diff(a0) > 0) and a0.min() >= 10 and a0.max() <= 38
    assert keep[1].sum() == 1 and anchors[1][keep[1]][0] == 10  # only position 10 has a label after it
    assert keep[2].sum() == 0  # no continuation at all


@pytest.fixture(scope="module")
def tiny_pair():
    target = dj.init_target(CFG, jax.random.key(0))
    dcfg = dj.DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=6, mask_token_id=63,
                            target_layer_ids=(1, 2), num_target_layers=4)
    drafter = dj.init_drafter(dcfg, jax.random.key(1))
    return target, drafter


def test_training_forward_equals_inference_forward(tiny_pair):
    """Pins the three known DFlash training pitfalls: same-position labels, context strictly before the anchor,
    and no attention between blocks: training logits for anchor a equal inference's draft_logits there."""
    target, drafter = tiny_pair
    cfg = drafter.config
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 63, (2, 30)).astype(np.int32)
    anchors = np.array([[3, 4, 11, 20], [5, 12, 13, 24]], np.int32)
    batch = training_batch(target, tokens, [30, 26], anchors)
    logits = tdl.training_logits(drafter.params, batch, cfg, target.config)
    for b, n, ref in inference_at_anchors(target, drafter, tokens, anchors, dj.draft_logits):
        np.testing.assert_allclose(np.asarray(logits[b, n]), np.asarray(ref[0]), atol=2e-5, rtol=2e-5)
    labels, valid = tdl.training_labels(batch, cfg.block_size)
    assert int(labels[0, 0, 0]) == tokens[0, 4] and int(labels[0, 0, 4]) == tokens[0, 8]  # slot k -> x_{a+k}
    assert not bool(valid[1, 3, 2])  # 24 + 3 >= length 26 is out of the sequence


def test_drafter_training_loss_falls_and_accepts(tiny_pair):
    target, drafter = tiny_pair
    cfg = drafter.config
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 63, rng.randint(3, 10))) for _ in range(48)]
    data = tdd.make_sequences(target, prompts, max_new_tokens=30, seq_len=40, batch=48)
    assert data["tokens"].shape == (48, 40) and np.all(data["lengths"] > data["prompt_lens"])
    params, hist = run(params=drafter.params, loss_fn=tdl.drafter_loss(cfg, target.config),
                       batch_fn=tdd.make_batch_fn(data, target.params, batch=8, num_anchors=8, seed=0),
                       optim=OptimConfig(steps=150, lr=3e-3), ckpt_dir=tempfile.mkdtemp(), ckpt_every=10 ** 9,
                       desc="tiny-drafter")
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.2, (hist[0]["loss"], hist[-1]["loss"])
    trained = drafter.replace(params=params)
    before = dj.generate(target, drafter, prompts[:6], max_new_tokens=30)
    after = dj.generate(target, trained, prompts[:6], max_new_tokens=30)
    assert after.tau > before.tau
    np.testing.assert_array_equal(after.tokens, before.tokens)  # lossless either way


def test_loss_over_the_data_vocabulary_is_the_full_softmax_restricted_to_it(tiny_pair):
    """--loss-vocab data: the loss equals cross-entropy over the full head's logits at the data's tokens only
    (computed here from the full training logits); over the whole vocabulary it equals the full loss; labels are
    mapped, not dropped (every label occurs in the data)."""
    target, drafter = tiny_pair
    cfg = drafter.config
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 20, (2, 30)).astype(np.int32)  # only ids < 20 occur
    tokens[1, 26:] = 50  # past the length: not data
    anchors = np.array([[3, 4, 11, 20], [5, 12, 13, 17]], np.int32)
    batch = training_batch(target, tokens, [30, 26], anchors)
    vocab = tdl.loss_vocabulary({"tokens": tokens, "lengths": np.array([30, 26])})
    np.testing.assert_array_equal(vocab, np.unique(tokens[:, :26]))
    assert 50 not in vocab
    with_low = tdl.loss_vocabulary({"tokens": tokens, "lengths": np.array([30, 26])}, first_ids=30)
    np.testing.assert_array_equal(with_low, np.arange(30))  # ids 0..29 plus the data's (all < 20)
    full = tdl.training_logits(drafter.params, batch, cfg, target.config)  # [B, N, bs-1, V]
    labels, valid = tdl.training_labels(batch, cfg.block_size)
    sub = full[..., vocab]
    sub_labels = np.searchsorted(vocab, np.asarray(labels))
    logp = jax.nn.log_softmax(sub, axis=-1)
    ce = -np.take_along_axis(np.asarray(logp), sub_labels[..., None], axis=-1)[..., 0]
    w = np.exp(-np.arange(cfg.block_size - 1) / tdl.decay_gamma(cfg.block_size))[None, None] * np.asarray(valid)
    expected = (w * ce).sum() / (w.sum() + 1e-6)
    loss, metrics = tdl.drafter_loss(cfg, target.config, vocab_ids=vocab)(drafter.params, batch)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    everything = tdl.drafter_loss(cfg, target.config, vocab_ids=np.arange(cfg.model.vocab_size))(drafter.params, batch)
    np.testing.assert_allclose(float(everything[0]), float(tdl.drafter_loss(cfg, target.config)(drafter.params, batch)[0]),
                               rtol=1e-6)
    assert float(loss) < float(everything[0])  # a smaller softmax: the same labels are likelier


def test_decay_gamma():
    assert tdl.decay_gamma(16) == 7.0 and tdl.decay_gamma(10) == 5.0 and tdl.decay_gamma(8) == 4.0


def test_warm_start_copies_a_drafter_of_the_same_layout_and_names_a_misfit(tiny_pair):
    """train-drafter --init-from: every tensor comes from the source drafter; a drafter of another layout is refused
    with the tensor named, before any training."""
    _, drafter = tiny_pair
    cfg = drafter.config
    fresh = dj.init_drafter(cfg, jax.random.key(7)).params
    started = td.warm_start(cfg, fresh, drafter, exact=True)
    chex.assert_trees_all_equal(started, drafter.params)
    deeper = cfg.replace(model=cfg.model.replace(num_hidden_layers=2))
    with pytest.raises(ValueError, match="lacks"):
        td.warm_start(deeper, dj.init_drafter(deeper, jax.random.key(7)).params, drafter, exact=True)
    wider = cfg.replace(model=cfg.model.replace(intermediate_size=32))
    with pytest.raises(ValueError, match="does not fit this dflash drafter"):
        td.warm_start(wider, dj.init_drafter(wider, jax.random.key(7)).params, drafter, exact=True)


def test_grow_starts_a_deeper_drafter_as_exactly_the_source_and_trains_the_added_layer(tiny_pair):
    """train-drafter --init-from X --grow: X's layers fill the bottom, each added layer starts as the identity, so the
    grown drafter drafts exactly what X drafts; its added layer still gets gradients (zero residual outputs only)."""
    target, drafter = tiny_pair
    cfg = drafter.config
    have = cfg.model.num_hidden_layers
    deeper = cfg.replace(model=cfg.model.replace(num_hidden_layers=have + 1))
    grown = dj.Drafter(params=td.warm_start(deeper, dj.init_drafter(deeper, jax.random.key(7)).params, drafter,
                                            exact=True, grow=True), config=deeper)
    chex.assert_trees_all_equal(grown.params.layers[:have], drafter.params.layers)
    assert not np.any(np.asarray(grown.params.layers[have].self_attn.o_proj))
    assert np.any(np.asarray(grown.params.layers[have].self_attn.q_proj))  # the rest is fresh, not zero
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (1, 12), 0, target.config.vocab_size))
    _, feats = dj.target_forward(target, tokens, cfg.target_layer_ids)
    block = np.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = tokens[0, 8]
    np.testing.assert_allclose(np.asarray(dj.draft_logits(target, grown, feats[:, :8], block)),
                               np.asarray(dj.draft_logits(target, drafter, feats[:, :8], block)), rtol=1e-6, atol=1e-6)

    def loss(params):
        return jnp.sum(dj.draft_logits(target, grown.replace(params=params), feats[:, :8], block)[..., :7] ** 2)
    g = jax.grad(loss)(grown.params)
    assert np.any(np.asarray(g.layers[have].self_attn.o_proj)) and np.any(np.asarray(g.layers[have].mlp.down_proj))
    with pytest.raises(ValueError, match="not fewer than --layers"):
        td.warm_start(cfg, dj.init_drafter(cfg, jax.random.key(7)).params, drafter, exact=True, grow=True)


def test_target_fingerprint_names_weights_and_config(tiny_pair):
    """The data cache's target stamp: equal for the same target, different when a weight or a config value differs."""
    target, _ = tiny_pair
    fp = tdd.target_fingerprint(target)
    assert fp == tdd.target_fingerprint(target.replace(params=jax.tree.map(lambda x: x + 0, target.params)))
    assert fp != tdd.target_fingerprint(target.replace(config=target.config.replace(rope_theta=12345.0)))
    bumped = jax.tree.map(lambda x: x, target.params)
    bumped = bumped.__class__(**{**bumped.__dict__, "norm": bumped.norm + 1e-3})
    assert fp != tdd.target_fingerprint(target.replace(params=bumped))
