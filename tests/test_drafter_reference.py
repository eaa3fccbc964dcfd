"""The DFlash drafter forward against an independent torch reference (z-lab dflash/model.py semantics).

The reference below is written from the KV-injection semantics of z-lab's `DFlashDraftModel` (dflash/model.py; arXiv
2602.06036 section 3), not from dflash_jax: fc over the concatenated target features -> hidden_norm -> per layer
(queries from input_layernorm(x) with q_norm + RoPE at the block positions; K/V from the layer's own k_proj/v_proj
over [context ; normed block], k_norm, RoPE at absolute positions; no mask inside the block) -> final norm -> the
target's lm_head (tied or untied), block embedded with the target's embedding. It runs in float64, so the measured
error is the JAX float32 rounding.

Also here: the target-layer tap semantics against HF transformers (feature id L == hidden_states[L + 1]), the cached
drafter path (context appended in chunks) against the one-shot path, and io.zlab_config.drafter_config_from_hf /
check_pair.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torch_reference import rel_err, rms, rope, torch_inputs

import dflash_jax as dj
from helpers import tiny_qwen3
from random_models import make_drafter, make_target
from dflash_jax.config import DrafterConfig, TargetConfig, check_pair
from dflash_jax.io.zlab_config import drafter_config_from_hf, drafter_config_to_hf
from dflash_jax.models.drafter import empty_draft_cache, append_context, block_logits
from dflash_jax.models.layers import rms_norm
import report  # tests/report.py

REL_TOL = 1e-4
# test name -> measured max error relative to the logit scale, printed at the end of the run (tests/report.py)
_ERRORS: dict[str, float] = report.section("drafter reference max relative error", lambda k, v: f"{k}={v:.2e}")


# -- cases (random tiny models with O(1) activations: see random_models.py) ----------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    target: TargetConfig
    drafter: TargetConfig  # the drafter's own layer stack (hidden/vocab must match the target)
    block_size: int
    taps: tuple[int, ...]
    ctx_len: int
    batch: int = 2


def _t(**kw):
    return tiny_qwen3(**{**dict(vocab_size=96, intermediate_size=48), **kw})


CASES = [
    # untied; drafter GQA 4:1 with its own head_dim, rope_theta and linear RoPE scaling; three taps
    Case("untied-gqa4-ownrope", _t(), _t(num_hidden_layers=2, num_key_value_heads=1, head_dim=16, rope_theta=500.0,
                                         rope_scaling_factor=2.0, intermediate_size=40),
         block_size=6, taps=(0, 2, 3), ctx_len=13),
    # tied embeddings (lm_head = embedding matrix), MHA drafter, one tap, big rope_theta, context of one token
    Case("tied-mha-1tap", _t(vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=3,
                             tie_word_embeddings=True, rope_theta=1e6),
         _t(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
            head_dim=16, tie_word_embeddings=True, rope_theta=1e6), block_size=4, taps=(1,), ctx_len=1),
    # vocab 128, hidden 64, three drafter layers, GQA 4:1, block 8, duplicated tap
    Case("v128-h64-3layers", _t(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                                num_key_value_heads=2),
         _t(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
            intermediate_size=80), block_size=8, taps=(2, 0, 2), ctx_len=5, batch=3),
]


def _build(case: Case, seed: int = 0):
    target = make_target(case.target, seed)
    dcfg = DrafterConfig(model=case.drafter, block_size=case.block_size, mask_token_id=case.target.vocab_size - 1,
                         target_layer_ids=case.taps, num_target_layers=case.target.num_hidden_layers)
    drafter = make_drafter(dcfg, seed + 1)
    rng = np.random.default_rng(seed + 2)
    H = case.target.hidden_size
    features = rng.standard_normal((case.batch, case.ctx_len, len(case.taps) * H)).astype(np.float32)
    block = np.full((case.batch, case.block_size), dcfg.mask_token_id, np.int32)
    block[:, 0] = rng.integers(0, case.target.vocab_size - 1, case.batch)
    block[-1, 2] = 5  # one row with a real token inside the block: the block is not only mask tokens
    return target, drafter, features, block


# -- the torch reference -----------------------------------------------------------------------------------------


def reference_draft_logits(drafter, target, features, block, *, causal_block=False, block_offset=0,
                           renorm_context=False, shift_output=False):
    """Logits [B, bs-1, V] of block slots 1..bs-1 (float64). The keyword flags inject known mistakes so the test can
    show that the comparison is sensitive to them; all False is the reference."""
    m = drafter.config.model
    w, tw, lm_head, feats, blk = torch_inputs(drafter, target, features, block)
    B, C, _ = feats.shape
    bs = blk.shape[1]
    nH, nKV, hd, eps = m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.rms_norm_eps

    ctx = rms(feats @ w["fc"].T, w["hidden_norm"], eps)  # once per forward, shared by every layer
    x = tw["embed_tokens"][blk]  # the block is embedded with the target's embedding
    ctx_pos = torch.arange(C)
    blk_pos = C + block_offset + torch.arange(bs)
    kv_pos = torch.cat([ctx_pos, blk_pos])
    for i in range(m.num_hidden_layers):
        p = f"layers.{i}."
        xn = rms(x, w[p + "input_layernorm"], eps)
        c = rms(ctx, w[p + "input_layernorm"], eps) if renorm_context else ctx
        q = rope(rms((xn @ w[p + "self_attn.q_proj"].T).view(B, bs, nH, hd), w[p + "self_attn.q_norm"], eps),
                  blk_pos, m.rope_theta, m.rope_scaling_factor)
        kv_in = torch.cat([c, xn], dim=1)  # context first, then the block
        k = rms((kv_in @ w[p + "self_attn.k_proj"].T).view(B, C + bs, nKV, hd), w[p + "self_attn.k_norm"], eps)
        k = rope(k, kv_pos, m.rope_theta, m.rope_scaling_factor)
        v = (kv_in @ w[p + "self_attn.v_proj"].T).view(B, C + bs, nKV, hd)
        rep = nH // nKV  # GQA: query head h reads KV head h // rep
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
        if causal_block:
            allowed = torch.ones(bs, C + bs, dtype=torch.bool)
            allowed[:, C:] = torch.tril(torch.ones(bs, bs, dtype=torch.bool))
            scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, bs, nH * hd)
        x = x + attn @ w[p + "self_attn.o_proj"].T
        h2 = rms(x, w[p + "post_attention_layernorm"], eps)
        x = x + (torch.nn.functional.silu(h2 @ w[p + "mlp.gate_proj"].T) * (h2 @ w[p + "mlp.up_proj"].T)) @ \
            w[p + "mlp.down_proj"].T
    h = rms(x, w["norm"], eps)
    h = h[:, :bs - 1] if shift_output else h[:, 1:]
    return (h @ lm_head.T).numpy()


# -- 1. draft_logits == reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_draft_logits_matches_torch_reference(case):
    target, drafter, features, block = _build(case)
    got = np.asarray(dj.draft_logits(target, drafter, features, block))
    ref = reference_draft_logits(drafter, target, features, block)
    assert got.shape == (case.batch, case.block_size - 1, case.target.vocab_size)
    err = rel_err(got, ref)
    _ERRORS[case.name] = err
    print(f"\n[drafter reference] {case.name}: max|jax - torch| / max|logit| = {err:.2e} "
          f"(logit scale {np.max(np.abs(ref)):.2f})")
    assert err <= REL_TOL, f"{case.name}: relative error {err:.3e} > {REL_TOL}"
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_reference_comparison_is_sensitive_to_known_mistakes():
    """Negative controls: each classic porting mistake moves the logits far beyond REL_TOL, so the parity test
    above would catch it (and the reference is not vacuously close to anything)."""
    case = CASES[0]
    target, drafter, features, block = _build(case)
    got = np.asarray(dj.draft_logits(target, drafter, features, block))
    for mistake in ("causal_block", "renorm_context", "shift_output"):
        err = rel_err(got, reference_draft_logits(drafter, target, features, block, **{mistake: True}))
        assert err > 100 * REL_TOL, f"the comparison cannot see mistake {mistake!r} (err {err:.2e})"
    err = rel_err(got, reference_draft_logits(drafter, target, features, block, block_offset=-1))
    assert err > 100 * REL_TOL, f"the comparison cannot see a block-position off-by-one (err {err:.2e})"


def test_block_slot0_token_matters_and_context_matters():
    """The drafter must condition on both the last verified token (slot 0) and the context features."""
    case = CASES[2]
    target, drafter, features, block = _build(case)
    base = np.asarray(dj.draft_logits(target, drafter, features, block))
    other_first = block.copy()
    other_first[:, 0] = (other_first[:, 0] + 1) % (case.target.vocab_size - 1)
    assert rel_err(dj.draft_logits(target, drafter, features, other_first), base) > 1e-2
    assert rel_err(dj.draft_logits(target, drafter, features[:, ::-1].copy(), block), base) > 1e-2


# -- 2. target tap semantics vs HF ---------------------------------------------------------------------------------

def test_target_layer_tap_is_hf_hidden_states_plus_one(tmp_path):
    """Feature id L is the output of decoder layer L (0-based) = HF `hidden_states[L + 1]` (index 0 is the
    embedding output). Uses transformers.Qwen3ForCausalLM on the folder written by dflash_jax.save_hf."""
    transformers = pytest.importorskip("transformers")
    cfg = _t(num_hidden_layers=4, tie_word_embeddings=False)
    target = make_target(cfg, 3)
    dj.save_hf(tmp_path / "target", target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "target", torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)).astype(np.int32)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids.astype(np.int64)), output_hidden_states=True)
    hs = [h.numpy() for h in out.hidden_states]
    N = cfg.num_hidden_layers
    assert len(hs) == N + 1

    logits, feats = dj.target_forward(target, ids, layer_ids=tuple(range(N)))
    logits, feats = np.asarray(logits), np.asarray(feats).reshape(2, 11, N, cfg.hidden_size)
    assert rel_err(logits, out.logits.numpy().astype(np.float64)) <= REL_TOL
    for L in range(N - 1):
        err = rel_err(feats[:, :, L], hs[L + 1].astype(np.float64))
        assert err <= REL_TOL, f"feature id {L} != HF hidden_states[{L + 1}] (rel err {err:.2e})"
        # the off-by-one reading is clearly different (layers are not ~identity with these weights)
        assert rel_err(feats[:, :, L], hs[L].astype(np.float64)) > 1e-2
    # transformers 4.5x replaces hidden_states[-1] by the *final-normed* last hidden state, so for the last layer
    # feature id N-1 (pre-norm) equals HF's entry only after the final norm.
    last = jnp.asarray(feats[:, :, N - 1])
    normed = np.asarray(rms_norm(last, target.params.norm, cfg.rms_norm_eps))
    assert rel_err(normed, hs[N].astype(np.float64)) <= REL_TOL

    # and each tap list concatenates in list order: (2, 0) -> [layer 2 | layer 0]
    _, f20 = dj.target_forward(target, ids, layer_ids=(2, 0))
    np.testing.assert_allclose(np.asarray(f20), np.concatenate([feats[:, :, 2], feats[:, :, 0]], -1), rtol=1e-6,
                               atol=1e-6)


# -- 3. cached path == one-shot path -------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("max_len",))
def _cached_logits(drafter, target, f1, n1, f2, n2, block, *, max_len):
    cache = empty_draft_cache(drafter.config, block.shape[0], max_len)
    cache = append_context(drafter, f1, n1, cache)
    cache = append_context(drafter, f2, n2, cache)
    return cache, block_logits(drafter, target, block, cache)


_block_logits_jit = jax.jit(block_logits)


def test_chunked_context_equals_draft_logits_and_cache_holds_no_block_kv():
    case = CASES[2]  # batch 3
    target, drafter, features, block = _build(case)
    B, C, KH = features.shape  # C = 5
    rng = np.random.default_rng(7)
    # Rows get different context lengths: 5, 3 and 5 = first chunk (2 tokens) + second chunk (3, 1, 3 valid of a
    # 4-wide slab whose invalid slots hold garbage that must be dropped).
    lens = np.array([5, 3, 5])
    full = rng.standard_normal((B, 8, KH)).astype(np.float32)
    full[:, :C] = features
    f1, n1 = full[:, :2], np.full((B,), 2, np.int32)
    f2 = 1e3 * rng.standard_normal((B, 4, KH)).astype(np.float32)
    n2 = (lens - 2).astype(np.int32)
    for b in range(B):
        f2[b, :n2[b]] = full[b, 2:lens[b]]
    cache, got = _cached_logits(drafter, target, jnp.asarray(f1), jnp.asarray(n1), jnp.asarray(f2),
                                jnp.asarray(n2), jnp.asarray(block), max_len=32)
    got = np.asarray(got)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
    errs = []
    for n in sorted(set(lens.tolist())):
        rows = np.flatnonzero(lens == n)  # rows with the same context length go through draft_logits together
        want = np.asarray(dj.draft_logits(target, drafter, full[rows, :n], block[rows]))
        ref = reference_draft_logits(drafter, target, full[rows, :n], block[rows])
        errs.append(rel_err(got[rows], want))
        assert errs[-1] <= REL_TOL, f"rows {rows}: chunked cached path differs from draft_logits ({errs[-1]:.2e})"
        assert rel_err(got[rows], ref) <= REL_TOL
    _ERRORS["chunked-vs-oneshot"] = max(errs)

    # The draft cache never holds block K/V: block_logits returns logits only, and lengths stay = context count.
    again = _block_logits_jit(drafter, target, jnp.asarray(block), cache)
    assert isinstance(again, jax.Array)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
    # Slots at and beyond each row's length (where a block, rejected drafts or padding could sit) are invisible:
    # fill them with garbage and the drafts do not change.
    pos = np.arange(cache.max_len)[None, None, :, None]  # slots of the head-major [B, nKV, S, hd]
    stale = pos >= lens[:, None, None, None]
    junk = lambda a: jnp.where(stale, 50.0 * jnp.asarray(rng.standard_normal(a.shape), a.dtype), a)
    dirty = cache.replace(layers=tuple(e.replace(k=junk(e.k), v=junk(e.v)) for e in cache.layers))
    np.testing.assert_allclose(np.asarray(_block_logits_jit(drafter, target, jnp.asarray(block), dirty)),
                               np.asarray(again), rtol=0, atol=1e-6)


def test_draft_logits_input_validation():
    case = CASES[0]
    target, drafter, features, block = _build(case)
    with pytest.raises(ValueError, match=r"features must be \[B, C, 96\]"):
        dj.draft_logits(target, drafter, features[..., :-1], block)
    with pytest.raises(ValueError, match="block must be"):
        dj.draft_logits(target, drafter, features, block[:1])


def test_draft_calls_take_the_target_first_and_the_old_order_warns():
    """Target first, like `generate`; the old (drafter, target) order gives the same result with a DeprecationWarning;
    two models of the wrong kinds are refused by name."""
    target, drafter, features, block = _build(CASES[0])
    want = np.asarray(dj.draft_logits(target, drafter, features, block))
    with pytest.warns(DeprecationWarning, match=r"draft_logits\(target, drafter"):
        old = np.asarray(dj.draft_logits(drafter, target, features, block))
    np.testing.assert_array_equal(old, want)
    with pytest.warns(DeprecationWarning, match="draft_tokens"):
        np.testing.assert_array_equal(np.asarray(dj.draft_tokens(drafter, target, features, block)),
                                      want.argmax(-1))
    with pytest.raises(TypeError, match="takes a Target and a Drafter, got Target and Target"):
        dj.draft_logits(target, target, features, block)


# -- 4. drafter_config_from_hf (z-lab config variants) ----------------------------------------------------------------

def zlab_8b_config() -> dict:
    """config.json of z-lab/Qwen3-8B-DFlash-b16 as published on the Hugging Face hub."""
    return {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 16, "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
        "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "vocab_size": 151936,
        "dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    }


def _move(d: dict, *, top=(), inside=()) -> dict:
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    d.setdefault("dflash_config", {})
    for key in top:
        if key in d["dflash_config"]:
            d[key] = d["dflash_config"].pop(key)
    for key in inside:
        if key in d:
            d["dflash_config"][key] = d.pop(key)
    return d


def test_drafter_config_from_hf_zlab_8b():
    cfg = drafter_config_from_hf(zlab_8b_config())
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (16, 151669, 36)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_taps == 5
    m = cfg.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, m.head_dim,
            m.intermediate_size, m.vocab_size) == (4096, 5, 32, 8, 128, 12288, 151936)
    assert m.rope_theta == 1e6 and m.rms_norm_eps == 1e-6 and not m.tie_word_embeddings
    assert m.param_dtype == "bfloat16"
    # a round trip through drafter_config_to_hf keeps everything
    assert drafter_config_from_hf(drafter_config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("layout", ["zlab", "all-top-level", "all-in-dflash_config", "mixed"])
def test_drafter_config_from_hf_key_placement(layout):
    base = zlab_8b_config()
    keys = ("block_size", "mask_token_id", "target_layer_ids")
    d = {"zlab": lambda: base,
         "all-top-level": lambda: _move(base, top=keys),
         "all-in-dflash_config": lambda: _move(base, inside=keys),
         "mixed": lambda: _move(_move(base, top=("target_layer_ids",)), inside=("block_size",))}[layout]()
    if layout == "all-top-level":
        assert not d["dflash_config"]
    cfg = drafter_config_from_hf(d)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))


def test_drafter_config_from_hf_dflash_config_wins_over_top_level():
    d = zlab_8b_config()
    d["block_size"], d["dflash_config"]["block_size"] = 8, 16
    d["mask_token_id"] = 5
    d["target_layer_ids"] = [0, 1]
    cfg = drafter_config_from_hf(d)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))


@pytest.mark.parametrize("n_layers,expected", [(5, (1, 9, 17, 25, 33)), (1, (18,)), (2, (1, 33))])
def test_missing_target_layer_ids_derived_with_warning(n_layers, expected):
    d = zlab_8b_config()
    del d["dflash_config"]["target_layer_ids"]
    d["num_hidden_layers"] = n_layers
    d["layer_types"] = ["full_attention"] * n_layers
    with pytest.warns(UserWarning, match="target_layer_ids"):
        cfg = drafter_config_from_hf(d)
    assert cfg.target_layer_ids == expected
    assert dj.default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["dflash_config"].update(mask_token_id=151936), r"mask_token_id 151936 outside the vocabulary"),
    (lambda d: d["dflash_config"].update(mask_token_id=-1), r"mask_token_id -1 outside the vocabulary"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[1, 36]), r"target_layer_ids \[36\] outside 0..35"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[-1, 3]), r"target_layer_ids \[-1\] outside 0..35"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[]), r"target_layer_ids is empty"),
    (lambda d: d.update(block_size=1), r"block_size must be >= 2, got 1"),
    (lambda d: d.update(block_size=0), r"block_size must be >= 2, got 0"),
    (lambda d: d.pop("block_size"), r"missing block_size"),
    (lambda d: d["dflash_config"].pop("mask_token_id"), r"missing .*mask_token_id"),
    (lambda d: d.pop("num_target_layers"), r"missing num_target_layers"),
], ids=["mask>=vocab", "mask<0", "layer>=N", "layer<0", "no-layers", "bs=1", "bs=0", "no-bs", "no-mask",
        "no-num-target-layers"])
def test_drafter_config_from_hf_errors(edit, match):
    d = zlab_8b_config()
    d["dflash_config"] = dict(d["dflash_config"])
    edit(d)
    with pytest.raises(ValueError, match=match):
        drafter_config_from_hf(d)


def test_drafter_config_from_hf_causal_and_sliding_window_keys():
    """z-lab's keys (is_causal, layer_types, sliding_window) are supported (tests/test_dflash2_reference.py checks
    their forward); other engines' spellings with unpinned semantics are refused by name."""
    d = zlab_8b_config()
    d["dflash_config"] = dict(d["dflash_config"], is_causal=True)
    assert drafter_config_from_hf(d).layer_attention(0) == (True, None)
    for key in ("use_swa", "causal", "swa_window_size"):
        d = zlab_8b_config()
        d["dflash_config"] = dict(d["dflash_config"], **{key: 1})
        with pytest.raises(NotImplementedError, match=f"dflash_config.{key} is not supported"):
            drafter_config_from_hf(d)


# -- 5. check_pair -------------------------------------------------------------------------------------------------

def _pair():
    target = _t()
    dcfg = DrafterConfig(model=target.replace(num_hidden_layers=1), block_size=4, mask_token_id=95,
                         target_layer_ids=(1, 3), num_target_layers=4)
    return dcfg, target


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=48), r"hidden size: drafter 32 vs target 48"),
    (dict(vocab_size=128), r"vocab size: drafter 96 vs target 128"),
    (dict(num_hidden_layers=6), r"num_target_layers: drafter expects 4, target has 6"),
    (dict(num_hidden_layers=3), r"target_layer_ids \[3\] outside the target's layers 0..2"),
    (dict(vocab_size=64), r"mask_token_id 95 outside the target vocabulary \[0, 64\)"),
])
def test_check_pair_errors(change, match):
    dcfg, target = _pair()
    check_pair(dcfg, target)  # the matching pair passes
    with pytest.raises(ValueError, match="drafter does not match target: .*" + match):
        check_pair(dcfg, target.replace(**change))


def test_check_pair_lists_every_problem_and_draft_logits_uses_it():
    dcfg, tcfg = _pair()
    bad = tcfg.replace(hidden_size=48, vocab_size=128, num_hidden_layers=6)
    with pytest.raises(ValueError) as e:
        check_pair(dcfg, bad)
    msg = str(e.value)
    assert "hidden size" in msg and "vocab size" in msg and "num_target_layers" in msg
    target = make_target(bad, 0)
    drafter = make_drafter(dcfg, 1)
    with pytest.raises(ValueError, match="drafter does not match target"):
        dj.draft_logits(target, drafter, np.zeros((1, 2, 64), np.float32), np.zeros((1, 4), np.int32))
