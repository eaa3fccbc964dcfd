"""The one attention function: the visibility rule against a naive mask, chunked vs dense against a float64
reference (chunk boundaries, ragged and per-query lengths, windows, fresh keys with a mask), NaN-safe stale slots,
the live-length loop (CPU's rule) against the same reference and the static form, and the per-layer window / chunk
arguments through the target's layers and the whole generation program."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from random_models import make_drafter, make_target
from dflash_jax.bench.lowering import loop_report
from dflash_jax.decode import buckets
from dflash_jax.decode import programs as G
from dflash_jax.models.attention import LIVE_CHUNK, attention, attention_chunk, live_length_loop, visible
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.target import KVCache, forward_with_cache


def naive_visible(q, k, causal, window):
    """z-lab's rule, written out: key visible iff q - k < window and, when non-causal, k - q < window."""
    if causal and k > q:
        return False
    if window is None:
        return True
    return q - k < window and (causal or k - q < window)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_visibility_rule_matches_naive_mask(causal, window):
    pos = np.arange(-2, 14)
    got = np.asarray(visible(jnp.asarray(pos)[:, None], jnp.asarray(pos)[None, :], causal=causal, window=window))
    want = np.array([[naive_visible(q, k, causal, window) for k in pos] for q in pos])
    np.testing.assert_array_equal(got, want)
    if window == 1:  # window 1 = the token itself only
        np.testing.assert_array_equal(got, np.eye(len(pos), dtype=bool))


def reference(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, causal, window):
    """float64 softmax over the union of cached (slot = position, valid below clen) and fresh keys."""
    q, ck, cv = (np.asarray(a, np.float64) for a in (q, ck, cv))
    B, T, nH, hd = q.shape
    nKV = ck.shape[2]
    out = np.zeros((B, T, nH, hd))
    clen = np.broadcast_to(np.asarray(clen)[:, None] if np.ndim(clen) == 1 else np.asarray(clen), (B, T))
    for b in range(B):
        for t in range(T):
            keys, vals = [], []
            for s in range(ck.shape[1]):
                if s < clen[b, t] and naive_visible(q_pos[b, t], s, causal, window):
                    keys.append(ck[b, s]), vals.append(cv[b, s])
            if k is not None:
                for j in range(k.shape[1]):
                    if (k_mask is None or k_mask[b, t, j]) and naive_visible(q_pos[b, t], k_pos[b, j], causal, window):
                        keys.append(np.asarray(k[b, j], np.float64)), vals.append(np.asarray(v[b, j], np.float64))
            if not keys:
                continue
            K, V = np.stack(keys), np.stack(vals)  # [n, nKV, hd]
            for h in range(nH):
                g = h // (nH // nKV)
                s = K[:, g] @ q[b, t, h] / np.sqrt(hd)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ V[:, g]
    return out.reshape(B, T, nH * hd)


@functools.partial(jax.jit, static_argnames=("causal", "window", "chunk", "fresh", "live"))
def _attn(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, *, causal, window, chunk, fresh, live=False):
    """ck / cv token-major [B, S, nKV, hd] as `reference` takes them; the cache holds them head-major."""
    kw = dict(k=k, v=v, k_pos=k_pos, k_mask=k_mask) if fresh else {}
    ck, cv = ck.transpose(0, 2, 1, 3), cv.transpose(0, 2, 1, 3)
    with live_length_loop(live):
        return attention(q, q_pos, cache_k=ck, cache_v=cv, cache_len=clen, causal=causal, window=window,
                         chunk=chunk, **kw)


def _case(seed, B=3, T=4, S=37, nH=4, nKV=2, hd=8):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, ck, cv, k, v = r(B, T, nH, hd), r(B, S, nKV, hd), r(B, S, nKV, hd), r(B, T, nKV, hd), r(B, T, nKV, hd)
    clen = np.array([0, 13, S][:B], np.int32)  # empty row, mid-chunk, full (S = 37: the last chunk is clamped)
    q_pos = (clen[:, None] + np.arange(T)).astype(np.int32)  # fresh tokens right after each row's cache
    k_mask = rng.random((B, T, T)) < 0.7
    return q, q_pos, ck, cv, clen, k, v, q_pos, k_mask


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None), (False, 9)])
def test_chunked_equals_dense_and_reference(causal, window):
    q, q_pos, ck, cv, clen, k, v, k_pos, k_mask = _case(0)
    want = reference(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, causal, window)
    outs = {}
    # default (one block: dense); key blocks crossing every boundary; one block bigger than the cache; query blocks
    # too (T = 4 > 3: the last query block padded)
    for chunk in (None, 8, 5, 64, 3):
        got = _attn(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, causal=causal, window=window, chunk=chunk,
                    fresh=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=f"chunk {chunk}")
        outs[chunk] = np.asarray(got)
    np.testing.assert_allclose(outs[8], outs[None], rtol=1e-6, atol=1e-6)


def test_per_query_cache_lengths_and_cached_part_alone():
    """Per-query lengths (training: context strictly before each query's anchor) with the cached part alone, and
    queries that see nothing (length 0, no fresh keys) return zeros."""
    q, q_pos, ck, cv, _, k, v, k_pos, _ = _case(1)
    rng = np.random.default_rng(5)
    clen = rng.integers(0, 38, (3, 4)).astype(np.int32)
    clen[0, 1] = 0
    q_pos = (clen + 3).astype(np.int32)
    for chunk in (None, 6, 3):
        got = np.asarray(_attn(q, q_pos, ck, cv, clen, k, v, k_pos, None, causal=True, window=None, chunk=chunk,
                               fresh=False))
        np.testing.assert_allclose(got, reference(q, q_pos, ck, cv, clen, None, None, None, None, True, None),
                                   rtol=2e-5, atol=2e-5)
        assert (got[0, 1] == 0).all()


def test_stale_slots_never_leak_nan():
    """Slots at or past a row's length may hold anything (rolled-back drafts, never-written memory, NaN)."""
    q, q_pos, ck, cv, clen, k, v, k_pos, k_mask = _case(2)
    ref = {c: np.asarray(_attn(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, causal=True, window=None, chunk=c,
                               fresh=True)) for c in (None, 8)}
    stale = np.arange(ck.shape[1])[None, :] >= clen[:, None]
    ck2 = np.where(stale[..., None, None], np.nan, ck).astype(np.float32)
    cv2 = np.where(stale[..., None, None], np.inf, cv).astype(np.float32)
    for c in (None, 8):
        got = np.asarray(_attn(q, q_pos, ck2, cv2, clen, k, v, k_pos, k_mask, causal=True, window=None, chunk=c,
                               fresh=True))
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, ref[c])


def _long_case(seed, window_rows=False):
    """Rows whose queries all sit late (positions >= 30 in a 37-slot cache), so a window of 5 starts the live-length
    loop past block 0; or ragged rows (0, 13, 37 live slots)."""
    q, q_pos, ck, cv, clen, k, v, k_pos, k_mask = _case(seed)
    if window_rows:
        clen = np.array([30, 33, 37], np.int32)
        q_pos = (clen[:, None] + np.arange(4)).astype(np.int32)
    return q, q_pos, ck, cv, clen, k, v, q_pos, k_mask


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None), (False, 9)])
@pytest.mark.parametrize("late", [False, True])
def test_live_length_loop_equals_static_and_reference(causal, window, late):
    """CPU's rule: cached keys visited only from the first block a window reaches to the last live one, in a loop
    whose trip count is data. Same result as the reference and as the static form (whole bucket, masked), at block
    sizes crossing every boundary, the default LIVE_CHUNK (bigger than this cache: one pass), and per-query lengths."""
    q, q_pos, ck, cv, clen, k, v, k_pos, k_mask = _long_case(3, late)
    want = reference(q, q_pos, ck, cv, clen, k, v, k_pos, k_mask, causal, window)
    assert LIVE_CHUNK > ck.shape[1]
    for chunk in (None, 8, 5, 3):
        args = (q, q_pos, ck, cv, clen, k, v, k_pos, k_mask)
        live = np.asarray(_attn(*args, causal=causal, window=window, chunk=chunk, fresh=True, live=True))
        static = np.asarray(_attn(*args, causal=causal, window=window, chunk=chunk, fresh=True))
        np.testing.assert_allclose(live, want, rtol=2e-5, atol=2e-5, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(live, static, rtol=1e-6, atol=1e-6, err_msg=f"chunk {chunk}")
    per_query = np.minimum(clen[:, None] + np.array([0, 2, 1, 3]), 37).astype(np.int32)  # [B, T] lengths
    got = np.asarray(_attn(q, q_pos, ck, cv, per_query, k, v, k_pos, None, causal=causal, window=window, chunk=4,
                           fresh=False, live=True))
    np.testing.assert_allclose(got, reference(q, q_pos, ck, cv, per_query, None, None, None, None, causal, window),
                               rtol=2e-5, atol=2e-5)


def test_live_length_loop_is_a_data_dependent_loop_and_off_by_default():
    """The live-length loop really is one (a while whose trip count the checker cannot prove static), only under
    live_length_loop(True); by default (what trainers, audits and accelerator programs get) every loop is static."""
    q, q_pos, ck, cv, clen, k, v, k_pos, k_mask = _case(4)

    def report(**kw):
        low = jax.jit(lambda *a: _attn(*a, causal=True, window=5, chunk=8, fresh=True, **kw)).lower(
            q, q_pos, ck, cv, clen, k, v, k_pos, k_mask)
        return loop_report(low.as_text())

    assert report(live=True)["dynamic"] >= 1
    static = report()
    assert static["dynamic"] == 0 and static["static"] >= 1, static
    # The rule per platform: CPU programs take the live-length loop, accelerators the static form.
    assert buckets.uses_live_length_loop("cpu") and not buckets.uses_live_length_loop("cuda")
    assert not buckets.uses_live_length_loop("gpu") and not buckets.uses_live_length_loop("tpu")


# -- through the model -------------------------------------------------------------------------------------------

CFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)


@functools.partial(jax.jit, static_argnames=("windows",))
def _fwd(target, tokens, cache, *, windows):
    return forward_with_cache(target, tokens, cache, (0, 2), windows=windows)


def test_target_windows_per_layer_through_cache_chunks():
    """Per-layer windows reach attention: a cache-free forward with windows (3, None, 5) equals a prefill of 13
    tokens (4 query x 4 key blocks) + an extension of 6 through a 19-slot cache visited in chunks of 4 (the window
    masks whole chunks; the last chunk is clamped to end at slot 19), and a window covering the whole sequence changes
    nothing."""
    target = make_target(CFG, 0)
    tok = np.random.default_rng(0).integers(0, 64, (2, 19)).astype(np.int32)
    windows = (3, None, 5)
    ref_logits, ref_feats, _ = _fwd(target, tok, None, windows=windows)
    cache = KVCache.empty(CFG, 2, 19)
    with attention_chunk(4):
        l1, f1, cache = _fwd(target, tok[:, :13], cache, windows=windows)
        l2, f2, cache = _fwd(target, tok[:, 13:], cache, windows=windows)
    np.testing.assert_allclose(np.concatenate([l1, l2], 1), ref_logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.concatenate([f1, f2], 1), ref_feats, rtol=2e-5, atol=2e-5)
    full, _, _ = _fwd(target, tok, None, windows=(None,) * 3)
    wide, _, _ = _fwd(target, tok, None, windows=(19, 19, 19))
    np.testing.assert_allclose(wide, full, rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(full) - np.asarray(ref_logits)).max() > 1e-3  # the windows did something


def test_generation_with_chunked_attention_is_exact():
    """Greedy DFlash with attention visiting caches 8 slots at a time (nested loops in the decode loop) equals
    greedy decoding with one dense pass, on ragged prompts up to 30 tokens (caches of 128 slots)."""
    dcfg = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=63,
                         target_layer_ids=(0, 2), num_target_layers=3)
    target, drafter = make_target(CFG, 3), make_drafter(dcfg, 4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 63, n).tolist() for n in (30, 5, 17)]
    ar = dj.generate_autoregressive(target, prompts, max_new_tokens=24)
    with attention_chunk(8):  # 16 blocks over the 128-slot caches, query blocks in the 32-token prefill
        sp = dj.generate(target, drafter, prompts, max_new_tokens=24)
    np.testing.assert_array_equal(sp.tokens, ar.tokens)
    assert (sp.num_tokens == 24).all()


def test_generation_live_length_loop_equals_static_form(monkeypatch):
    """Greedy DFlash and autoregressive decoding through the live-length loop (CPU's rule, 8-slot blocks, ragged
    rows) give exactly the tokens of the static form (accelerators' rule) and of each other."""
    dcfg = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=63,
                         target_layer_ids=(0, 2), num_target_layers=3)
    target, drafter = make_target(CFG, 5), make_drafter(dcfg, 6)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 63, n).tolist() for n in (30, 5, 17)]
    out = {}
    for live in (True, False):
        monkeypatch.setitem(buckets.LIVE_LENGTH_LOOP, "cpu", live)
        call = G.speculative_call(target, drafter, prompts, max_new_tokens=24)
        assert call.context.live_length_loop is (live if jax.default_backend() == "cpu" else False)
        with attention_chunk(8):
            out[live] = (dj.generate(target, drafter, prompts, max_new_tokens=24, max_cache_len=96),
                         dj.generate_autoregressive(target, prompts, max_new_tokens=24, max_cache_len=96))
    for res in (*out[True], out[False][0]):
        np.testing.assert_array_equal(res.tokens, out[False][1].tokens)
    np.testing.assert_array_equal(out[True][0].acceptance_lengths, out[False][0].acceptance_lengths)


def test_prefill_memory_is_linear_in_the_prompt():
    """Blocked attention over the prompt: the compiled temp memory of prefill grows ~linearly from 2k to 8k prompt
    tokens (before blocking it was T x T scores: 15.9x here), compiled only, never run."""
    from dflash_jax.bench.compile import SMALL_PREFILL, prefill_temp_bytes
    small, large = prefill_temp_bytes(SMALL_PREFILL, 2048), prefill_temp_bytes(SMALL_PREFILL, 8192)
    assert large / small <= 4.5, (small, large)


def test_attention_chunk_is_an_execution_setting():
    """Not a config field any more; orbax saves made before still load (their config carries the old field), and
    a bad block size is refused with its name."""
    import dataclasses

    from dflash_jax.io.orbax_folder import config_from_saved_json
    from dflash_jax.models.attention import block_sizes
    assert "attention_chunk" not in {f.name for f in dataclasses.fields(TargetConfig)}
    old = dict(dataclasses.asdict(CFG), attention_chunk=256)
    assert config_from_saved_json("target", old) == CFG
    dcfg = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=63,
                         target_layer_ids=(0, 2), num_target_layers=3)
    saved = dataclasses.asdict(dcfg)
    saved["model"]["attention_chunk"] = 256
    assert config_from_saved_json("drafter", saved) == dcfg
    with attention_chunk(4):
        assert block_sizes(2, 100) == (4, 4)
    assert block_sizes(1, 16) == (512, 65536)  # a batch-1 verify reads a 16k cache in one pass
    with pytest.raises(ValueError, match="attention chunk must be an int >= 1, got 0"):
        block_sizes(1, 1, 0)
