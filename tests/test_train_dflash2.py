"""The DFlash2 trainer on tiny configs: its training forward is the inference forward (conv block boundaries,
sliding windows, context strictly before the anchor), the selector loss is teacher-forced over the top-k with
out-of-top-k slots left out, the loss falls and tau rises, NVFP4 keeps acceptance while dropping only the conv and
selector tensor scales collapses it (measured here), and the CLI trains end to end and resumes."""

import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.models import selector as sel_mod
from dflash_jax.models.drafter import draft_proposal
from dflash_jax.params import abstract_drafter
from dflash_jax.quant.quantize import DFLASH2_PROJECTIONS, drop_global_scales, quantize_nvfp4
from dflash_jax.train import drafter_data as tdd, drafter_loss as tdl
from dflash_jax.train import drafter2 as td2
from dflash_jax.train.loop import OptimConfig, run
from random_models import nontrivial_dflash2, random_params
from helpers import inference_at_anchors, training_batch

CFG = dj.TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0)
DCFG = dj.DrafterConfig(model=CFG.replace(num_hidden_layers=2), block_size=6, mask_token_id=63,
                        target_layer_ids=(1, 2), num_target_layers=4, kind="dflash2", conv_group_size=8,
                        selector_rank=8, selector_top_k=8, is_causal=False)


def test_training_forward_equals_inference_forward_dflash2():
    """Training logits and teacher-forced slot-1 selector scores for anchor a equal inference's draft_proposal on
    context [:a] (random non-trivial conv and selector; a causal sliding layer with a window shorter than the
    context, then a full layer): the conv never reaches into the neighbouring block of the same sequence."""
    cfg = DCFG.replace(layer_types=("sliding_attention", "full_attention"), sliding_window=5, is_causal=None,
                       output_multiplier=0.6, final_logit_softcapping=3.0, input_embedding_scale=1.2)
    target = dj.init_target(CFG, jax.random.key(0))
    drafter = dj.Drafter(params=nontrivial_dflash2(random_params(abstract_drafter(cfg), 1, std=0.1), 2), config=cfg)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 63, (2, 30)).astype(np.int32)
    anchors = np.array([[3, 4, 11, 20], [5, 11, 13, 23]], np.int32)  # adjacent / overlapping blocks included
    batch = training_batch(target, tokens, [30, 26], anchors)
    h, _ = tdl.training_hidden(drafter.params, batch, cfg, target.config)
    logits = tdl.training_logits(drafter.params, batch, cfg, target.config)
    scores, idx, usable = td2.selector_terms(drafter.params, h, logits, batch, cfg)
    for b, n, ref in inference_at_anchors(target, drafter, tokens, anchors, draft_proposal):
        np.testing.assert_allclose(np.asarray(logits[b, n]), np.asarray(ref.logits[0]), atol=3e-5, rtol=3e-5)
        np.testing.assert_allclose(np.asarray(scores[b, n, 0]), np.asarray(ref.scores[0, 0]), atol=3e-5,
                                   rtol=3e-5)  # slot 1: both walk from the anchor


def test_selector_terms_teacher_forcing_and_out_of_topk_slots():
    """Slot t's predecessor is the true token x_{a+t-1}; the target index is the true token's place among the
    top-k; slots whose true token is not a candidate (or out of the sequence) are not usable."""
    cfg = DCFG.replace(selector_top_k=3)
    target = dj.init_target(CFG, jax.random.key(0))
    params = nontrivial_dflash2(random_params(abstract_drafter(cfg), 1, std=0.1), 2)
    tokens = np.arange(20, dtype=np.int32)[None] * 3 % 63  # x_p = 3p mod 63
    batch = training_batch(target, tokens, [12], [[4, 8]])
    D, k = cfg.block_size - 1, 3
    labels = tokens[0, np.array([[4, 8]]).T + np.arange(1, D + 1)]  # [N, D]
    logits = np.full((1, 2, D, 64), -5.0, np.float32)
    logits[0, :, :, 1:4] = [3.0, 2.0, 1.0]  # candidates {1, 2, 3} unless the label is boosted
    boost = [(0, 0), (0, 2), (1, 1)]  # (anchor, slot) where the true token is the 2nd candidate
    for n, t in boost:
        logits[0, n, t, labels[n, t]] = 2.5
    h = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, D, CFG.hidden_size)), jnp.float32)
    scores, idx, usable = td2.selector_terms(params, h, jnp.asarray(logits), batch, cfg)
    want_usable = np.zeros((2, D), bool)
    for n, t in boost:
        want_usable[n, t] = True
    want_usable[1, 3:] = False  # 8 + 4 >= length 12: out of the sequence
    np.testing.assert_array_equal(np.asarray(usable[0]), want_usable)
    for n, t in boost:
        assert int(idx[0, n, t]) == 1  # sorted candidates: [3.0 token 1, 2.5 label, 2.0 token 2]
        prev = tokens[0, [4, 8][n] + t]  # x_{a+t-1} with t counted from 0 here
        unary, cand = sel_mod.candidates(jnp.asarray(logits[:, n, t:t + 1]), k)
        pair = sel_mod.pair_scores(params.candidate_selector, h[:, n, t:t + 1], jnp.asarray([[[prev]]]), cand)
        np.testing.assert_allclose(np.asarray(scores[0, n, t]), np.asarray(unary + pair[:, :, 0])[0, 0], rtol=1e-5)


@pytest.fixture(scope="module")
def trained():
    target = dj.init_target(CFG, jax.random.key(0))
    drafter = dj.init_drafter(DCFG, jax.random.key(1))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, 63, rng.randint(3, 10))) for _ in range(48)]
    data = tdd.make_sequences(target, prompts, max_new_tokens=30, seq_len=40, batch=48)
    params, hist = run(params=drafter.params, loss_fn=td2.drafter2_loss(DCFG, target.config),
                       batch_fn=tdd.make_batch_fn(data, target.params, batch=8, num_anchors=8, seed=0),
                       optim=OptimConfig(steps=150, lr=3e-3), ckpt_dir=tempfile.mkdtemp(), ckpt_every=10 ** 9,
                       desc="tiny-drafter2")
    return target, drafter, drafter.replace(params=params), prompts, hist


def test_dflash2_training_loss_falls_and_accepts(trained):
    target, before, after, prompts, hist = trained
    first, last = hist[0], hist[-1]
    print(f"\n[tiny dflash2] loss {first['loss']:.3f} -> {last['loss']:.3f}, selector loss "
          f"{first['selector_loss']:.3f} -> {last['selector_loss']:.3f}, top-k coverage {last['topk_coverage']:.2f}")
    assert last["loss"] < first["loss"] - 0.3 and last["selector_loss"] < first["selector_loss"]
    r0 = dj.generate(target, before, prompts[:6], max_new_tokens=30)
    r1 = dj.generate(target, after, prompts[:6], max_new_tokens=30)
    print(f"  tau {r0.tau:.3f} -> {r1.tau:.3f}")
    assert r1.tau > r0.tau
    np.testing.assert_array_equal(r1.tokens, r0.tokens)  # lossless either way
    # the selector learned something: its hidden projection left zero, and it reranks some slots
    assert float(jnp.abs(after.params.candidate_selector.hidden_projection).max()) > 0


def test_nvfp4_keeps_and_conv_selector_ablation_drops_acceptance(trained):
    """Measured on the trained tiny drafter: NVFP4 (RTN) on every projection keeps acceptance; the same drafter with
    only the conv and selector tensor scales dropped (the llama.cpp gap) loses it."""
    target, _, drafter, prompts, _ = trained
    q = quantize_nvfp4(drafter)
    broken = drop_global_scales(q, DFLASH2_PROJECTIONS)
    res = {name: dj.generate(target, d, prompts[6:18], max_new_tokens=30)
           for name, d in (("dense", drafter), ("nvfp4", q), ("no conv/selector scales", broken))}
    print("\n[tiny dflash2 nvfp4] " + ", ".join(f"{n}: tau {r.tau:.3f} accept {100 * r.acceptance_rate:.1f}%"
                                                 for n, r in res.items()))
    for r in res.values():
        np.testing.assert_array_equal(r.tokens, res["dense"].tokens)
    assert res["nvfp4"].acceptance_rate >= 0.8 * res["dense"].acceptance_rate
    assert res["no conv/selector scales"].acceptance_rate < 0.5 * res["nvfp4"].acceptance_rate


def test_cli_trains_end_to_end_and_resumes(tmp_path):
    """`dflash-jax train-drafter --kind dflash2` on a tiny target with the shipped tokenizer: data, training,
    checkpoint, saved drafter and report; the same command again resumes (nothing left to do) and gives the same
    drafter."""
    from dflash_jax import cli
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.io.shipped import checkpoints_dir

    tok = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    tcfg = CFG.replace(vocab_size=tok.vocab_size)
    dj.save(tmp_path / "target", dj.init_target(tcfg, jax.random.key(0)))
    argv = ["train-drafter", "--kind", "dflash2", "--target", str(tmp_path / "target"),
            "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--layers", "1",
            "--block-size", "4", "--taps", "2", "--selector-rank", "8", "--selector-top-k", "4",
            "--prompts", "4", "--new-tokens", "8", "--max-prompt-tokens", "56", "--no-packages", "--steps", "3",
            "--batch", "2", "--anchors", "2", "--eval-every", "0", "--eval-prompts", "1", "--eval-tokens", "16"]
    report = cli.main(argv)
    assert report["steps"] == 3 and np.isfinite(report["train_loss"])
    assert report["tau_eval_1_prompts_16_tokens_D3"] >= 1
    saved = json.loads((tmp_path / "out" / "train_report.json").read_text())
    assert saved["selector_weight"] == 1.0
    first = dj.load_drafter(tmp_path / "out")
    assert first.config.kind == "dflash2" and first.config.selector_top_k == 4 and first.config.is_causal is False
    again = cli.main(argv)  # resumes from the orbax checkpoint at step 3: no step left
    assert again["train_loss"] is None
    second = dj.load_drafter(tmp_path / "out")
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the cached continuations belong to that target: a retrained target reusing the data dir is refused
    dj.save(tmp_path / "target2", dj.init_target(tcfg, jax.random.key(1)))
    other = ["--target", str(tmp_path / "target2"), "--data-dir", str(tmp_path / "work"),
             "--work-dir", str(tmp_path / "work2"), "--out", str(tmp_path / "out2")]
    with pytest.raises(SystemExit, match="made with a different target"):
        cli.main(argv + other)  # argparse: the later flags win
    assert not (tmp_path / "out2").exists()


def test_selector_over_a_loss_vocabulary_names_token_ids():
    """With a loss vocabulary (`drafter2_loss(vocab_ids=...)`, train-drafter's --loss-vocab) the base logits cover
    those ids only; the selector's candidates are mapped back to token ids, so its codebooks and its labels are the
    tokens'. The same logits laid out over the whole vocabulary give the same scores, indices and usable slots."""
    cfg = DCFG.replace(selector_top_k=3)
    target = dj.init_target(CFG, jax.random.key(0))
    params = nontrivial_dflash2(random_params(abstract_drafter(cfg), 1, std=0.1), 2)
    tokens = np.arange(20, dtype=np.int32)[None] * 3 % 63
    batch = training_batch(target, tokens, [12], [[4, 8]])
    D = cfg.block_size - 1
    vocab = np.unique(np.concatenate([tokens[0], [1, 2, 5]])).astype(np.int32)  # every label is in it
    rng = np.random.default_rng(0)
    sub = rng.standard_normal((1, 2, D, len(vocab))).astype(np.float32)
    full = np.full((1, 2, D, 64), -30.0, np.float32)
    full[..., vocab] = sub
    h = jnp.asarray(rng.standard_normal((1, 2, D, CFG.hidden_size)), jnp.float32)
    got = td2.selector_terms(params, h, jnp.asarray(sub), batch, cfg, jnp.asarray(vocab))
    want = td2.selector_terms(params, h, jnp.asarray(full), batch, cfg)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert bool(np.asarray(got[2]).any())
    loss, metrics = td2.drafter2_loss(cfg, CFG, vocab_ids=vocab)(params, batch)
    assert np.isfinite(float(loss)) and 0 <= float(metrics["topk_coverage"]) <= 1


def test_train_drafter_run_trains_a_dflash2_drafter_over_the_draft_vocabulary(tmp_path):
    """`python -m dflash_jax.train.drafter_run --kind dflash2`: the DFlash trainer's data, loss vocabulary and draft
    vocabulary for a DFlash2 drafter, warm-started from a DFlash drafter of the same layout (its shared tensors
    copied, the selector starting as the identity on its top logit), over the continuations the first run cached in
    a fresh --data-dir."""
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.io.shipped import checkpoints_dir
    from dflash_jax.train import drafter_run

    tok = Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    tcfg = CFG.replace(vocab_size=tok.vocab_size)
    dj.save(tmp_path / "target", dj.init_target(tcfg, jax.random.key(0)))
    common = ["--target", str(tmp_path / "target"), "--layers", "1", "--block-size", "4", "--taps", "2",
              "--prompts", "4", "--new-tokens", "8", "--max-prompt-tokens", "56", "--no-packages", "--steps", "2",
              "--batch", "2", "--anchors", "2", "--eval-every", "0", "--no-final-eval", "--data-dir",
              str(tmp_path / "data")]  # a fresh folder, then the second run's cache of the same continuations
    drafter_run.main(common + ["--out", str(tmp_path / "dflash"), "--work-dir", str(tmp_path / "w1")])
    drafter_run.main(common + ["--kind", "dflash2", "--selector-rank", "8", "--selector-top-k", "4", "--loss-vocab",
                               "draft", "--draft-vocab", "256", "--init-from", str(tmp_path / "dflash"),
                               "--out", str(tmp_path / "dflash2"), "--work-dir", str(tmp_path / "w2")])
    report = json.loads((tmp_path / "dflash2" / "train_report.json").read_text())
    assert report["kind"] == "dflash2" and report["loss_vocab"] == 256 and np.isfinite(report["selector_loss"])
    d2 = dj.load_drafter(tmp_path / "dflash2")
    assert d2.config.kind == "dflash2" and d2.config.draft_vocab_size == 256 and d2.config.selector_top_k == 4
