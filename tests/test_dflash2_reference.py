"""DFlash2 drafters (and sliding-window / causal layers for both kinds) against an independent torch reference.

The reference below restates z-lab's `DFlash2DraftModel` semantics (dflash/model.py at 07ebd93db9f4, with its
fixture tests/fixtures/dflash2-config.json) in float64 with explicit loops, written from that description and not from dflash_jax:
  * block embeddings = target embedding * input_embedding_scale;
  * per layer, around attention and around the MLP: dyn = kernel_projection(x) viewed [T, 2, Kc, groups];
    prepare u_t = sum_o (base[0, o, c] + dyn_t[0, o, c // G]) * x_{t-o} (nothing before the block start), the
    sublayer runs on u (attention: queries, block keys and values all from u; context K/V from the fused context),
    finish y_t = sum_o (base[1, o, c] + dyn_t[1, o, c // G]) * f(u)_{t-o};
  * a key at position k is visible to a query at q iff (not causal or k <= q) and (no window or q - k < W, and when
    not causal also k - q < W), causal = (layer is sliding) unless is_causal is given, window only for sliding layers;
  * logits = lm_head(norm(h)) * output_multiplier, then cap * tanh(. / cap);
  * the selector walks slots 1..bs-1 from the block's first token: top-k of the logits, score = unary +
    sum_r A[prev, r] P(h_t)_r B[cand, r], greedy argmax (or softmax(scores / T) for q).
Weights are random with the conv and selector made non-trivial (random base kernels and dynamic taps, selector scores
that overrule the argmax of the logits on many slots). Negative controls show the comparison sees classic mistakes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torch_reference import rel_err, rms, rope, torch_inputs
from dflash_jax.models.attention import attention_chunk

import dflash_jax as dj
from helpers import tiny_qwen3
from random_models import random_params
from dflash_jax.models import selector as sel_mod
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import empty_draft_cache, append_context, block_logits, draft_proposal, draft_tokens
from dflash_jax.params import abstract_drafter, map_named, named_leaves
from dflash_jax.models.attention import visible

REL_TOL = 1e-4


def _t(**kw):
    return tiny_qwen3(**{**dict(intermediate_size=48, num_hidden_layers=3), **kw})


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    target: TargetConfig
    drafter: DrafterConfig
    ctx_len: int
    batch: int = 2


def _d(model, **kw):
    base = dict(model=model, block_size=6, mask_token_id=model.vocab_size - 1, target_layer_ids=(0, 2),
                num_target_layers=3)
    base.update(kw)
    return DrafterConfig(**base)


T1, T2 = _t(), _t(vocab_size=80, tie_word_embeddings=True, num_hidden_layers=2)
CASES = [
    # sliding (causal by z-lab's rule, window 3 < block) then full (non-causal); all three multipliers; Kc 2, 4 groups
    Case("dflash2-sliding-causal-then-full", T1, _d(
        T1.replace(num_hidden_layers=2), kind="dflash2", layer_types=("sliding_attention", "full_attention"),
        sliding_window=3, input_embedding_scale=1.5, output_multiplier=0.7, final_logit_softcapping=2.5,
        conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5), ctx_len=9),
    # explicitly non-causal sliding layers (window 4: ctx and later block slots cut), Kc 3, 2 groups, block 8,
    # tied target head, top_k = 7
    Case("dflash2-noncausal-window-kc3", T2, _d(
        T2.replace(num_hidden_layers=2, num_key_value_heads=4, intermediate_size=40), kind="dflash2", block_size=8,
        target_layer_ids=(1,), num_target_layers=2, is_causal=False, sliding_window=4,
        layer_types=("sliding_attention",) * 2, conv_kernel_size=3, conv_group_size=16, selector_rank=6,
        selector_top_k=7), ctx_len=6, batch=3),
    # a DFlash drafter with a causal full-attention layer and a sliding one (the rules hold for both kinds)
    Case("dflash-causal-sliding", T1, _d(
        T1.replace(num_hidden_layers=2), is_causal=True, layer_types=("full_attention", "sliding_attention"),
        sliding_window=5, input_embedding_scale=0.5), ctx_len=7),
]


def _build(case: Case, seed: int = 0):
    from random_models import make_target
    target = make_target(case.target, seed)
    params = random_params(abstract_drafter(case.drafter), seed + 1)
    if case.drafter.is_dflash2:
        rng = np.random.default_rng(seed + 3)

        def nontrivial(name, x):  # codebooks x3: the pair term overrules the logits' argmax on many slots
            if name.endswith("_codebook"):
                return x * 3.0
            if name.endswith("base_kernel"):  # random taps around the identity, tap 1+ clearly non-zero
                return jnp.asarray(np.asarray(x) * 0.5 + (np.arange(x.shape[1]) == 0)[None, :, None], jnp.float32)
            return x

        params = map_named(nontrivial, params)
        del rng
    drafter = dj.Drafter(params=params, config=case.drafter)
    rng = np.random.default_rng(seed + 2)
    H = case.target.hidden_size
    features = rng.standard_normal((case.batch, case.ctx_len, case.drafter.num_taps * H)).astype(np.float32)
    block = np.full((case.batch, case.drafter.block_size), case.drafter.mask_token_id, np.int32)
    block[:, 0] = rng.integers(0, case.target.vocab_size - 1, case.batch)
    block[-1, 2] = 5  # a real token inside the block: causal layers must not see it from slots 1
    return target, drafter, features, block


# -- the torch reference -------------------------------------------------------------------------------------------


def _conv(x, dyn, base, group):
    """Naive causal conv inside one block: x [B, T, H], dyn [B, T, Kc, groups], base [Kc, H]."""
    B, T, H = x.shape
    out = torch.zeros_like(x)
    for t in range(T):
        for o in range(base.shape[0]):
            if t - o >= 0:
                out[:, t] += (base[o][None, :] + dyn[:, t, o].repeat_interleave(group, dim=-1)) * x[:, t - o]
    return out


def _visible(qp, kp, causal, window, inclusive=False):
    ok = True
    if causal:
        ok = ok and kp <= qp
    if window is not None:
        lt = (lambda a: a <= window) if inclusive else (lambda a: a < window)
        ok = ok and lt(qp - kp) and (causal or lt(kp - qp))
    return ok


def reference(drafter, target, features, block, *, dyn_order="side,tap,group", walk_from="anchor",
              window_inclusive=False, softcap_first=False):
    """(logits [B, bs-1, V], greedy tokens [B, bs-1], scores along the path [B, bs-1, k] or None) in float64.
    The keyword flags inject known mistakes for the negative controls; the defaults are the reference."""
    dc = drafter.config
    m = dc.model
    w, tw, head, feats, blk = torch_inputs(drafter, target, features, block)
    B, C, _ = feats.shape
    bs = blk.shape[1]
    nH, nKV, hd, eps = m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.rms_norm_eps
    ctx = rms(feats @ w["fc"].T, w["hidden_norm"], eps)
    x = tw["embed_tokens"][blk] * dc.input_embedding_scale
    q_pos = C + torch.arange(bs)
    k_pos = torch.cat([torch.arange(C), q_pos])
    two = dc.kind == "dflash2"
    Kc, G = dc.conv_kernel_size, dc.conv_group_size
    groups = m.hidden_size // G

    def prepare(xin, prefix):
        raw = xin @ w[prefix + ".kernel_projection"].T  # [B, T, 2*Kc*groups]
        if dyn_order == "side,tap,group":
            dyn = raw.view(B, bs, 2, Kc, groups)
        else:  # mistake: groups outermost
            dyn = raw.view(B, bs, groups, Kc, 2).permute(0, 1, 4, 3, 2)
        base = w[prefix + ".base_kernel"]
        return _conv(xin, dyn[:, :, 0], base[0], G), (dyn[:, :, 1], base[1])

    for i in range(m.num_hidden_layers):
        p = f"layers.{i}."
        layer_type = dc.layer_types[i] if dc.layer_types else "full_attention"
        causal = (layer_type == "sliding_attention") if dc.is_causal is None else dc.is_causal
        window = dc.sliding_window if layer_type == "sliding_attention" else None
        allowed = torch.tensor([[_visible(int(a), int(b), causal, window, window_inclusive) for b in k_pos]
                                for a in q_pos])
        xn = rms(x, w[p + "input_layernorm"], eps)
        if two:
            xn, keep = prepare(xn, p + "attention_conv")
        q = rope(rms((xn @ w[p + "self_attn.q_proj"].T).view(B, bs, nH, hd), w[p + "self_attn.q_norm"], eps),
                  q_pos, m.rope_theta, m.rope_scaling_factor)
        kv_in = torch.cat([ctx, xn], dim=1)
        k = rope(rms((kv_in @ w[p + "self_attn.k_proj"].T).view(B, C + bs, nKV, hd), w[p + "self_attn.k_norm"],
                       eps), k_pos, m.rope_theta, m.rope_scaling_factor)
        v = (kv_in @ w[p + "self_attn.v_proj"].T).view(B, C + bs, nKV, hd)
        rep = nH // nKV
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
        scores = scores.masked_fill(~allowed[None, None], float("-inf"))
        a = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, bs, nH * hd) @ w[p + "self_attn.o_proj"].T
        if two:
            a = _conv(a, keep[0], keep[1], G)
        x = x + a
        h2 = rms(x, w[p + "post_attention_layernorm"], eps)
        if two:
            h2, keep = prepare(h2, p + "mlp_conv")
        f = (torch.nn.functional.silu(h2 @ w[p + "mlp.gate_proj"].T) * (h2 @ w[p + "mlp.up_proj"].T)) @ \
            w[p + "mlp.down_proj"].T
        if two:
            f = _conv(f, keep[0], keep[1], G)
        x = x + f
    h = rms(x, w["norm"], eps)[:, 1:]
    logits = h @ head.T
    cap = dc.final_logit_softcapping
    if softcap_first and cap:
        logits = torch.tanh(logits / cap) * cap * dc.output_multiplier
    else:
        logits = logits * dc.output_multiplier
        if cap:
            logits = torch.tanh(logits / cap) * cap
    if not two:
        return logits.numpy(), logits.argmax(-1).numpy(), None
    A, Bc = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    proj = h @ w["candidate_selector.hidden_projection"].T  # [B, D, r]
    prev = blk[:, 0] if walk_from == "anchor" else torch.full((B,), dc.mask_token_id)
    toks, path_scores = [], []
    for t in range(bs - 1):
        unary, cand = torch.topk(logits[:, t], dc.selector_top_k, dim=-1)
        s = unary + ((A[prev] * proj[:, t])[:, None, :] * Bc[cand]).sum(-1)  # [B, k]
        prev = cand.gather(1, s.argmax(-1, keepdim=True))[:, 0]
        toks.append(prev)
        path_scores.append(s)
    return logits.numpy(), torch.stack(toks, 1).numpy(), torch.stack(path_scores, 1).numpy()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def built(request):
    case = request.param
    target, drafter, features, block = _build(case)
    prop = draft_proposal(target, drafter, features, block)
    return case, target, drafter, features, block, prop, reference(drafter, target, features, block)


def test_logits_tokens_and_scores_match_reference(built):
    case, target, drafter, features, block, prop, (ref_logits, ref_tokens, ref_scores) = built
    D = case.drafter.block_size - 1
    assert prop.logits.shape == (case.batch, D, case.target.vocab_size)
    err = rel_err(prop.logits, ref_logits)
    print(f"\n[dflash2 reference] {case.name}: logits rel err {err:.2e}")
    assert err <= REL_TOL, err
    np.testing.assert_array_equal(np.asarray(dj.draft_logits(target, drafter, features, block)),
                                  np.asarray(prop.logits))
    np.testing.assert_array_equal(np.asarray(prop.tokens), ref_tokens)
    np.testing.assert_array_equal(np.asarray(draft_tokens(target, drafter, features, block)), ref_tokens)
    if case.drafter.is_dflash2:
        assert prop.scores.shape == (case.batch, D, case.drafter.selector_top_k)
        assert rel_err(prop.scores, ref_scores) <= REL_TOL
        # the selector is not a no-op here: it overrules the logits' argmax on a good share of the slots
        differs = (np.asarray(prop.tokens) != ref_logits.argmax(-1)).mean()
        print(f"  selector path differs from argmax(logits) on {100 * differs:.0f}% of slots")
        assert differs >= 0.2, differs
        # softcapping really acts (some |logit| well inside the tanh's bend) where a cap is set
        if case.drafter.final_logit_softcapping:
            assert np.abs(ref_logits).max() > 0.6 * case.drafter.final_logit_softcapping
        # the q of rejection sampling: softmax of the path's scores at T over the k candidates
        q = np.asarray(sel_mod.selector_probs(prop.scores, 0.7))
        want = np.exp(ref_scores / 0.7 - (ref_scores / 0.7).max(-1, keepdims=True))
        np.testing.assert_allclose(q, want / want.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mistake", [dict(dyn_order="group,tap,side"), dict(walk_from="mask"),
                                     dict(window_inclusive=True), dict(softcap_first=True)],
                         ids=lambda m: next(iter(m)))
def test_comparison_is_sensitive_to_known_mistakes(mistake):
    case = CASES[0]
    target, drafter, features, block = _build(case)
    prop = draft_proposal(target, drafter, features, block)
    logits, tokens, scores = reference(drafter, target, features, block, **mistake)
    if "walk_from" in mistake:  # the logits are right, the walk is not
        assert rel_err(prop.logits, logits) <= REL_TOL
        assert (np.asarray(prop.tokens) != tokens).any() or rel_err(prop.scores, scores) > 1e-2
    else:
        assert rel_err(prop.logits, logits) > 100 * REL_TOL, mistake


def test_identity_conv_and_zero_selector_equal_dflash():
    """A fresh DFlash2 drafter (init: identity base kernel, zero dynamic taps, zero hidden projection) proposes
    exactly what the same weights as a DFlash drafter propose: the module starts as a no-op."""
    case = CASES[0]
    target, drafter, features, block = _build(case)
    fresh = dj.init_drafter(case.drafter, jax.random.key(0))
    plain_cfg = dataclasses.replace(case.drafter, kind="dflash")
    base = {n: v for n, v in named_leaves(drafter.params).items()}
    fresh_named = named_leaves(fresh.params)
    conv_or_sel = [n for n in fresh_named if "conv" in n or "selector" in n]
    for n in conv_or_sel:
        base[n] = fresh_named[n]
    from dflash_jax.params import from_named
    d2 = dj.Drafter(params=from_named(abstract_drafter(case.drafter), base), config=case.drafter)
    d1 = dj.Drafter(params=from_named(abstract_drafter(plain_cfg), {n: base[n] for n in
                                                                   named_leaves(abstract_drafter(plain_cfg))}),
                    config=plain_cfg)
    np.testing.assert_allclose(np.asarray(dj.draft_logits(target, d2, features, block)),
                               np.asarray(dj.draft_logits(target, d1, features, block)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(draft_tokens(target, d2, features, block)),
                                  np.asarray(draft_tokens(target, d1, features, block)))


def test_sampled_walk_is_gumbel_max_over_path_scores():
    """At T > 0 each slot's index is argmax(scores / T + Gumbel(u)) with the scores of the *sampled* predecessor."""
    case = CASES[0]
    target, drafter, features, block = _build(case)
    prop = draft_proposal(target, drafter, features, block)
    cand, unary = np.asarray(prop.candidates), np.asarray(jax.lax.top_k(prop.logits, 5)[0])
    sel = drafter.params.candidate_selector
    from dflash_jax.models.drafter import block_hidden, cached_context
    h = jax.jit(lambda d, t, f, b: block_hidden(d, t, b, cached_context(d, f))[:, 1:])(drafter, target, features,
                                                                                        block)
    u = np.random.default_rng(5).uniform(1e-6, 1, cand.shape).astype(np.float32)
    tokens, _, scores = jax.jit(functools.partial(sel_mod.select, top_k=5))(sel, h, prop.logits, block[:, 0],
                                                                             temperature=0.8, uniforms=u)
    A, Bc = np.asarray(sel.predecessor_codebook, np.float64), np.asarray(sel.successor_codebook, np.float64)
    proj = np.asarray(h, np.float64) @ np.asarray(sel.hidden_projection, np.float64).T
    for b in range(case.batch):
        prev = int(block[b, 0])
        for t in range(cand.shape[1]):
            s = unary[b, t] + (A[prev] * proj[b, t]) @ Bc[cand[b, t]].T
            np.testing.assert_allclose(np.asarray(scores)[b, t], s, rtol=1e-4, atol=1e-4)
            idx = int(np.argmax(s / 0.8 - np.log(-np.log(u[b, t]))))
            prev = int(cand[b, t, idx])
            assert int(tokens[b, t]) == prev
    assert (np.asarray(tokens) != np.asarray(prop.tokens)).any()  # sampling really departs from the greedy path


# -- the visibility rule -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", list(itertools.product([False, True], [None, 1, 3, 100])))
def test_layer_visibility_matches_naive_rule(causal, window):
    rng = np.random.default_rng(int(causal) * 10 + (window or 0))
    q = np.sort(rng.integers(0, 40, (2, 6)), axis=1)
    k = np.concatenate([np.tile(np.arange(30), (2, 1)), q], axis=1)
    got = visible(jnp.asarray(q)[:, :, None], jnp.asarray(k)[:, None, :], causal=causal, window=window)
    want = np.array([[[_visible(int(a), int(c), causal, window) for c in k[b]] for a in q[b]] for b in range(2)])
    np.testing.assert_array_equal(np.asarray(got), want)


def test_layer_attention_follows_zlab_rule():
    m = T1.replace(num_hidden_layers=2)
    cfg = _d(m, layer_types=("sliding_attention", "full_attention"), sliding_window=7)
    assert cfg.layer_attention(0) == (True, 7) and cfg.layer_attention(1) == (False, None)
    cfg = cfg.replace(is_causal=False)
    assert cfg.layer_attention(0) == (False, 7) and cfg.layer_attention(1) == (False, None)
    cfg = cfg.replace(is_causal=True, layer_types=None)
    assert cfg.layer_attention(0) == (True, None)


@pytest.mark.parametrize("chunk", [None, 4])
def test_window_cuts_context_in_the_cached_path(chunk):
    """Cached path (context appended in two chunks, rows of different lengths) == the one-shot path on each row's
    own context, with a sliding window shorter than the context: the cache index is the absolute position. With
    chunk=4 the attention visits the 16 cache slots 4 at a time (all four chunks, the window masking the early ones)."""
    case = CASES[0]
    target, drafter, features, block = _build(case)
    lens = np.array([9, 6])
    f1, f2 = features[:, :4], np.zeros((2, 5, features.shape[-1]), np.float32)
    f2[0] = features[0, 4:9]
    f2[1, :2] = features[1, 4:6]

    @jax.jit
    def cached(drafter, target, f1, f2, block):
        c = empty_draft_cache(drafter.config, 2, 16)
        c = append_context(drafter, f1, jnp.array([4, 4]), c)
        c = append_context(drafter, f2, jnp.array([5, 2]), c)
        return block_logits(drafter, target, block, c)

    with attention_chunk(chunk):
        got = np.asarray(cached(drafter, target, f1, f2, block))
    for b in range(2):
        one = np.asarray(dj.draft_logits(target, drafter, features[b:b + 1, :lens[b]], block[b:b + 1]))
        np.testing.assert_allclose(got[b], one[0], rtol=2e-5, atol=2e-5)
