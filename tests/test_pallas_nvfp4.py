"""The Pallas W4A16 NVFP4 kernel (dflash_jax/quant/pallas_nvfp4.py) and `linear(..., backend="pallas")`.

On CPU the kernel runs in Pallas interpret mode: the same kernel code, executed by XLA:CPU. Interpret mode hides
what only a GPU compile sees (Triton's power-of-two shapes, dot sizes >= 16, no 8-bit arithmetic, no gather) and
reads out-of-bounds tiles as NaN (floats) or 0 (uint8) instead of garbage. So besides numerics against the portable
path (ragged N and K, M = 1, 3, 16, 33, the Qwen3-8B shapes) these tests
  * lower the kernel for CUDA with jax.export on this CPU-only host (the Triton lowering raises the errors a GPU
    compile would) and check the emitted Triton IR masks exactly the loads that can leave the arrays;
  * use float32 block scales, whose out-of-bounds reads are NaN in interpret mode, to prove the masks hold;
  * check that no dequantized copy of any weight exists outside the kernel in a compiled `generate` program;
  * run greedy `generate` with NVFP4 target and drafter on the pallas backend: tokens identical to portable and to
    autoregressive decoding, acceptance lengths identical to portable.
"""

from __future__ import annotations

import json
import importlib
import io
import re
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

import dflash_jax as dj
from dflash_jax import execution
from dflash_jax.quant import pallas_nvfp4 as P
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import empty_draft_cache, append_context, block_logits
from dflash_jax.quant.linear import linear, resolve_backend, set_default_backend
from helpers import clean_backend  # noqa: F401  (autouse: the default backend around every test)
from dflash_jax.quant.nvfp4 import E2M1_GRID, NVFP4Array, dequantize, quantize
from random_models import make_drafter, make_target
import report  # tests/report.py

linear_mod = importlib.import_module("dflash_jax.quant.linear")
G = importlib.import_module("dflash_jax.decode.programs")
TIMES: dict[str, float] = report.section("pallas_nvfp4 timings", lambda k, v: f"{k}: {v:.2f} s")

# Qwen3-8B linear weights, [out, in]: q/o_proj, gate/up_proj, down_proj, k/v_proj.
QWEN3_8B = [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]


def _rand(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _ref(x, q: NVFP4Array) -> np.ndarray:
    """float64 x @ dequant(q).T from the exactly dequantized weight."""
    x64 = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    return x64 @ np.asarray(dequantize(q), np.float64).T


def _rel(y, want) -> float:
    """max |y - want| / max |want| (normwise: elementwise ratios are meaningless near zero outputs)."""
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    return float(np.abs(y - want).max() / np.abs(want).max())


# -- the decoders, exhaustively ------------------------------------------------------------------------------------

def test_e2m1_decode_all_bytes():
    lo, hi = jax.jit(P.e2m1_pair_times_2m14)(jnp.arange(256, dtype=jnp.int32))
    codes = np.arange(256)
    np.testing.assert_array_equal(np.asarray(lo) * 2.0**14, E2M1_GRID[codes & 15])
    np.testing.assert_array_equal(np.asarray(hi) * 2.0**14, E2M1_GRID[codes >> 4])
    # -0.0 (code 8) keeps its sign, as the portable float4 path does
    assert np.signbit(np.asarray(lo)[8]) and np.signbit(np.asarray(hi)[0x80])


def test_e4m3_decode_all_bit_patterns():
    got = np.asarray(jax.jit(P.e4m3_times_2p14)(jnp.arange(256, dtype=jnp.int32))) / 2.0**14
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # subnormals, +-0, NaN at 0x7F/0xFF included


# -- numerics against the portable path ----------------------------------------------------------------------------

# (n, k, tiles): ragged N and K (K a multiple of 16 but not of the tile), a tiny N, an aligned case (no masks), and
# explicit small tiles with split K whose last split runs past K (fully masked tiles).
SHAPES = [
    (100, 208, None),  # N: 64 + 36 ragged; K: one 256 tile, 208 valid
    (24, 48, None),  # N < 16*2, K < 64: tiles shrink to 32 x 64
    (128, 512, P.Tiles(block_n=64, block_k=128)),  # aligned: no masks at all
    (70, 272, P.Tiles(block_n=16, block_k=64, split_k=3)),  # 5 K tiles (last 16/64 valid) over 3 splits of 2
]
MS = [1, 3, 16, 33]


@pytest.fixture(scope="module")
def ragged_weights():
    return {(n, k): quantize(_rand((n, k), 10 + i, 0.05)) for i, (n, k, _) in enumerate(SHAPES)}


@pytest.mark.parametrize("n,k,tiles", SHAPES, ids=lambda v: str(v) if not isinstance(v, P.Tiles) else "tiles")
@pytest.mark.parametrize("m", MS)
def test_kernel_f32_matches_reference_and_portable(ragged_weights, n, k, tiles, m):
    q = ragged_weights[(n, k)]
    x = jnp.asarray(_rand((m, k), 100 + m))
    y = jax.jit(lambda x, q: P.nvfp4_matmul(x, q, tiles=tiles))(x, q)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert np.isfinite(np.asarray(y)).all()
    want = _ref(x, q)
    assert _rel(y, want) <= 1e-6
    portable = jax.jit(lambda x, q: linear(x, q, backend="portable"))(x, q)
    assert _rel(y, np.asarray(portable, np.float64)) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m", [1, 33])
def test_kernel_16bit_activations(ragged_weights, dtype, m):
    n, k, tiles = SHAPES[3]
    q = ragged_weights[(n, k)]
    x = jnp.asarray(_rand((m, k), 7), dtype)
    y = jax.jit(lambda x, q: P.nvfp4_matmul(x, q, tiles=tiles))(x, q)
    assert y.dtype == dtype
    # The decoded tile is exact in 16 bits, so the only error is f32 accumulation + the final 16-bit rounding.
    assert _rel(y, _ref(x, q)) <= 4e-3
    portable = linear(x, q, backend="portable")  # rounds the dequantized weight (with s2) to 16 bits: a bit worse
    assert _rel(portable, _ref(x, q)) <= 2e-2


def test_partial_tiles_nan_free_with_nan_out_of_bounds_reads():
    """float32 block scales read NaN out of bounds in interpret mode: a missing K mask gives NaN outputs."""
    n, k = 70, 272
    q = quantize(_rand((n, k), 3, 0.05))
    q32 = q.replace(block_scale=q.block_scale.astype(jnp.float32))
    x = jnp.asarray(_rand((3, k), 4))
    tiles = P.Tiles(block_n=16, block_k=64, split_k=3)  # 5 K tiles, the last 16/64 valid, 6th fully past K
    plan = P.make_plan(3, n, k, x.dtype, jnp.float32, tiles)
    assert (plan.mask_m, plan.mask_n, plan.mask_k, plan.split, plan.per) == (True, True, True, 3, 2)
    out = np.asarray(P._launch(x, q32.packed, q32.block_scale, q32.global_scale, n=n, k=k, tiles=tiles,
                               interpret=True))
    assert out.shape == (3, 3, n) and np.isfinite(out).all()  # [split, M, N] partial sums, no padding stored
    y = P.nvfp4_matmul(x, q32, tiles=tiles)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(P.nvfp4_matmul(x, q, tiles=tiles)))
    np.testing.assert_allclose(np.asarray(y), out.sum(0), rtol=1e-6)


@pytest.fixture(scope="module")
def qwen_weights():
    t0 = time.perf_counter()
    ws = {s: quantize(_rand(s, i, 0.02)) for i, s in enumerate(QWEN3_8B)}
    TIMES["quantize Qwen3-8B shapes"] = time.perf_counter() - t0
    return ws


@pytest.mark.parametrize("shape", QWEN3_8B, ids=lambda s: f"{s[0]}x{s[1]}")
def test_qwen3_8b_shapes_f32(qwen_weights, shape):
    """The kernel's accuracy goal: pallas vs portable max relative error <= 1e-5 in f32 at the Qwen3-8B shapes."""
    q = qwen_weights[shape]
    t0 = time.perf_counter()
    for m in (1, 16):
        x = jnp.asarray(_rand((m, shape[1]), 50 + m))
        y = jax.jit(P.nvfp4_matmul)(x, q)
        portable = jax.jit(lambda x, q: linear(x, q, backend="portable"))(x, q)
        assert np.isfinite(np.asarray(y)).all()
        assert _rel(y, np.asarray(portable, np.float64)) <= 1e-5
        assert _rel(y, _ref(x, q)) <= 1e-6
    TIMES[f"interpret {shape[0]}x{shape[1]} M=1,16"] = time.perf_counter() - t0


# -- linear(..., backend="pallas") ---------------------------------------------------------------------------------

def test_linear_pallas_leading_dims_and_jit():
    q = quantize(_rand((40, 96), 20, 0.05))
    x = jnp.asarray(_rand((2, 3, 96), 21))  # [B, T, K]
    y = jax.jit(lambda x, q: linear(x, q, backend="pallas"))(x, q)
    assert y.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(y), np.asarray(linear(x, q, backend="portable")), rtol=1e-5, atol=1e-6)
    set_default_backend("pallas")  # the process-wide default reaches linear the same way (read while tracing)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, q: linear(x, q))(x, q)), np.asarray(y))


def test_linear_pallas_w4a4_keeps_activation_quantization():
    """A W4A4 weight (input_scale set) quantizes x with its calibrated scale first, on pallas as on portable."""
    x = jnp.asarray(_rand((5, 64), 22))
    q = quantize(_rand((32, 64), 23, 0.05)).replace(input_scale=jnp.float32(np.abs(_rand((5, 64), 22)).max() / 2688))
    y = np.asarray(jax.jit(lambda x, q: linear(x, q, backend="pallas"))(x, q))
    xq = np.asarray(dequantize(quantize(np.asarray(x), global_scale=q.input_scale)), np.float64)
    want = xq @ np.asarray(dequantize(q), np.float64).T
    assert _rel(y, want) <= 1e-6
    assert _rel(y, _ref(x, q)) > 1e-3  # the activation quantization really happened
    np.testing.assert_allclose(y, np.asarray(linear(x, q, backend="portable")), rtol=1e-5, atol=1e-6)


def test_pallas_gradients_for_audit():
    """The kernel has no autodiff of its own; its custom JVP uses the portable formula, so audit_scales works."""
    q = quantize(_rand((24, 48), 24, 0.05))
    q32 = q.replace(block_scale=q.block_scale.astype(jnp.float32))
    x = jnp.asarray(_rand((3, 48), 25))

    def f(bs, gs, backend):
        return jnp.sum(linear(x, q32.replace(block_scale=bs, global_scale=gs), backend=backend) ** 2)

    g_pallas = jax.grad(f, argnums=(0, 1))(q32.block_scale, q32.global_scale, "pallas")
    g_port = jax.grad(f, argnums=(0, 1))(q32.block_scale, q32.global_scale, "portable")
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    jax.tree.map(close, g_pallas, g_port)
    set_default_backend("pallas")
    audit = dj.audit_scales(lambda p, x: linear(x, p), q, x)
    assert audit.ok and audit.checked


# -- bad input -----------------------------------------------------------------------------------------------------

def test_bad_inputs_keep_clear_errors():
    q = quantize(np.ones((8, 32), np.float32))
    with pytest.raises(ValueError, match=r"x shape \(2, 16\) does not match weight shape \(8, 32\)"):
        linear(jnp.ones((2, 16)), q, backend="pallas")
    with pytest.raises(ValueError, match=r"x shape \(2, 16\) does not match weight shape \(8, 32\)"):
        P.nvfp4_matmul(jnp.ones((2, 16)), q)
    bad = NVFP4Array(packed=jnp.zeros((8, 12), jnp.uint8), block_scale=jnp.ones((8, 1), jnp.float8_e4m3fn),
                     global_scale=jnp.float32(1), shape=(8, 24))
    with pytest.raises(ValueError, match="in features 24 is not a multiple of 16"):
        linear(jnp.ones((2, 24)), bad, backend="pallas")
    with pytest.raises(ValueError, match="is not a positive multiple of 16"):
        quantize(np.ones((8, 24), np.float32))
    with pytest.raises(ValueError, match="unknown NVFP4 backend 'triton'"):
        linear(jnp.ones((2, 32)), q, backend="triton")
    with pytest.raises(ValueError, match="power of two"):
        P.Tiles(block_n=48)


def test_pallas_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(linear_mod, "_platform", lambda: "tpu")
    with pytest.raises(RuntimeError,
                       match=r"'pallas' needs a CUDA GPU .* this device is 'tpu'; use backend='portable'"):
        resolve_backend("pallas")
    assert resolve_backend() == "portable"  # auto never picks pallas there
    monkeypatch.setattr(linear_mod, "_platform", lambda: "cuda")
    monkeypatch.setattr(linear_mod, "_compute_capability", lambda: 9.0)
    assert resolve_backend() == "pallas"  # Hopper
    monkeypatch.setattr(linear_mod, "_compute_capability", lambda: 10.0)
    # Blackwell too: auto is W4A16 everywhere (a row's drafts never depend on the other rows of its batch)
    assert resolve_backend() == "pallas"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choices")
def test_cpu_selection_and_native_refusal():
    assert resolve_backend() == "portable" and resolve_backend("pallas") == "pallas"
    with pytest.raises(RuntimeError, match="needs a GPU.*use backend='portable' \\(or 'pallas'"):
        resolve_backend("native")


# -- the Triton lowering for CUDA, without a GPU -------------------------------------------------------------------

def _export_cuda(f, *args):
    return export.export(jax.jit(f), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


@pytest.fixture
def triton_lowering():
    with execution.changed(pallas_interpret=False):
        yield


EXPORT_CASES = [(m, n, k, dt, sdt) for (n, k) in QWEN3_8B for m in (1, 4, 16, 64) for dt in ("bfloat16",)
                for sdt in ("float8_e4m3fn",)] + [
    (1, 4096, 4096, "float32", "float8_e4m3fn"), (3, 4096, 4096, "float16", "float8_e4m3fn"),
    (33, 100, 208, "bfloat16", "float8_e4m3fn"), (2, 70, 272, "float32", "float32"), (128, 4096, 4096, "bfloat16",
                                                                                         "float8_e4m3fn")]


@pytest.mark.parametrize("m,n,k,dtype,scale_dtype", EXPORT_CASES)
def test_lowers_to_triton_for_cuda(triton_lowering, m, n, k, dtype, scale_dtype):
    """jax.export for CUDA runs the Pallas -> Triton lowering on this CPU host: one Triton call, no float weight."""
    w = jax.ShapeDtypeStruct
    q = NVFP4Array(packed=w((n, k // 2), jnp.uint8), block_scale=w((n, k // 16), jnp.dtype(scale_dtype)),
                   global_scale=w((), jnp.float32), shape=(n, k))
    exp = _export_cuda(lambda x, q: linear(x, q, backend="pallas"), w((m, k), jnp.dtype(dtype)), q)
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert not re.search(rf"tensor<{n}x{k}x(f32|bf16|f16)>", text), "a dequantized weight outside the kernel"
    assert exp.out_avals[0].shape == (m, n) and exp.out_avals[0].dtype == jnp.dtype(dtype)


def _triton_ir(capsys, m, n, k, tiles):
    with P_debug():
        q = quantize(_rand((n, k), 1, 0.05))
        _export_cuda(lambda x, q: P.nvfp4_matmul(x, q, tiles=tiles, interpret=False),
                     jnp.zeros((m, k), jnp.bfloat16), q)
    return capsys.readouterr().out


def P_debug():
    return execution.changed(pallas_debug=True)


def _masking(ir: str) -> tuple[list[int], list[int]]:
    """Operand counts of the tt.load ops on 8-bit tiles (codes and E4M3 scales; 3 = pointer, mask, other,
    1 = unmasked) and of the tt.store ops (3 = pointer, value, mask; 2 = unmasked)."""
    loads = re.findall(r"tt\.load ([^:]*?) : tensor<\d+x\d+x!tt\.ptr<i8>>", ir)
    stores = re.findall(r"tt\.store ([^:]*?) : tensor<\d+x\d+x!tt\.ptr<", ir)
    return [len(ops.split(",")) for ops in loads], [len(ops.split(",")) for ops in stores]


def test_triton_ir_masks_exactly_the_ragged_accesses(capsys):
    """What interpret mode cannot show: on a GPU an unmasked partial tile reads another row's or another buffer's
    bytes, and an unmasked store writes past the output. The Triton IR must mask both weight loads and the store
    when N, K or M is ragged, and leave the weight loads unmasked when the tiles divide the weight."""
    assert _masking(_triton_ir(capsys, 3, 100, 208, None)) == ([3, 3], [3])
    assert _masking(_triton_ir(capsys, 3, 128, 512, P.Tiles(block_n=64, block_k=128))) == ([1, 1], [3])  # M = 3
    assert _masking(_triton_ir(capsys, 16, 128, 512, P.Tiles(block_n=64, block_k=128))) == ([1, 1], [2])


def _triton_compiler():
    try:
        from jax._src.lib import triton
        jax.devices()  # backends (and a CUDA plugin, when installed) register their compilers on initialisation
        return triton if triton.has_compilation_handler("CUDA") else None
    except Exception:
        return None


@pytest.mark.skipif(_triton_compiler() is None, reason="no Triton compiler for CUDA here: install jax-cuda13-plugin "
                    "and jax-cuda13-pjrt matching jaxlib (JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on a "
                    "CPU-only host) to compile the kernel for sm_90 without a GPU")
@pytest.mark.parametrize("m,n,k,dtype", [(1, 4096, 4096, "bfloat16"), (16, 4096, 12288, "bfloat16"),
                                         (64, 12288, 4096, "bfloat16"), (33, 100, 208, "bfloat16"),
                                         (64, 4096, 4096, "float32"), (4, 1024, 4096, "float16")])
def test_default_tiles_compile_for_sm90_within_limits(monkeypatch, m, n, k, dtype):
    """Past the Pallas lowering: XLA's own Triton pipeline compiles the kernel for an H100/H200 (sm_90) to PTX. The
    default tiles must fit Hopper's 227 KiB of shared memory per program and use the tensor cores for 16-bit x."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    modules = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        res = lower(*a, **kw)
        buf = io.BytesIO()
        res.module.operation.write_bytecode(buf)
        modules.append(buf.getvalue())
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", capture)
    w = jax.ShapeDtypeStruct
    q = NVFP4Array(packed=w((n, k // 2), jnp.uint8), block_scale=w((n, k // 16), jnp.float8_e4m3fn),
                   global_scale=w((), jnp.float32), shape=(n, k))
    with execution.changed(pallas_interpret=False):
        _export_cuda(lambda x, q: P.nvfp4_matmul(x, q), w((m, k), jnp.dtype(dtype)), q)
    plan = P.make_plan(m, n, k, jnp.dtype(dtype), jnp.float8_e4m3fn, None)
    res = _triton_compiler().compile("CUDA", modules[-1], "9.0", num_warps=plan.num_warps, num_ctas=1,
                                     num_stages=plan.num_stages)
    assert 0 < res.smem_bytes <= 227 * 1024
    if dtype != "float32":
        assert "mma" in res.asm  # tensor-core MMAs (mma.sync or wgmma), not FMA loops


# -- inside generate -----------------------------------------------------------------------------------------------

# Shapes chosen so no activation or dense weight has the [out, in] shape of a quantized weight: the HLO check below
# then looks for those shapes as float buffers. Ragged on purpose: K = 48, 80, 144; N = 24, 80.
TCFG = TargetConfig(vocab_size=112, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=12, rope_theta=10000.0, tie_word_embeddings=False)
DCFG = DrafterConfig(TCFG.replace(num_hidden_layers=1), 4, 111, (0, 1, 2), 4)
PROMPTS = [[5, 9, 33, 2, 71, 8, 14], [40, 41, 3, 99, 17, 23, 60, 61, 62, 7, 1]]
MAX_NEW = 14


def _quantized_shapes(model) -> set[tuple[int, int]]:
    return {tuple(l.shape) for l in jax.tree.leaves(model.params, is_leaf=lambda x: isinstance(x, NVFP4Array))
            if isinstance(l, NVFP4Array)}


def _float_buffers_of(text: str, shapes) -> list[str]:
    return sorted({f"{d}[{n},{k}]" for n, k in shapes for d in ("f32", "bf16", "f16")
                   if re.search(rf"\b{d}\[{n},{k}\]", text)})


def _compiled_text(target, drafter, backend: str) -> str:
    """The optimized HLO of the speculative program `generate` runs for this backend (the backend is a static
    argument of the program, so each backend has its own)."""
    call = G.speculative_call(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, nvfp4_backend=backend)
    return call.compiled_text()


@pytest.fixture(scope="module")
def generate_runs():
    target = dj.quantize_nvfp4(make_target(TCFG, 0))  # lm_head stays dense: its shape is the embedding's
    drafter = dj.quantize_nvfp4(make_drafter(DCFG, 1))
    out = {"shapes": _quantized_shapes(target) | _quantized_shapes(drafter)}
    try:
        for backend in ("portable", "pallas"):
            set_default_backend(backend)
            t0 = time.perf_counter()
            ar = dj.generate_autoregressive(target, PROMPTS, max_new_tokens=MAX_NEW)
            sp = dj.generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW)
            TIMES[f"generate + AR, {backend}"] = time.perf_counter() - t0
            out[backend] = dict(ar=ar, sp=sp, hlo=_compiled_text(target, drafter, backend))
    finally:
        set_default_backend(None)
    return out


def test_generate_greedy_tokens_identical_with_pallas(generate_runs):
    port, pal = generate_runs["portable"], generate_runs["pallas"]
    np.testing.assert_array_equal(pal["sp"].tokens, pal["ar"].tokens)  # speculative == autoregressive
    np.testing.assert_array_equal(pal["ar"].tokens, port["ar"].tokens)  # pallas == portable
    np.testing.assert_array_equal(pal["sp"].tokens, port["sp"].tokens)
    np.testing.assert_array_equal(pal["sp"].acceptance_lengths, port["sp"].acceptance_lengths)
    assert (pal["sp"].num_tokens == MAX_NEW).all()


def test_no_dequantized_weight_outside_the_kernel_in_generate(generate_runs):
    shapes = generate_runs["shapes"]
    assert shapes == {(48, 48), (24, 48), (80, 48), (48, 80), (48, 144)}
    # Positive control: the portable program materialises dequantized weights, and the check sees them.
    assert _float_buffers_of(generate_runs["portable"]["hlo"], shapes)
    assert _float_buffers_of(generate_runs["pallas"]["hlo"], shapes) == []


def test_no_dequantized_weight_in_exported_cuda_forward(triton_lowering):
    """The same check on the program a GPU would run: a drafter block forward exported for CUDA from this host."""
    target = make_target(TCFG, 0)
    drafter = dj.quantize_nvfp4(make_drafter(DCFG, 1))
    feats = jnp.zeros((1, 5, 3 * TCFG.hidden_size), jnp.float32)
    block = jnp.zeros((1, DCFG.block_size), jnp.int32)
    set_default_backend("pallas")
    def forward(d, t, f, b):  # draft_logits' body, traced here (its own jit would cache across backends)
        cache = append_context(d, f, jnp.full((1,), f.shape[1], jnp.int32), empty_draft_cache(d.config, 1, 5))
        return block_logits(d, t, b, cache)

    exp = _export_cuda(forward, drafter, target, feats, block)
    text = exp.mlir_module()
    n_linear = len([l for l in jax.tree.leaves(drafter.params, is_leaf=lambda x: isinstance(x, NVFP4Array))
                    if isinstance(l, NVFP4Array)])
    # fc + 7 per layer, k/v_proj twice (context and block); the lm_head (the target's) is dense
    assert text.count("__gpu$xla.gpu.triton") == n_linear + 2 * DCFG.model.num_hidden_layers
    shapes = _quantized_shapes(drafter)
    assert not [s for s in shapes if re.search(rf"tensor<{s[0]}x{s[1]}x(f32|bf16|f16)>", text)]




# -- the prepared device script ------------------------------------------------------------------------------------

def test_device_report_smoke(tmp_path):
    """`python -m dflash_jax.bench.device_report --smoke` runs every part on CPU (so the GPU script cannot rot), records
    a backend that cannot run as unavailable instead of crashing, and writes the JSON and the markdown table."""
    from dflash_jax.bench import device_report

    t0 = time.perf_counter()
    data = device_report.main(["--smoke", "--out", str(tmp_path), "--budget-s", "3600"])
    TIMES["device report --smoke"] = time.perf_counter() - t0
    saved = json.loads((tmp_path / "device_report.json").read_text())
    md = (tmp_path / "device_report.md").read_text()
    assert saved["date"] == data["date"] and saved["device"]["device_kind"] in md
    assert not saved.get("errors") and not saved["skipped"]
    assert all(r["ok"] for r in saved["correctness"])
    assert len(saved["linear"]) == len(device_report.SMOKE_SHAPES) * len(device_report.MS)
    for row in saved["linear"]:
        for v in ("bf16 dense", "nvfp4 portable", "nvfp4 pallas"):
            assert row[v]["us"] > 0
        if jax.default_backend() == "cpu":
            assert "needs a GPU" in row["nvfp4 native"]["unavailable"]
    assert set(saved["step_costs"]["drafters"]) == {"dense", "nvfp4 pallas", "nvfp4 portable"}
    assert all(v["c"] > 0 for v in saved["step_costs"]["drafters"].values())
    assert saved["embedded"]["dflash"]["tau"] >= 1 and saved["embedded"]["nvfp4"]["tau"] >= 1
    dc = saved["decode_core"]  # the step lowered for CUDA, prefill memory, long caches, bf16 agreement
    assert all(r["conditionals"] == 0 and r["dynamic"] == 1 for r in dc["lowering"].values()), dc["lowering"]
    assert dc["prefill_memory"]["ratio"] <= 4.5 and dc["nvfp4_bf16_agreement"]["max_rel_diff"] < 2 ** -7
    assert set(dc["long_cache_attention"]["ratios"]) == {"verify_ms", "decode_ms", "draft_ms"}
    prog = saved["programs"]  # bf16 exactness of the embedded pair and prefill / loop compile counts
    assert prog["bf16_exactness"]["rows"] == 2 and 0 <= prog["bf16_exactness"]["mismatch_rate"] <= 1
    # 1 loop program on accelerators; CPU's smaller minimum cache bucket keys 1..1000 by up to 3
    assert prog["compiles"]["loop_programs"] <= (3 if jax.default_backend() == "cpu" else 1) and "bf16 exactness" in md
    sweep = saved["tile_sweep"]
    assert sweep and all("us" in r for row in sweep for r in row["results"]) and sweep[0]["best"]
    if jax.default_backend() == "cpu":
        assert "Not a GPU measurement" in md
        with pytest.raises(SystemExit, match="no GPU here"):
            device_report.main([])
