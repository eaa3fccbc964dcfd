"""No host round trip inside a decode step, shown on this CPU host: the speculative program is exported for CUDA
(`jax.export`, platforms=["cuda"]) and its StableHLO is walked. On XLA:GPU a `while` whose trip count depends on
data, and every `case` / `if`, copies its predicate to the host on each execution (unless command buffers with
conditional nodes are on), so inside the generation loop there must be none: the module holds exactly one while
loop that is not provably static (the generation loop itself, at the top level), every other while compares a
counter to a constant and steps it by a constant (scan / fori_loop with static bounds: attention's key and query
blocks, DFlash2's selector walk), and no conditional at all. Greedy and sampled (top-k, top-p and p_min all on),
DFlash and DFlash2, with attention blocks small enough that every block loop is present, and an NVFP4 drafter on the
Pallas backend (its kernel lowers to one Triton call, opaque here). The CUDA export takes the accelerators'
execution settings whatever host exports it; the program CPU builds does use the live-length loop (attention's
data-dependent chunk loops, free on a CPU) and the CUDA export of the same call does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import dflash_jax as dj
from dflash_jax.bench.lowering import loop_report, prefill_module, speculative_module
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decode import programs as G
from dflash_jax.models.attention import attention_chunk
from dflash_jax import execution
from dflash_jax.quant import cpu_kernel
from random_models import make_drafter, make_target, nontrivial_dflash2

CFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
DCFG = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=63, target_layer_ids=(0, 1),
                     num_target_layers=2)
DCFG2 = DCFG.replace(kind="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=4)
PROMPTS = [list(range(1, 21)), [5, 6, 7]]  # 20 tokens: the prompt bucket is split into query blocks of 8
CHUNK = 8  # keys and queries per attention block: loops over the 8-slot blocks of every cache
SAMPLED = dict(temperature=0.8, top_k=5, top_p=0.9, p_min=0.05)


def _export(target, drafter, **kw):
    return speculative_module(target, drafter, PROMPTS, chunk=CHUNK, max_new_tokens=16, **kw)


@pytest.fixture(scope="module")
def models():
    target = make_target(CFG, 0)
    d2 = make_drafter(DCFG2, 2)
    d2 = d2.replace(params=nontrivial_dflash2(d2.params, 3))
    return target, {"dflash": make_drafter(DCFG, 1), "dflash2": d2}


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_speculative_step_has_no_data_dependent_loop_or_conditional(models, kind, sampling):
    target, drafters = models
    kw = dict(p_min=0.05) if sampling == "greedy" else SAMPLED
    rep = loop_report(_export(target, drafters[kind], **kw))
    assert rep["conditionals"] == 0, rep
    assert rep["dynamic"] == 1 and rep["dynamic_at_top"] == 1, rep  # the generation loop, and nothing else
    # The block loops are really there, so the test sees them and proves them static: inside the generation loop,
    # attention over the 8-slot blocks of the target's and the drafter's caches (XLA functions shared by the layers
    # count once). Prefill is a program of its own: its query / key block loops are all static, no conditional.
    assert rep["dynamic_nested"] >= 2 and rep["static"] >= rep["dynamic_nested"], rep
    pre = loop_report(prefill_module(target, drafters[kind], PROMPTS, chunk=CHUNK, max_new_tokens=16, **kw))
    assert pre["dynamic"] == 0 and pre["conditionals"] == 0 and pre["static"] >= 2, pre


def test_cpu_program_uses_the_live_length_loop_and_the_cuda_export_does_not(models):
    """Same call, two platforms: the loop program `generate` builds on this CPU host (lowered for it, as it runs) and
    a CPU export attend to their live keys only: through the CPU kernel's fixed-order rows where it is built (one
    call per layer that visits the visible keys alone: no loop at all), else in attention's data-dependent chunk
    loops nested in the generation loop (their trip count follows the longest live row); the CUDA export, made on
    this same host, holds neither (the accelerators' rule: static block loops)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU rule is checked on a CPU host")
    target, drafters = models
    with attention_chunk(CHUNK):
        call = G.speculative_call(target, drafters["dflash"], PROMPTS, max_new_tokens=16)
        built_text = call.lower()[1].as_text()  # the program generate compiles here
    assert call.context.live_length_loop is True and call.context.attention_chunk == CHUNK
    cpu_text = _export(target, drafters["dflash"], platform="cpu")
    cuda_text = _export(target, drafters["dflash"])
    for text in (built_text, cpu_text):
        rep = loop_report(text)
        assert rep["dynamic_at_top"] == 1 and rep["conditionals"] == 0, rep
        if cpu_kernel.available():  # the target's cache and the drafter's context, through the kernel
            assert text.count(cpu_kernel.ATTENTION_TARGET) >= 2 and rep["dynamic_nested"] == 0, rep
            assert cpu_kernel.ARGMAX_TARGET in text  # greedy tokens in one pass of the kernel
        else:  # the generation loop, and attention's live-length loops nested in it
            assert rep["dynamic"] >= 3 and rep["dynamic_nested"] >= 2, rep
    cuda = loop_report(cuda_text)
    assert cuda["dynamic"] == 1 and cuda["dynamic_at_top"] == 1 and cuda["conditionals"] == 0, cuda
    assert cuda["static"] >= 2, cuda  # its attention block loops, with static trip counts
    assert cpu_kernel.ATTENTION_TARGET not in cuda_text and cpu_kernel.ARGMAX_TARGET not in cuda_text


def test_the_cpu_loops_reduce_rows_of_logits_in_the_kernel(models):
    """Where the CPU kernel is built, the loop programs `generate` builds on this CPU take every row reduction over
    logits without top-k / top-p through it: a sampled chain's draft q and drafts (`softmax_draw`), the target's
    log-sum-exp at the drafts and the residual's draw (`row_logsumexp`, `residual_draw`); a greedy tree's top k and
    log-sum-exp of the draft rows (`top_k`); with top-k / top-p the XLA forms (none of them)."""
    if jax.default_backend() != "cpu" or not cpu_kernel.available():
        pytest.skip("the CPU kernel's rule is checked on a CPU host with the kernel")
    target, drafters = models

    def text(**kw):
        return G.speculative_call(target, drafters["dflash"], PROMPTS, max_new_tokens=16, **kw).lower()[1].as_text()
    sampled = text(temperature=0.7, draft_length=3)
    for name in (cpu_kernel.SOFTMAX_DRAW_TARGET, cpu_kernel.LOGSUMEXP_TARGET, cpu_kernel.RESIDUAL_TARGET):
        assert name in sampled, name
    tree = text(tree_budget=3)
    assert cpu_kernel.TOP_K_TARGET in tree and cpu_kernel.LOGSUMEXP_TARGET in tree
    filtered = text(temperature=0.7, top_p=0.9, draft_length=3)
    for name in (cpu_kernel.SOFTMAX_DRAW_TARGET, cpu_kernel.LOGSUMEXP_TARGET, cpu_kernel.RESIDUAL_TARGET):
        assert name not in filtered, name


def test_nvfp4_drafter_on_pallas_lowers_without_loops_or_conditionals(models):
    target, drafters = models
    quantized = dj.quantize_nvfp4(drafters["dflash"])
    with execution.changed(pallas_interpret=False):  # the Triton lowering, for CUDA, on this host
        text = _export(target, quantized, nvfp4_backend="pallas", **SAMPLED)
    assert "triton" in text
    rep = loop_report(text)
    assert rep["conditionals"] == 0 and rep["dynamic"] == 1 and rep["dynamic_at_top"] == 1, rep


def test_the_checker_catches_a_data_dependent_loop_and_a_cond():
    """The report is not blind: a fori_loop to a traced bound and a lax.cond are both flagged."""
    def f(n, x):
        x = jax.lax.fori_loop(0, n, lambda i, x: x + 1.0, x)  # trip count = data
        x = jax.lax.fori_loop(0, 4, lambda i, x: x * 2.0, x)  # static
        return jax.lax.cond(x.sum() > 0, lambda x: x, lambda x: -x, x)

    text = export.export(jax.jit(f), platforms=["cuda"])(jnp.int32(3), jnp.ones(2)).mlir_module()
    rep = loop_report(text)
    assert rep["dynamic"] == 1 and rep["static"] == 1 and rep["conditionals"] == 1, rep
