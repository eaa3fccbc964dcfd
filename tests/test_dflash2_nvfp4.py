"""NVFP4 DFlash2 drafters: every projection quantized (conv `kernel_projection`, selector `hidden_projection`
included), every new scale covered by `audit_scales`, and the ablation that drops only the conv and selector
tensor scales (the DFlash2 matmuls llama.cpp still runs without their scales) named exactly by the audit.
Acceptance under that ablation is measured on a trained drafter in test_train_dflash2.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.quant import nvfp4
from dflash_jax.models.drafter import draft_proposal
from dflash_jax.quant.nvfp4 import NVFP4Array
from dflash_jax.params import abstract_drafter, named_leaves
from dflash_jax.quant.quantize import DFLASH2_PROJECTIONS, ablated_forward, drop_global_scales, quantize_nvfp4
from random_models import make_target, nontrivial_dflash2, random_params
from helpers import context_and_block, logits_of_params, proposal_of_params

CFG = dj.TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
DCFG = dj.DrafterConfig(model=CFG.replace(num_hidden_layers=2), block_size=8, mask_token_id=127,
                        target_layer_ids=(1, 2), num_target_layers=4, kind="dflash2", conv_group_size=16,
                        selector_rank=16, selector_top_k=8, output_multiplier=0.5, final_logit_softcapping=8.0)
LINEARS_PER_LAYER = 7 + 2  # q k v o gate up down + two conv kernel projections


@pytest.fixture(scope="module")
def pair():
    target = make_target(CFG, 0)  # O(1) logits, so errors are measured against a real signal
    # std-0.02 layers (as trained drafters start; O(1) random layers amplify any rounding chaotically) with the conv
    # and selector made non-trivial
    drafter = dj.Drafter(params=nontrivial_dflash2(random_params(abstract_drafter(DCFG), 1, std=0.02), 2),
                         config=DCFG)
    return (target, drafter, *context_and_block(target, DCFG))


def test_rtn_quantizes_every_projection_including_conv_and_selector(pair):
    _, drafter, _, _ = pair
    q = quantize_nvfp4(drafter)
    dense, quant = named_leaves(drafter.params), named_leaves(q.params)
    linears = [n for n in dense if n == "fc" or n.endswith(("_proj", "kernel_projection", "hidden_projection"))]
    assert len(linears) == 1 + LINEARS_PER_LAYER * 2 + 1
    assert {"layers.1.attention_conv.kernel_projection", "layers.0.mlp_conv.kernel_projection",
            "candidate_selector.hidden_projection"} <= set(linears)
    for name, leaf in quant.items():
        if name in linears:
            ref = nvfp4.quantize(np.asarray(dense[name]))
            assert isinstance(leaf, NVFP4Array), name
            np.testing.assert_array_equal(np.asarray(leaf.packed), np.asarray(ref.packed))
            np.testing.assert_array_equal(np.asarray(leaf.block_scale).view(np.uint8),
                                          np.asarray(ref.block_scale).view(np.uint8))
            assert float(leaf.global_scale) == float(ref.global_scale)
        else:  # norms, conv base kernels and codebooks stay dense
            assert not isinstance(leaf, NVFP4Array), name


def test_audit_covers_every_new_scale(pair):
    target, drafter, feats, block = pair
    q = quantize_nvfp4(drafter)
    audit = dj.audit_scales(proposal_of_params(target, q), q.params, feats, block)
    assert audit.ok and len(audit.checked) == 1 + LINEARS_PER_LAYER * 2 + 1, str(audit)
    assert {"layers[0].attention_conv.kernel_projection", "layers[1].mlp_conv.kernel_projection",
            "candidate_selector.hidden_projection"} <= set(audit.checked)
    # The selector's projection only reaches the selector scores: a forward returning draft logits alone cannot
    # vouch for it, and the audit says so.
    logits_only = dj.audit_scales(logits_of_params(target, q), q.params,
                                  feats, block)
    assert set(logits_only.missing) == {"candidate_selector.hidden_projection: block_scale",
                                        "candidate_selector.hidden_projection: global_scale"}


def test_conv_and_selector_ablation_is_named_exactly(pair):
    target, drafter, feats, block = pair
    q = quantize_nvfp4(drafter)
    # localize=False: the same `missing` without one op-by-op forward per leaf to name the (expected) mismatch
    audit = dj.audit_scales(ablated_forward(proposal_of_params(target, q), DFLASH2_PROJECTIONS), q.params, feats,
                            block, localize=False)
    expected = {f"layers[{i}].{c}.kernel_projection: global_scale" for i in range(2)
                for c in ("attention_conv", "mlp_conv")} | {"candidate_selector.hidden_projection: global_scale"}
    assert set(audit.missing) == expected, str(audit)
    # The falsified value wrecks the drafter's proposals; the real NVFP4 one barely moves them.
    ref = draft_proposal(target, drafter, feats, block)
    good = draft_proposal(target, q, feats, block)
    bad = draft_proposal(target, drop_global_scales(q, DFLASH2_PROJECTIONS), feats, block)
    err = lambda p: float(jnp.abs(p.logits - ref.logits).mean())
    assert err(bad) > 5 * err(good)
    same = lambda p: float((np.asarray(p.tokens) == np.asarray(ref.tokens)).mean())
    print(f"\n[dflash2 nvfp4] proposals equal to dense: nvfp4 {same(good):.2f}, conv+selector scales dropped "
          f"{same(bad):.2f}")
    assert same(bad) < same(good)


def test_generation_with_nvfp4_dflash2_stays_exact(pair):
    target, drafter, _, _ = pair
    q = quantize_nvfp4(drafter)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    ar = dj.generate_autoregressive(target, prompts, max_new_tokens=20)
    for d in (q, drop_global_scales(q, DFLASH2_PROJECTIONS)):
        np.testing.assert_array_equal(dj.generate(target, d, prompts, max_new_tokens=20).tokens, ar.tokens)
