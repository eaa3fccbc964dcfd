"""The Qwen3 target: HF parity, KV cache (chunks, ragged rows, rollback, overflow), jit tracing, dtypes, axes.

Conventions: tiny random configs, float32 compute on CPU; "relative error" = max|ours - ref| / max|ref|.
HF oracle: transformers `Qwen3ForCausalLM`, torch CPU float32, eager attention, loaded from a folder written by
`dflash_jax.save_hf` (so the export path is exercised by every parity case).
"""

from __future__ import annotations

import importlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.config import TargetConfig
from dflash_jax.models.layers import rms_norm, rope, rope_inv_freq, write_kv, write_kv_run, write_rows
from dflash_jax.params import (abstract_drafter, abstract_target, is_spec, logical_axes, map_named,
                               named_leaves)
from dflash_jax.models.target import KVCache, Target, forward_with_cache, init_target, target_forward
import report  # tests/report.py

# `dflash_jax.models.target` the attribute is shadowed by nothing, but import the module explicitly for monkeypatching.
target_mod = importlib.import_module("dflash_jax.models.target")

PARITY_RTOL = 1e-4  # of the reference's scale (max |ref|)
CACHE_RTOL = 2e-6  # same math, different shapes / reduction orders


def tiny_cfg(**kw) -> TargetConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_theta=10000.0, param_dtype="float32",
                compute_dtype="float32")
    base.update(kw)
    return TargetConfig(**base)


def random_target(cfg: TargetConfig, seed: int = 0, std: float = 0.15) -> Target:
    """Weights big enough that attention is far from uniform; norm weights (incl. q/k norms) away from 1."""
    t = init_target(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def leaf(name, x):
        if x.ndim == 1:
            v = 1.0 + 0.3 * rng.standard_normal(x.shape)
        else:
            v = std * rng.standard_normal(x.shape)
        return jnp.asarray(v.astype(np.float32), x.dtype)

    return t.replace(params=map_named(leaf, t.params))


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


# ---------------------------------------------------------------------------------------------------------------
# HF parity
# ---------------------------------------------------------------------------------------------------------------

PARITY_CASES = {
    # name: config overrides
    "untied_gqa4-2_theta1e4": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0),
    "tied_gqa4-1_theta1e6": dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=1_000_000.0,
                                 tie_word_embeddings=True),
    "untied_mha4-4_theta500_linear4": dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=500.0,
                                           rope_scaling_factor=4.0),
    "tied_gqa4-2_hd16_theta1e5_linear2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              rope_theta=100_000.0, rope_scaling_factor=2.0,
                                              tie_word_embeddings=True, num_hidden_layers=4),
}
PARITY_ERRORS: dict[str, tuple[float, float]] = report.section(  # printed at the end of the run (tests/report.py)
    "target vs HF relative error", lambda k, v: f"{k}: logits {v[0]:.2e}, features {v[1]:.2e}")


def _hf_forward(folder, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        out = hf(torch.tensor(np.asarray(tokens, np.int64)), output_hidden_states=True)
    return hf, out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_hf_parity(case, tmp_path):
    cfg = tiny_cfg(**PARITY_CASES[case])
    target = random_target(cfg, seed=len(case))
    dj.save_hf(tmp_path, target)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 13))
    hf, ref_logits, hidden = _hf_forward(tmp_path, tokens)
    # The HF model really got the config we meant (tying and RoPE scaling are easy to lose on the way).
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    if cfg.rope_scaling_factor != 1.0:
        assert hf.config.rope_scaling["factor"] == cfg.rope_scaling_factor
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    n = cfg.num_hidden_layers
    ids = tuple(range(n))
    logits, feats = target_forward(target, tokens, layer_ids=ids)
    feats = np.asarray(feats).reshape(2, 13, n, cfg.hidden_size)
    e_logits = rel_err(logits, ref_logits)
    # id L == hidden_states[L + 1] for L < n - 1. HF replaces hidden_states[n] with the *final-normed* state
    # (transformers check_model_inputs, tie_last_hidden_states), so the last tap is compared after our final norm.
    e_feat = max(rel_err(feats[:, :, L], hidden[L + 1]) for L in range(n - 1))
    last_normed = rms_norm(jnp.asarray(feats[:, :, n - 1]), target.params.norm, cfg.rms_norm_eps)
    e_feat = max(e_feat, rel_err(last_normed, hidden[n]))
    PARITY_ERRORS[case] = (e_logits, e_feat)
    print(f"\nHF parity {case}: logits rel err {e_logits:.2e} (max|ref| {np.abs(ref_logits).max():.3g}), "
          f"taps rel err {e_feat:.2e}")
    assert e_logits < PARITY_RTOL, case
    assert e_feat < PARITY_RTOL, case

    if cfg.rope_scaling_factor != 1.0:  # negative control: the test can see a dropped RoPE scaling
        wrong = target.replace(config=cfg.replace(rope_scaling_factor=1.0))
        assert rel_err(target_forward(wrong, tokens)[0], ref_logits) > 100 * PARITY_RTOL


def test_parity_negative_control_tap_offset(tmp_path):
    """Tap id L must NOT equal hidden_states[L] (the classic off-by-one); proves the tap comparison discriminates."""
    cfg = tiny_cfg()
    target = random_target(cfg, seed=3)
    dj.save_hf(tmp_path, target)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 9))
    _, _, hidden = _hf_forward(tmp_path, tokens)
    _, f = target_forward(target, tokens, layer_ids=(1,))
    assert rel_err(f, hidden[2]) < PARITY_RTOL
    assert rel_err(f, hidden[1]) > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------

CACHE_CFG = tiny_cfg(num_hidden_layers=2)
TAPS = (0, 1)


@pytest.fixture(scope="module")
def cache_target():
    return random_target(CACHE_CFG, seed=7)


_FWD = jax.jit(forward_with_cache, static_argnums=(3,))  # few distinct shapes below: compiles are the cost


def _fwd(target, tokens, cache):
    return _FWD(target, jnp.asarray(tokens, jnp.int32), cache, TAPS)


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, CACHE_CFG.vocab_size, shape).astype(np.int32)


def _set_lengths(cache: KVCache, lengths) -> KVCache:
    return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


def _kv(cache: KVCache) -> list:
    """Every layer's keys and values, in layer order."""
    return [a for e in cache.layers for a in (e.k, e.v)]


def _right_padded(seqs, width):
    """Rows of different lengths as one [B, width] batch; causal no-cache outputs of a row's prefix ignore padding."""
    out = np.zeros((len(seqs), width), np.int32)
    for b, s in enumerate(seqs):
        out[b, :len(s)] = s
    return out


def test_prefill_chunks_equal_one_call_equal_no_cache(cache_target):
    tok = _tokens((2, 13), 1)
    ref_logits, ref_feats, _ = _fwd(cache_target, tok, None)

    one_logits, one_feats, one_cache = _fwd(cache_target, tok, KVCache.empty(CACHE_CFG, 2, 16))
    np.testing.assert_array_equal(np.asarray(one_cache.lengths), [13, 13])
    assert rel_err(one_logits, ref_logits) < CACHE_RTOL
    assert rel_err(one_feats, ref_feats) < CACHE_RTOL

    cache, logits, feats = KVCache.empty(CACHE_CFG, 2, 16), [], []
    for a, b in ((0, 6), (6, 7), (7, 13)):  # 6 + 1 + 6
        lg, ft, cache = _fwd(cache_target, tok[:, a:b], cache)
        logits.append(lg)
        feats.append(ft)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [13, 13])
    assert rel_err(jnp.concatenate(logits, 1), ref_logits) < CACHE_RTOL
    assert rel_err(jnp.concatenate(feats, 1), ref_feats) < CACHE_RTOL
    for k1, k2 in zip(_kv(cache), _kv(one_cache)):
        assert rel_err(k1[:, :13], k2[:, :13]) < CACHE_RTOL


def test_ragged_batch_equals_rows_alone(cache_target):
    lengths = [7, 3]
    prompt = _tokens((2, 10), 2)
    step = _tokens((2, 4), 3)
    # Batch: prefill a padded [2, 10], set per-row lengths, extend every row by the same 4 new slots.
    _, _, cache = _fwd(cache_target, prompt, KVCache.empty(CACHE_CFG, 2, 16))
    logits, feats, cache = _fwd(cache_target, step, _set_lengths(cache, lengths))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [n + 4 for n in lengths])
    seqs = [np.concatenate([prompt[b, :n], step[b]]) for b, n in enumerate(lengths)]
    ref_logits, ref_feats, _ = _fwd(cache_target, _right_padded(seqs, 13), None)
    for b, n in enumerate(lengths):
        assert rel_err(logits[b], ref_logits[b, n:n + 4]) < CACHE_RTOL, b
        assert rel_err(feats[b], ref_feats[b, n:n + 4]) < CACHE_RTOL, b
        # The row alone (batch 1) through the same cache path, padded prompt + its own length.
        _, _, c1 = _fwd(cache_target, prompt[b:b + 1], KVCache.empty(CACHE_CFG, 1, 16))
        l1, _, c1 = _fwd(cache_target, step[b:b + 1], _set_lengths(c1, [n]))
        assert rel_err(logits[b], l1[0]) < CACHE_RTOL, b
        for kb, k1 in zip(_kv(cache), _kv(c1)):
            assert rel_err(kb[b, :n + 4], k1[0, :n + 4]) < CACHE_RTOL, b


def test_rollback_then_reextend_equals_fresh_run(cache_target):
    prompt, draft, fix, nxt = _tokens((2, 8), 4), _tokens((2, 4), 5), _tokens((2, 4), 6), _tokens((2, 1), 7)
    _, _, cache = _fwd(cache_target, prompt, KVCache.empty(CACHE_CFG, 2, 16))
    _, _, cache = _fwd(cache_target, draft, cache)  # lengths 12
    accepted = np.array([3, 0])  # row 0 keeps 3 draft tokens, row 1 none
    cache = _set_lengths(cache, 8 + accepted)
    logits, _, cache = _fwd(cache_target, fix, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), 8 + accepted + 4)
    # The stale draft K/V beyond the new length are still in memory but masked: a further step agrees too.
    lg, _, _ = _fwd(cache_target, nxt, cache)
    seqs = [np.concatenate([prompt[b], draft[b, :accepted[b]], fix[b], nxt[b]]) for b in range(2)]
    ref, _, _ = _fwd(cache_target, _right_padded(seqs, 16), None)
    for b in range(2):
        n = 8 + accepted[b]
        assert rel_err(logits[b], ref[b, n:n + 4]) < CACHE_RTOL, b
        assert rel_err(lg[b, 0], ref[b, n + 4]) < CACHE_RTOL, b
    # Negative control: without the rollback, row 1 would see the rejected draft and differ.
    _, _, c2 = _fwd(cache_target, prompt, KVCache.empty(CACHE_CFG, 2, 16))
    _, _, c2 = _fwd(cache_target, draft, c2)
    bad, _, _ = _fwd(cache_target, fix, c2)
    assert rel_err(bad[1], ref[1, 8:12]) > 1e-3


def test_writes_beyond_cache_are_dropped_not_clamped(cache_target):
    tok = _tokens((2, 10), 8)
    _, _, big = _fwd(cache_target, tok, KVCache.empty(CACHE_CFG, 2, 16))  # reference K/V for positions 0..9
    _, _, small = _fwd(cache_target, tok[:, :6], KVCache.empty(CACHE_CFG, 2, 8))
    logits, _, small = _fwd(cache_target, tok[:, 6:], small)  # positions 6..9; 8 and 9 do not fit
    ref_logits, _, _ = _fwd(cache_target, tok, None)
    # Positions that fit are exact; slot 7 holds position 7's key, not position 9's (what a clamp would leave).
    for ks, kb in zip(_kv(small), _kv(big)):  # [B, nKV, S, hd]
        assert ks.shape[2] == 8
        assert rel_err(ks[:, :, :8], kb[:, :, :8]) < CACHE_RTOL
        assert rel_err(ks[:, :, 7], kb[:, :, 9]) > 1e-2
    assert rel_err(logits[:, :2], ref_logits[:, 6:8]) < CACHE_RTOL

    # The primitive itself, with distinguishable values.
    cache = jnp.zeros((2, 4, 1))
    new = jnp.arange(1.0, 9.0).reshape(2, 4, 1)
    pos = jnp.array([[2, 3, 4, 5], [0, 9, 1, 4]])
    out = np.asarray(write_rows(cache, new, pos))[..., 0]
    np.testing.assert_array_equal(out, [[0, 0, 1, 2], [5, 7, 0, 0]])
    # and its head-major form for keys and values: new [B, T, nKV, hd] into [B, nKV, S, hd]
    new_kv = jnp.stack([new, 10 * new], axis=2)  # [2, 4, 2 heads, 1]
    out = np.asarray(write_kv(jnp.zeros((2, 2, 4, 1)), new_kv, pos))[..., 0]
    np.testing.assert_array_equal(out[:, 0], [[0, 0, 1, 2], [5, 7, 0, 0]])
    np.testing.assert_array_equal(out[:, 1], [[0, 0, 10, 20], [50, 70, 0, 0]])


def test_a_run_written_in_place_equals_the_scatter_of_its_slots():
    """`write_kv_run` (a tree commit's and the drafter context's write: rows j < n at slots start + j) equals
    `write_kv` at those slots, past ones dropped: for one batch row as a clamped block (the run in the middle, at the
    end of the cache, partly and wholly past it, n = 0 and n = T) and for several rows, under jit."""
    S, T = 6, 3
    old = jnp.asarray(-np.arange(1.0, 2 * S * 2 + 1).reshape(1, 2, S, 2))  # [1, nKV, S, hd], distinct values
    new = jnp.asarray(np.arange(1.0, T * 2 * 2 + 1).reshape(1, T, 2, 2))  # [1, T, nKV, hd]
    run = jax.jit(write_kv_run)
    for start in range(0, S + 2):
        for n in range(0, T + 1):
            slots = jnp.where(jnp.arange(T)[None] < n, start + jnp.arange(T)[None], S)
            want = write_kv(old, new, slots)
            np.testing.assert_array_equal(run(old, new, jnp.asarray([start]), jnp.asarray([n])), want)
    two = jnp.concatenate([old, 2 * old]), jnp.concatenate([new, 3 * new])
    starts, ns = jnp.asarray([4, 1]), jnp.asarray([3, 2])
    slots = jnp.where(jnp.arange(T)[None] < ns[:, None], starts[:, None] + jnp.arange(T)[None], S)
    np.testing.assert_array_equal(run(*two, starts, ns), write_kv(*two, slots))


# ---------------------------------------------------------------------------------------------------------------
# jit: no retrace, with/without jit agree
# ---------------------------------------------------------------------------------------------------------------

def test_target_forward_does_not_retrace(monkeypatch):
    cfg = tiny_cfg(vocab_size=88, num_hidden_layers=1)  # a config no other test uses: a fresh jit cache entry
    chex.clear_trace_counter()
    counted = chex.assert_max_traces(forward_with_cache, n=1)
    monkeypatch.setattr(target_mod, "forward_with_cache", counted)
    before = target_mod._target_forward_jit._cache_size()
    t1, t2 = random_target(cfg, 1), random_target(cfg, 2)  # same structure, different weights

    def tokens(shape, seed):
        return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)

    outs = []
    for t, tok in ((t1, tokens((2, 5), 1)), (t2, tokens((2, 5), 2)), (t1, jnp.asarray(tokens((2, 5), 3))),
                   (t2, tokens((2, 5), 4).astype(np.int64))):
        outs.append(target_forward(t, tok, layer_ids=[0])[0])  # list ids are normalised to a static tuple
    assert target_mod._target_forward_jit._cache_size() == before + 1
    assert not np.allclose(outs[0], outs[1])
    # A different shape is a new trace: the counter must catch it (so the assertion above is meaningful).
    with pytest.raises(AssertionError):
        target_forward(t1, tokens((2, 6), 5), layer_ids=(0,))


def test_decode_steps_do_not_retrace(cache_target):
    """A jitted cache step reused across growing lengths and new tokens traces once."""
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(forward_with_cache, n=1), static_argnums=(3,))
    _, _, cache = _fwd(cache_target, _tokens((2, 8), 1), KVCache.empty(CACHE_CFG, 2, 16))
    for i in range(4):
        _, _, cache = step(cache_target, jnp.asarray(_tokens((2, 1), 10 + i)), cache, TAPS)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])


class ForwardVariantsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_with_cache(self):
        target = random_target(CACHE_CFG, seed=11)
        tok = jnp.asarray(_tokens((2, 6), 12))
        fwd = self.variant(forward_with_cache, static_argnums=(3,))
        ref_logits, ref_feats = target_forward(target, tok, layer_ids=TAPS)
        logits, feats, none = fwd(target, tok, None, TAPS)
        self.assertIsNone(none)
        chex.assert_trees_all_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(feats, ref_feats, rtol=1e-5, atol=1e-6)
        cache = KVCache.empty(CACHE_CFG, 2, 8)
        l1, _, cache = fwd(target, tok[:, :3], cache, TAPS)  # equal halves: one set of shapes to compile eagerly
        l2, _, cache = fwd(target, tok[:, 3:], cache, TAPS)
        chex.assert_trees_all_close(jnp.concatenate([l1, l2], 1), ref_logits, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_equal(cache.lengths, jnp.array([6, 6], jnp.int32))
        chex.assert_shape([e.k for e in cache.layers], [(2, CACHE_CFG.num_key_value_heads, 8, CACHE_CFG.head_dim)] * 2)


def test_bad_layer_id_and_tokens_rejected(cache_target):
    with pytest.raises(ValueError, match="layer id 2"):
        target_forward(cache_target, _tokens((1, 3)), layer_ids=(2,))
    with pytest.raises(ValueError, match="int array"):
        target_forward(cache_target, np.zeros((1, 3), np.float32))


# ---------------------------------------------------------------------------------------------------------------
# storage vs compute dtype
# ---------------------------------------------------------------------------------------------------------------

def test_bf16_storage_f32_compute():
    cfg32 = tiny_cfg(num_hidden_layers=2)
    t32 = random_target(cfg32, seed=5, std=0.1)
    cfg16 = cfg32.replace(param_dtype="bfloat16")
    t16 = Target(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), t32.params), config=cfg16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(t16.params))
    assert init_target(cfg16, jax.random.key(0)).params.embed_tokens.dtype == jnp.bfloat16
    tok = _tokens((2, 9), 9)
    l16, f16 = target_forward(t16, tok, layer_ids=(0, 1))
    assert l16.dtype == jnp.float32 and f16.dtype == jnp.float32  # compute stays f32
    # Same bf16-rounded values held in f32: the f32-compute path is the identical computation.
    t_up = Target(params=jax.tree.map(lambda x: x.astype(jnp.float32), t16.params), config=cfg32)
    l_up, f_up = target_forward(t_up, tok, layer_ids=(0, 1))
    assert rel_err(l16, l_up) < 1e-6 and rel_err(f16, f_up) < 1e-6
    # Versus the unrounded f32 model: within bf16 weight rounding.
    l32, f32 = target_forward(t32, tok, layer_ids=(0, 1))
    e = rel_err(l16, l32)
    assert 0 < e < 3e-2, e
    assert rel_err(f16, f32) < 3e-2
    # Full bf16 (storage and compute) runs and is in the same neighbourhood.
    tb = Target(params=t16.params, config=cfg16.replace(compute_dtype="bfloat16"))
    lb, fb = target_forward(tb, tok, layer_ids=(0, 1))
    assert lb.dtype == jnp.float32 and fb.dtype == jnp.bfloat16
    assert rel_err(lb, l32) < 6e-2


# ---------------------------------------------------------------------------------------------------------------
# logical axes
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_logical_axes_rank_and_consistency(tied):
    cfg = tiny_cfg(tie_word_embeddings=tied, num_hidden_layers=2)
    dcfg = dj.DrafterConfig(model=cfg, block_size=4, mask_token_id=1, target_layer_ids=(0, 1), num_target_layers=2)
    sizes: dict[str, set[int]] = {}
    for abstract in (abstract_target(cfg), abstract_drafter(dcfg)):
        specs = named_leaves(abstract)
        assert specs and all(is_spec(s) for s in specs.values())
        axes = logical_axes(abstract)
        checked = []

        def check(spec, ax):
            assert isinstance(ax, tuple) and all(isinstance(a, str) for a in ax), ax
            assert len(ax) == len(spec.shape), (spec, ax)
            for a, n in zip(ax, spec.shape):
                sizes.setdefault(a, set()).add(n)
            checked.append(ax)

        jax.tree.map(check, abstract, axes, is_leaf=is_spec)
        assert len(checked) == len(specs)
    assert ("lm_head" in named_leaves(abstract_target(cfg))) == (not tied)
    # One logical axis name = one size everywhere (what a sharding rule relies on).
    assert all(len(v) == 1 for v in sizes.values()), sizes
    assert sizes["embed"] == {cfg.hidden_size} and sizes["vocab"] == {cfg.vocab_size}
    assert sizes["taps_embed"] == {2 * cfg.hidden_size}
    # Every initialised leaf has the spec's shape.
    t = init_target(cfg, jax.random.key(0))
    for name, spec in named_leaves(abstract_target(cfg)).items():
        assert named_leaves(t.params)[name].shape == spec.shape, name


# ---------------------------------------------------------------------------------------------------------------
# Regression tests for bugs found while building the loaders and the forward
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [CACHE_CFG.vocab_size, -1])
def test_target_forward_rejects_out_of_vocab_ids(cache_target, bad):
    tok = np.array([[1, bad, 3]])
    with pytest.raises(ValueError, match=str(bad)):
        target_forward(cache_target, tok)


def test_nonfinite_stale_slots_beyond_length_are_ignored(cache_target):
    tok = _tokens((2, 8), 13)
    _, _, cache = _fwd(cache_target, tok[:, :6], KVCache.empty(CACHE_CFG, 2, 16))
    ref, _, _ = _fwd(cache_target, tok[:, 6:], cache)
    # slot 12 > any position used
    poisoned = cache.replace(layers=tuple(e.replace(v=e.v.at[:, 12].set(jnp.nan)) for e in cache.layers))
    got, _, _ = _fwd(cache_target, tok[:, 6:], poisoned)
    assert rel_err(got, ref) < CACHE_RTOL


def test_empty_cache_buffers_are_distinct_and_donatable():
    """k and v (and every layer) get their own buffers, so a step can donate the cache and update it in place."""
    cache = KVCache.empty(CACHE_CFG, 2, 8)
    ptrs = [a.unsafe_buffer_pointer() for a in _kv(cache)]
    assert len(set(ptrs)) == len(ptrs)
    step = jax.jit(lambda c: c.replace(layers=tuple(e.replace(k=e.k + 1, v=e.v + 2) for e in c.layers)),
                   donate_argnums=0)
    out = step(cache)
    assert all(a.is_deleted() for a in _kv(cache))  # donated
    assert float(out.layers[0].k[0, 0, 0, 0]) == 1.0 and float(out.layers[1].v[0, 0, 0, 0]) == 2.0


@pytest.mark.parametrize("T", [1, 8])
def test_rope_reads_cos_and_sin_from_one_table_with_the_same_values(T):
    """RoPE computes cos and sin once per row and frequency, as a [B, T, rd] table the rotation reads: fused into
    the rotation, XLA:CPU evaluated them once per output element (~1 ms of SmolLM2's verify of 8 tokens). Checked on
    the compiled program of four chained rotations (as a forward's layers chain them): no fused computation that
    evaluates a cosine writes a per-head result, and the four identical tables are one. The values are bit for bit
    the textbook rotation's (control: the textbook program does evaluate its cosines per output element)."""
    cfg = tiny_cfg(head_dim=64, num_attention_heads=9, num_key_value_heads=3, rope_theta=100_000.0)
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((2, T, 9, 64)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 4000, (2, T)), jnp.int32)

    def textbook(x, p):
        angles = p.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
        cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
        x1, x2 = x[..., :32], x[..., 32:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def chained(rotate):
        def f(x, p):
            for _ in range(4):
                x = rotate(x, p) * 0.999
            return x
        return jax.jit(f)

    def cosine_roots(program):  # the result shape of every computation that evaluates a cosine
        text = program.lower(x, pos).compile().as_text()
        return [re.search(r"ROOT \S+ = (\w+\[[\d,]*\])", c).group(1) for c in re.split(r"\n(?=\S)", text)
                if "cosine(" in c]

    ours, ref = chained(lambda x, p: rope(x, p, cfg)), chained(textbook)
    np.testing.assert_array_equal(np.asarray(ours(x, pos)), np.asarray(ref(x, pos)))
    assert cosine_roots(ours) == [f"f32[2,{T},64]"], cosine_roots(ours)
    if T > 1:  # XLA:CPU keeps the textbook's cosines inside the per-head rotation
        assert f"f32[2,{T},9,64]" in cosine_roots(ref), cosine_roots(ref)
