"""Hybrid (Qwen3.5-style) targets: Gated DeltaNet + gated attention, and the exact rollback of recurrent states.

Oracle: transformers 5.x `Qwen3_5ForCausalLM` (the tests that need it skip on an older transformers). The
speculative tests use the hand-built copy drafters of tests/helpers.py against a hybrid target whose embeddings and
head are the copy pair's and whose mixing layers are scaled to 0.3: the target follows the copy cycle only now and
then, so acceptance is partial and ragged across rows, and its tokens depend on the recurrent states.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
import dflash_jax.decode.loop as loop
import dflash_jax.decode.programs as programs
import helpers as H
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.io.errors import CheckpointError
from dflash_jax.io.hf_config import target_config_from_hf, target_config_to_hf
from dflash_jax.io.zlab_config import drafter_config_from_hf, drafter_config_to_hf
from dflash_jax.io.safetensors_io import read_safetensors, write_safetensors
from dflash_jax.models import deltanet as dn
from dflash_jax.models.target import KVCache, commit_states, forward_with_cache
from dflash_jax.params import abstract_drafter, abstract_target, linear_qkv_order
from random_models import random_params

LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
# the copy pair's sizes (vocab 48, hidden 64, 2 target layers: taps (1, 0)), a DeltaNet layer then gated attention
HCFG = TargetConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rope_theta=10000.0, model_type="qwen3_5",
                   layer_types=("linear_attention", "full_attention"), partial_rotary_factor=0.25, **LINEAR)


def hybrid_copy_target(scale: float = 0.3) -> dj.Target:
    copy_target, _ = H.build_copy_pair()
    tp = random_params(abstract_target(HCFG), 5)
    l0, l1 = tp.layers
    net, order = l0.linear_attn, linear_qkv_order(HCFG)
    # the random q/k/v rows read as HF's q | k | v order, regrouped by key head as held (the model these tests' tau
    # figures were tuned on)
    net = dataclasses.replace(net, in_proj_qkv=net.in_proj_qkv[order], conv1d=net.conv1d[order])
    l0 = dataclasses.replace(l0, linear_attn=dataclasses.replace(net, out_proj=scale * net.out_proj),
                             mlp=dataclasses.replace(l0.mlp, down_proj=scale * l0.mlp.down_proj))
    l1 = dataclasses.replace(l1, self_attn=dataclasses.replace(l1.self_attn, o_proj=scale * l1.self_attn.o_proj),
                             mlp=dataclasses.replace(l1.mlp, down_proj=scale * l1.mlp.down_proj))
    tp = dataclasses.replace(tp, embed_tokens=copy_target.params.embed_tokens, lm_head=copy_target.params.lm_head,
                             norm=jnp.zeros((64,), jnp.float32), layers=(l0, l1))  # zero-centred: w = 0 is identity
    return dj.Target(params=tp, config=HCFG)


PROMPTS = H.COPY_PROMPTS + [H.cycle_prompt(27, 12)]  # batch 4, lengths 11, 13, 10, 12


@pytest.fixture(scope="module")
def target():
    return hybrid_copy_target()


@pytest.fixture(scope="module")
def ar(target):
    return dj.generate_autoregressive(target, PROMPTS, max_new_tokens=40)


# -- the delta rule's two forms ----------------------------------------------------------------------------------

def test_chunked_and_recurrent_forms_agree():
    rng = np.random.default_rng(0)
    B, T, nV, dk, dv = 2, 37, 3, 8, 6  # 37 tokens in chunks of 8: five chunks, the last padded
    q = dn.l2norm(jnp.asarray(rng.standard_normal((B, T, nV, dk)), jnp.float32)) * dk ** -0.5
    k = dn.l2norm(jnp.asarray(rng.standard_normal((B, T, nV, dk)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((B, T, nV, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (B, T, nV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, T, nV)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((B, nV, dk, dv)), jnp.float32)
    o_r, s_r = dn.recurrent_rule(q, k, v, g, beta, s0)
    for chunk in (8, 64):
        o_c, s_c = dn.chunked_rule(q, k, v, g, beta, s0, chunk)
        np.testing.assert_allclose(o_c, o_r, atol=2e-5)
        np.testing.assert_allclose(s_c, s_r, atol=2e-5)
    # the recurrent form with keep = n leaves exactly the state after n tokens
    _, s_keep = dn.recurrent_rule(q, k, v, g, beta, s0, keep=jnp.asarray([0, 5]))
    np.testing.assert_array_equal(s_keep[0], s0[0])
    np.testing.assert_array_equal(s_keep[1], dn.recurrent_rule(q[1:, :5], k[1:, :5], v[1:, :5], g[1:, :5],
                                                               beta[1:, :5], s0[1:])[1][0])



def test_unit_lower_inverse_is_the_inverse():
    """The UT transform's inverse by the nilpotent series equals float64 inversion of I + strictly_lower(a), for
    chunk sizes that are and are not powers of two; a's diagonal and upper part are ignored, and zeros (a tree's
    non-ancestors) stay exact zeros."""
    rng = np.random.default_rng(1)
    for C in (1, 2, 5, 8, 37, 64):
        a = rng.standard_normal((3, C, C)).astype(np.float32) * 0.3
        want = np.linalg.inv(np.tril(a.astype(np.float64), -1) + np.eye(C))
        got = np.asarray(dn.unit_lower_inverse(jnp.asarray(a)))
        np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), err_msg=f"C={C}")
        np.testing.assert_array_equal(np.triu(got, 1), 0.0)
        np.testing.assert_array_equal(np.diagonal(got, axis1=-2, axis2=-1), 1.0)
    # a tree: node 3's parent is 0, so it must not couple to nodes 1, 2 (another branch)
    a = np.full((4, 4), 0.5, np.float32)
    a[3, 1:3] = 0.0
    got = np.asarray(dn.unit_lower_inverse(jnp.asarray(a)))
    np.testing.assert_array_equal(got[3, 1:3], 0.0)


def test_the_delta_rule_runs_without_a_lapack_call(target):
    """The chunked and tree forms compile to XLA ops alone on CPU: no triangular solve, whose LAPACK kernel (jaxlib's
    trsm FFI call) waits inside XLA's thread pool, and two at once stalled a 2-core run (`dn.unit_lower_inverse`)."""
    ids = jnp.zeros((2, 9), jnp.int32)
    programs_ = {"forward": jax.jit(lambda t, x: dj.target_forward(t, x)[0]).lower(target, ids)}
    B, T, nV, dk, dv = 2, 5, 2, 4, 4
    x = jnp.zeros((B, T, nV, dk), jnp.float32)
    programs_["tree_rule"] = jax.jit(dn.tree_rule).lower(x, x, jnp.zeros((B, T, nV, dv)), jnp.zeros((B, T, nV)),
                                                         jnp.zeros((B, T, nV)), jnp.zeros((B, nV, dk, dv)),
                                                         jnp.tril(jnp.ones((B, T, T), bool)))
    for name, lowered in programs_.items():
        hlo = lowered.compile().as_text()
        calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
        assert " triangular-solve(" not in hlo and not [c for c in calls if "trsm" in c or "lapack" in c], (name, calls)


# -- rollback at every acceptance length ----------------------------------------------------------------------------

def _rollback_gap(target, shift: int = 0):
    """Rows b = 0..T of one prompt verify the same T = 8 tokens (deferred), then keep n = b of them (+ shift: a planted
    off-by-one). Returns the largest difference between each row's DeltaNet states and the states that single-token
    steps over exactly its n tokens leave (conv windows, recurrent state)."""
    cfg = target.config
    T = 8
    B = T + 1
    prompt = np.tile(np.asarray(H.cycle_prompt(3, 9), np.int32), (B, 1))
    verify = np.tile(np.asarray([5, 6, 7, 0, 12, 13, 40, 41], np.int32), (B, 1))
    n = jnp.arange(B, dtype=jnp.int32)

    @jax.jit
    def prefill(tokens):
        cache = KVCache.empty(cfg, B, 32)
        return forward_with_cache(target, tokens, cache, empty_cache=True)[2]

    @jax.jit
    def verify_and_commit(cache, tokens, keep):
        _, _, c = forward_with_cache(target, tokens, cache, defer_states=True)
        return commit_states(c, keep, cfg)

    @jax.jit
    def step(cache, tokens):
        return forward_with_cache(target, tokens, cache)[2]

    cache0 = prefill(prompt)
    got = verify_and_commit(cache0, verify, jnp.clip(n + shift, 0, T))
    refs = [cache0]
    for t in range(T):  # the autoregressive path: one token at a time (the recurrent form)
        refs.append(step(refs[-1], verify[:, t:t + 1]))
    gap = 0.0
    for i in cfg.linear_layer_ids:
        want_conv = np.stack([np.asarray(refs[b].layers[i].conv[b]) for b in range(B)])
        want_state = np.stack([np.asarray(refs[b].layers[i].state[b]) for b in range(B)])
        gap = max(gap, float(np.abs(np.asarray(got.layers[i].conv) - want_conv).max()),
                  float(np.abs(np.asarray(got.layers[i].state) - want_state).max()))
    return gap


def test_rollback_at_every_acceptance_length(target):
    assert _rollback_gap(target) < 1e-5


def test_planted_off_by_one_rollback_is_caught(target):
    assert _rollback_gap(target, shift=1) > 1e-2
    assert _rollback_gap(target, shift=-1) > 1e-2


# -- speculative == autoregressive ----------------------------------------------------------------------------------

def test_greedy_speculative_equals_autoregressive_ragged(target, ar):
    _, flawed = H.build_copy_pair(H.FLAW)
    sp = dj.generate(target, flawed, PROMPTS, max_new_tokens=40)
    H.assert_same(target, PROMPTS, ar, sp, "hybrid")
    tau = sp.tau_per_row
    print(f"\n[hybrid speculative] tau {sp.tau:.2f}, per row {np.round(tau, 2).tolist()}")
    assert 1.5 <= sp.tau <= 5 and tau.max() - tau.min() > 1  # partial and ragged acceptance
    # a mutant commit (one token too many; too few is caught by the rollback test) breaks it: the greedy tokens
    # depend on the rollback
    original = loop.commit_states
    for shift in (1,):
        saved = dict(programs._COMPILED)
        try:
            loop.commit_states = lambda c, n, cfg, s=shift: original(c, jnp.clip(n + s, 0, 8), cfg)
            programs._COMPILED.clear()
            bad = dj.generate(target, flawed, PROMPTS, max_new_tokens=40)
        finally:
            loop.commit_states = original
            programs._COMPILED.clear()
            programs._COMPILED.update(saved)
        assert not all(np.array_equal(a, b) for a, b in zip(ar.tokens, bad.tokens)), shift


def test_eos_inside_a_block(target, ar):
    _, flawed = H.build_copy_pair(H.FLAW)
    row = ar.token_lists()[2]
    eos = row[5]  # a token of row 2's 6th output: the row stops there, inside a verify block
    ar_e = dj.generate_autoregressive(target, PROMPTS, max_new_tokens=40, eos_ids=[eos])
    sp_e = dj.generate(target, flawed, PROMPTS, max_new_tokens=40, eos_ids=[eos])
    H.assert_same(target, PROMPTS, ar_e, sp_e, "hybrid eos")
    assert sp_e.finish_reason[2] == "eos" and sp_e.num_tokens[2] == row.index(eos) + 1


# -- DFlash2 drafters on a hybrid target ---------------------------------------------------------------------------

def hybrid_dflash2(tap_scale: float = 0.05) -> dj.Drafter:
    """The flawed copy drafter as DFlash2 (conv 0.05 around the identity, a weak selector: the copy setting of
    tests/test_dflash2_generate.py) that reads BOTH taps: fc's second half (the DeltaNet layer 0's output; the copy
    pair leaves it 0) gets random weights, so its drafts, and hence the acceptance lengths, depend on the DeltaNet
    features in the loop."""
    _, flawed = H.build_copy_pair(H.FLAW)
    d2 = H.as_dflash2(flawed, 1, codebook_scale=0.3, tap_scale=0.05, proj_scale=0.05)
    fc = d2.params.fc  # [H, 2H]: taps (1, 0) = (attention layer 1, DeltaNet layer 0)
    noise = jax.random.normal(jax.random.key(7), (fc.shape[0], fc.shape[1] // 2), fc.dtype) / np.sqrt(fc.shape[0])
    return d2.replace(params=dataclasses.replace(d2.params, fc=fc.at[:, fc.shape[1] // 2:].set(tap_scale * noise)))


@pytest.fixture(scope="module")
def dflash2_run(target):
    drafter = hybrid_dflash2()
    return drafter, dj.generate(target, drafter, PROMPTS, max_new_tokens=40)


def test_greedy_dflash2_speculative_equals_autoregressive_ragged(target, ar, dflash2_run):
    drafter, sp = dflash2_run
    assert drafter.config.kind == "dflash2"
    assert [target.config.layer_type(i) for i in drafter.config.target_layer_ids] == ["full_attention",
                                                                                      "linear_attention"]
    H.assert_same(target, PROMPTS, ar, sp, "hybrid dflash2")
    tau = sp.tau_per_row
    print(f"\n[hybrid dflash2 speculative] tau {sp.tau:.2f}, per row {np.round(tau, 2).tolist()}")
    assert 1.5 <= sp.tau <= 5 and tau.max() - tau.min() > 1  # partial and ragged acceptance


def test_dflash2_acceptance_lengths_equal_the_cache_free_reference_loop(target, dflash2_run):
    """Per-step acceptance lengths of the DFlash2 drafter equal the cache-free loop's (the selector walk on features
    of a fresh `target_forward` each step): the features of both tapped layers, DeltaNet included, are right after
    every rollback. The drafter's DeltaNet tap matters: zeroing it changes the drafts."""
    from dflash_jax.models.drafter import draft_tokens
    drafter, sp = dflash2_run
    b = 0
    # max_new 20: the DFlash reference test's width, so the target_forward programs are shared (compiles dominate)
    acc, out = H.reference_acceptance(target, drafter, PROMPTS[b], max_new=20, max_steps=6, propose=draft_tokens)
    got = sp.acceptance_lengths[b][sp.acceptance_lengths[b] > 0].tolist()
    assert got[:len(acc)] == acc and max(acc) > 1 and min(acc) < 8, (got, acc)
    np.testing.assert_array_equal(sp.tokens[b, :len(out)], out)
    feats = dj.target_forward(target, H.pad_to(PROMPTS[b], 16), drafter.config.target_layer_ids)[1][:, :10]
    block = np.full((1, 8), drafter.config.mask_token_id, np.int32)
    block[0, 0] = PROMPTS[b][9]
    no_tap = drafter.replace(params=dataclasses.replace(
        drafter.params, fc=drafter.params.fc.at[:, drafter.params.fc.shape[1] // 2:].set(0.0)))
    a = np.asarray(dj.draft_logits(target, drafter, feats, block))
    z = np.asarray(dj.draft_logits(target, no_tap, feats, block))
    assert np.abs(a - z).max() > 0.1  # the DeltaNet tap reaches the draft logits


# -- bad input ----------------------------------------------------------------------------------------------------

def test_bad_hybrid_configs_are_named():
    with pytest.raises(ValueError, match="sliding_attention"):
        HCFG.replace(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        HCFG.replace(linear_num_value_heads=3)
    with pytest.raises(ValueError, match="model_type 'qwen3_5'"):
        HCFG.replace(model_type="qwen3")
    d = target_config_to_hf(HCFG)
    d["layer_types"] = ["linear_attention", "mamba"]
    with pytest.raises(NotImplementedError, match="mamba"):
        target_config_from_hf(d)


def test_drafter_configs_with_rope_parameters_or_rope_theta_read_the_same():
    """transformers 5.x writes `rope_parameters` (rope_theta inside, none at the top) for drafters too; z-lab's
    published drafter configs have a top-level rope_theta: both read as one config."""
    dcfg = DrafterConfig(HCFG.drafter_stack(1).replace(rope_theta=5e5), 8, 47, (0, 1), 2)
    zlab = drafter_config_to_hf(dcfg)
    v5 = {k: v for k, v in zlab.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert drafter_config_from_hf(zlab) == drafter_config_from_hf(v5) == dcfg.replace(
        model=dcfg.model.replace(compute_dtype=drafter_config_from_hf(zlab).model.compute_dtype))


def test_drafter_taps_beyond_the_hybrid_target_are_refused(target):
    m = H.PDCFG.model
    far = DrafterConfig(m, 8, H.PMASK, (1, 3), 4)  # built for a 4-layer target
    drafter = dj.Drafter(params=random_params(abstract_drafter(far), 1), config=far)
    with pytest.raises(ValueError, match=r"target_layer_ids \[3\] outside"):
        dj.generate(target, drafter, PROMPTS[:1], max_new_tokens=4)


def test_saved_hf_folder_roundtrip_and_mismatched_weights(tmp_path, target):
    folder = dj.save_hf(tmp_path / "t", target)
    again = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    assert again.config == target.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(a, b)
    saved = dj.load_target(dj.save(tmp_path / "orbax", target), param_dtype="float32", compute_dtype="float32")
    assert saved.config == target.config  # the orbax format too
    for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(a, b)
    # an orbax save of version 1 held in_proj_qkv / conv1d in HF's q | k | v order: regrouped on load
    inv = np.argsort(linear_qkv_order(HCFG))
    l0 = target.params.layers[0]
    v1 = dataclasses.replace(l0.linear_attn, in_proj_qkv=l0.linear_attn.in_proj_qkv[inv],
                             conv1d=l0.linear_attn.conv1d[inv])
    old = target.replace(params=dataclasses.replace(target.params, layers=(
        dataclasses.replace(l0, linear_attn=v1),) + target.params.layers[1:]))
    folder1 = dj.save(tmp_path / "orbax_v1", old)
    meta = json.loads((folder1 / "dflash_jax.json").read_text())
    (folder1 / "dflash_jax.json").write_text(json.dumps({**meta, "version": 1}))
    again1 = dj.load_target(folder1, param_dtype="float32", compute_dtype="float32")
    for a, b in zip(jax.tree.leaves(again1.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(a, b)
    for key, value, named in (("linear_conv_kernel_dim", 3, "conv1d"), ("linear_num_value_heads", 2, "in_proj_b")):
        H.edit_config(folder, lambda d: d.update({key: value, "linear_value_head_dim": 16}
                                                 if key == "linear_num_value_heads" else {key: value}))
        with pytest.raises(CheckpointError, match=named):
            dj.load_target(folder)
        (folder / "config.json").write_text(json.dumps(target_config_to_hf(target.config)))


# -- against transformers 5.x ----------------------------------------------------------------------------------------

def _hf_model(tmp_path_factory):
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5", reason="the qwen3_5 oracle needs transformers 5.x")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    c = qwen3_5.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, **{k: v for k, v in LINEAR.items()},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    m = qwen3_5.Qwen3_5ForCausalLM(c).eval().float()
    with torch.no_grad():  # O(1) random weights (HF's init makes every layer ~identity), confident logits
        for name, p in m.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "embed" in name or "lm_head" in name else 0.15)
    folder = tmp_path_factory.mktemp("qwen3_5") / "text"
    m.save_pretrained(folder)
    return m, folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return _hf_model(tmp_path_factory)


def test_logits_and_features_match_transformers(hf):
    import torch
    m, folder = hf
    t = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    assert t.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert t.config.rotary_dim == 4
    ids = np.random.default_rng(0).integers(0, 96, (2, 150))  # 150 tokens: three chunks of the chunked form
    with torch.no_grad():
        r = m(torch.tensor(ids), output_hidden_states=True)
    ref = r.logits.numpy()
    taps = (0, 1, 2)  # the last layer's HF hidden state is the final-normed one, not the layer output
    logits, feats = dj.target_forward(t, ids, taps)
    want = np.concatenate([r.hidden_states[i + 1].numpy() for i in taps], axis=-1)
    d_logits = float(np.abs(np.asarray(logits) - ref).max())
    d_feats = float(np.abs(np.asarray(feats) - want).max())
    print(f"\n[qwen3_5 vs transformers] logits |max| {np.abs(ref).max():.1f}: max abs diff {d_logits:.2e}; "
          f"features {d_feats:.2e}")
    assert np.abs(ref).max() > 10  # confident logits
    assert d_logits <= 2e-3 and d_feats <= 2e-3


def test_multimodal_layout_loads_identically(hf, tmp_path):
    _, folder = hf
    text = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    tensors = read_safetensors(folder / "model.safetensors")
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in tensors.items()}
    mm["model.visual.patch_embed.proj.weight"] = np.zeros((8, 3, 2, 4, 4), np.float32)
    mm["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    out = tmp_path / "mm"
    out.mkdir()
    write_safetensors(out / "model.safetensors", mm)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": cfg,
        "vision_config": {"depth": 1, "hidden_size": 32, "model_type": "qwen3_5_vision"},
        "image_token_id": 248056, "tie_word_embeddings": False}))  # an image token outside the vocabulary: harmless
    with pytest.warns(UserWarning, match="model.visual"):
        loaded = dj.load_target(out, param_dtype="float32", compute_dtype="float32")
    assert loaded.config == text.config
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(text.params)):
        np.testing.assert_array_equal(a, b)


def test_greedy_autoregressive_matches_transformers(hf):
    import torch
    m, folder = hf
    t = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 17)]  # ragged: right padding stays out of the states
    res = dj.generate_autoregressive(t, prompts, max_new_tokens=64)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            g = m.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        np.testing.assert_array_equal(res.tokens[b][:64], g[0, len(p):].numpy(), err_msg=f"row {b}")


# -- llama.cpp's qwen35 GGUF -----------------------------------------------------------------------------------------

def test_qwen35_gguf_loads_as_transformers(hf, tmp_path):
    """The tiny transformers model written as llama.cpp's converter writes a qwen35 GGUF (tests/gguf_files.py: norms
    stored 1 + w, ssm_a = -exp(A_log), squeezed conv, value heads tiled: 2 key / 4 value heads make that a real
    reorder) loads as the HF folder does, and its logits are transformers'."""
    import torch
    from gguf_files import write_qwen35_gguf
    m, folder = hf
    path = write_qwen35_gguf(tmp_path / "q.gguf", m)
    t = dj.load_target(path, param_dtype="float32", compute_dtype="float32")
    ref = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    same = dict(bos_token_id=None, eos_token_id=None, rms_norm_eps=1e-6)  # GGUF: no token ids here, eps in float32
    assert t.config.replace(**same) == ref.config.replace(**same)
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(ref.params)))
    assert worst <= 1e-5, worst  # (1 + w) - 1 and log(exp(A_log)) round in float32
    ids = np.random.default_rng(3).integers(0, 96, (2, 70))
    with torch.no_grad():
        want = m(torch.tensor(ids)).logits.numpy()
    d = float(np.abs(np.asarray(dj.target_forward(t, ids)[0]) - want).max())
    print(f"\n[qwen35 GGUF vs transformers] weights within {worst:.1e}; logits max abs diff {d:.2e}")
    assert d <= 2e-3


def test_qwen35_gguf_bad_input_is_named(hf, tmp_path):
    from gguf_files import write_qwen35_gguf
    m, _ = hf
    with pytest.raises(CheckpointError, match="'blk.1.ssm_a'"):
        dj.load_target(write_qwen35_gguf(tmp_path / "a.gguf", m, drop=("blk.1.ssm_a",)))
    with pytest.raises(CheckpointError, match=r"'blk.0.ssm_conv1d.weight' has shape \[64, 1, 4\].*\[64, 1, 3\]"):
        dj.load_target(write_qwen35_gguf(tmp_path / "k.gguf", m, meta={"qwen35.ssm.conv_kernel": 3}))
    with pytest.raises(CheckpointError, match="qwen35.ssm.group_count"):
        dj.load_target(write_qwen35_gguf(tmp_path / "g.gguf", m, meta={"qwen35.ssm.group_count": 3}))


# -- sampling stays lossless (the exact-law test of tests/test_sampling.py, on a hybrid target) ------------------------

def _sampled_pair():
    import test_sampling as ts
    V = ts.V
    cfg = TargetConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, rope_theta=10000.0, model_type="qwen3_5",
                      layer_types=("linear_attention", "full_attention"), partial_rotary_factor=0.5,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=4,
                      linear_conv_kernel_dim=4,
                      # as test_sampling's CFG: caches of 64 slots, not the 2048-slot minimum, at 10,000 rows
                      max_position_embeddings=32)
    dcfg = DrafterConfig(model=cfg.drafter_stack(1), block_size=4, mask_token_id=V - 1, target_layer_ids=(0, 1),
                         num_target_layers=2)
    target = dj.Target(params=ts._random_params(abstract_target(cfg), 0, 0.6), config=cfg)
    drafter = dj.Drafter(params=ts._random_params(abstract_drafter(dcfg), 1, 0.6), config=dcfg)
    return ts, target, drafter


SAMPLED_ROWS = 10_000  # a quarter of test_sampling's N (this file's time); the planted rollback bug moves TV by ~0.9


@pytest.fixture(scope="module")
def sampled():
    """(test_sampling, hybrid target, DFlash drafter, the exact law's logits: every continuation enumerated, the
    decode programs the sampled runs share)."""
    ts, target, drafter = _sampled_pair()
    logits = np.asarray(dj.target_forward(target, np.asarray(
        [ts.PROMPT + list(c) for c in __import__("itertools").product(range(ts.V), repeat=ts.L)], np.int32))[0])
    return ts, target, drafter, logits, ts.large_batch_programs()


def _sampled_run(ts, target, drafter, temperature, programs_):
    # As in test_sampling: 16-key attention blocks, programs compiled for large batches (`programs_`, shared).
    with ts.large_batch_execution(programs_):
        return dj.generate(target, drafter, [ts.PROMPT] * SAMPLED_ROWS, max_new_tokens=ts.NEW, draft_length=3,
                           temperature=temperature, seed=0)


def _assert_sampled_law(ts, res, logits, temperature, label):
    import stats
    hist = res.tau_histogram
    print(f"\n[{label} T={temperature}] tau {res.tau:.3f}, steps by committed tokens {hist[1:].tolist()}")
    assert hist[1] > 0 and hist[2:].sum() > 0.05 * hist.sum()  # rejections and partial acceptance both happen
    stats.assert_matches("test_hybrid", f"{label} T={temperature}",
                         ts.compare(res.tokens, ts.exact_law(logits, temperature)))


def test_sampled_speculative_output_has_the_hybrid_target_distribution(sampled):
    """Speculative sampling at T = 1.0 and 0.6 on a hybrid target: every position's marginal and two joints match the
    exact law (enumerated over all continuations) within the suite's bound; with the rollback committing one token too
    many, the law is off and the same checks fail."""
    import stats
    ts, target, drafter, logits, progs = sampled
    for temperature in (1.0, 0.6):
        _assert_sampled_law(ts, _sampled_run(ts, target, drafter, temperature, progs), logits, temperature,
                            "hybrid speculative")
    original = loop.commit_states
    try:
        loop.commit_states = lambda c, n, cfg: original(c, jnp.minimum(n + 1, 4), cfg)
        bad = _sampled_run(ts, target, drafter, 1.0, ts.large_batch_programs())  # fresh programs: traced with the bug
    finally:
        loop.commit_states = original
    stats.assert_fails("hybrid rollback one token too many", ts.compare(bad.tokens, ts.exact_law(logits, 1.0)))


def test_sampled_dflash2_speculative_output_has_the_hybrid_target_distribution(sampled):
    """The same law at T = 1.0 with a DFlash2 drafter tapping both layers (DeltaNet 0, attention 1): its top-4 of 8
    candidates make q zero on half the vocabulary, so the residual max(p - q, 0) is exercised too."""
    ts, target, drafter, logits, progs = sampled
    d2 = H.as_dflash2(drafter, 3, group=8, rank=4, top_k=4, codebook_scale=1.0, tap_scale=0.3)
    assert d2.config.target_layer_ids == (0, 1)
    _assert_sampled_law(ts, _sampled_run(ts, target, d2, 1.0, progs), logits, 1.0, "hybrid dflash2 speculative")


def test_zz_false_alarm_budget():
    import stats
    stats.assert_within_budget("test_hybrid")


def test_acceptance_lengths_equal_the_cache_free_reference_loop(target):
    """z-lab's loop, cache-free (tests/helpers.py `reference_acceptance`: every step re-runs the target over the whole
    committed sequence, so no state is ever rolled back): per-step acceptance lengths equal the loop's, per row."""
    _, flawed = H.build_copy_pair(H.FLAW)
    res = dj.generate(target, flawed, PROMPTS, max_new_tokens=20)
    b = 0  # a row with partial acceptance (tau 2.7 over 40 tokens); the reference loop is slow (two passes a step)
    acc, out = H.reference_acceptance(target, flawed, PROMPTS[b], max_new=20, max_steps=20)
    got = res.acceptance_lengths[b][res.acceptance_lengths[b] > 0].tolist()
    assert got == acc and max(acc) > 1, (got, acc)
    assert res.token_lists()[b] == out[:20]


def test_nvfp4_deltanet_projections_and_audit(target, tmp_path):
    """quantize_nvfp4 takes the DeltaNet's projections too (in_proj_qkv / z / a / b, out_proj), and every scale of
    every one reaches the hybrid target's logits (`audit_scales`). Written as a ModelOpt folder (in_proj_qkv's codes
    and block scales back in HF's q | k | v row order) and read back: bit-identical."""
    from dflash_jax.quant.nvfp4 import NVFP4Array
    q = dj.quantize_nvfp4(target)
    folder = dj.save_hf(tmp_path / "nvfp4", q)
    H.assert_bit_exact(dj.load_target(folder, param_dtype="float32", compute_dtype="float32").params, q.params)
    hf_rows = read_safetensors(folder / "model.safetensors")["model.layers.0.linear_attn.in_proj_qkv.weight"]
    held = q.params.layers[0].linear_attn.in_proj_qkv
    np.testing.assert_array_equal(hf_rows[linear_qkv_order(HCFG)], np.asarray(held.packed))
    net = q.params.layers[0].linear_attn
    assert all(isinstance(getattr(net, f), NVFP4Array) for f in ("in_proj_qkv", "in_proj_z", "in_proj_a",
                                                                   "in_proj_b", "out_proj"))
    assert not isinstance(net.A_log, NVFP4Array) and not isinstance(net.conv1d, NVFP4Array)
    tokens = np.asarray([H.cycle_prompt(3, 12)], np.int32)
    audit = dj.audit_scales(lambda params, t: dj.target_forward(q.replace(params=params), t)[0], q.params, tokens)
    # ok: no scale misses the output, and the forward equals the one with every leaf dequantized exactly
    assert audit.ok and any("in_proj_qkv" in n for n in audit.checked), audit


def test_hybrid_loop_lowers_without_data_dependent_loops_or_conditionals(target):
    """As tests/test_device_lowering.py for dense targets: the speculative program, exported for CUDA, has one
    data-dependent while (the generation loop itself) and no conditional; the DeltaNet's chunk scan and the rollback
    scan are static loops; prefill has no data-dependent loop."""
    from dflash_jax.bench.lowering import loop_report, prefill_module, speculative_module
    _, flawed = H.build_copy_pair(H.FLAW)
    rep = loop_report(speculative_module(target, flawed, PROMPTS, chunk=8, max_new_tokens=16))
    assert rep["conditionals"] == 0 and rep["dynamic"] == 1 and rep["dynamic_at_top"] == 1, rep
    pre = loop_report(prefill_module(target, flawed, PROMPTS, chunk=8, max_new_tokens=16))
    assert pre["dynamic"] == 0 and pre["conditionals"] == 0, pre


def test_states_after_prefill_and_every_step_match_transformers(hf):
    """The DeltaNet states themselves (conv window, recurrent state) after prefill and after each of 8 decode steps
    equal transformers' cache (HF keeps the last K conv inputs, this the last K - 1: the ones a next step reads; its
    channels are q | k | v, here grouped by key head)."""
    import torch
    m, folder = hf
    t = dj.load_target(folder, param_dtype="float32", compute_dtype="float32")
    cfg = t.config
    prompt = np.random.default_rng(2).integers(0, 96, (1, 70))  # 70 tokens: two chunks of the chunked form

    @jax.jit
    def prefill(tokens):
        return forward_with_cache(t, tokens, KVCache.empty(cfg, 1, 96), empty_cache=True)

    @jax.jit
    def step(cache, tokens):
        return forward_with_cache(t, tokens, cache)

    logits, _, cache = prefill(jnp.asarray(prompt, jnp.int32))
    with torch.no_grad():
        out = m(torch.tensor(prompt), use_cache=True)
    past, worst = out.past_key_values, 0.0
    for s in range(9):
        for i in cfg.linear_layer_ids:
            hf_conv = past.get_conv_state(i).numpy()[:, :, -(cfg.linear_conv_kernel_dim - 1):].transpose(0, 2, 1)
            hf_conv = hf_conv[..., linear_qkv_order(cfg)]  # HF's q | k | v channels, grouped by key head here
            hf_state = past.get_recurrent_state(i).numpy()
            scale = max(1.0, float(np.abs(hf_state).max()))
            worst = max(worst, float(np.abs(np.asarray(cache.layers[i].conv) - hf_conv).max()),
                        float(np.abs(np.asarray(cache.layers[i].state) - hf_state).max()) / scale)
        if s == 8:
            break
        tok = int(np.asarray(logits)[0, -1].argmax())
        assert tok == int(out.logits[0, -1].argmax())
        logits, _, cache = step(cache, jnp.asarray([[tok]], jnp.int32))
        with torch.no_grad():
            out = m(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    print(f"\n[qwen3_5 states vs transformers] after prefill and 8 steps: max diff {worst:.2e}")
    assert worst <= 2e-3


def test_sharded_load_and_generation(tmp_path):
    """tests/hybrid_sharded_run.py on 8 virtual CPU devices: sharded HF loading (DeltaNet value heads along "model", and
    in_proj_qkv / conv1d at whole key heads when the model axis divides them, else replicated), logits equal to one
    device's, and greedy speculative tokens on a (data 2, model 2) mesh equal to one device's."""
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "out.json"
    here = Path(__file__).resolve().parent
    subprocess.run([sys.executable, str(here / "hybrid_sharded_run.py"), str(out)], check=True, timeout=900,
                   cwd=here.parent)
    res = json.loads(out.read_text())
    print(f"\n[hybrid on 8 virtual devices] {res}")
    assert res["values"] and res["placement"] and res["tokens_equal"], res
    assert res["value_heads_split"] == ["model"], res
    # q / k / v (in_proj_qkv rows, conv channels) split at whole key heads where the model axis divides them
    assert res["qkv_split_model2"] == res["qkv_split_model4"] == ["model", None], res
    assert res["conv_split_model4"] == ["model", None, None] and res["whole_heads_per_device"], res
    assert res["logits_max_diff_model4"] <= 1e-3 and res["logits_argmax_equal_model4"], res
    assert res["qkv_split_2_key_heads_model4"] == [None, None] and res["logits_max_diff_replicated_qkv"] <= 1e-3, res
