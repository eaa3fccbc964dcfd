"""linear(): dense and NVFP4 weights, backend selection, native-path wiring."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.quant.linear import linear, resolve_backend, set_default_backend
from helpers import clean_backend  # noqa: F401  (autouse: the default backend around every test)
from dflash_jax.quant.nvfp4 import dequantize, dequantize_unscaled, quantize

# The package re-exports the *function* as `dflash_jax.quant.linear`, shadowing the submodule.
linear_mod = importlib.import_module("dflash_jax.quant.linear")


def _rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _is_blackwell() -> bool:
    try:
        d = jax.devices()[0]
        return d.platform == "gpu" and float(d.compute_capability) >= 10.0
    except Exception:
        return False


def test_dense_matches_matmul():
    x, w = _rand((5, 64), 1), _rand((32, 64), 2)
    y = jax.jit(linear)(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (5, 32) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_nvfp4_portable_equals_dequantized_dense(lead):
    x = jnp.asarray(_rand(lead + (64,), 3))
    q = quantize(_rand((48, 64), 4))
    y = jax.jit(lambda x, q: linear(x, q, backend="portable"))(x, q)
    assert y.shape == lead + (48,)
    # The dense dot on the weight without its tensor scale (exact), then the tensor scale on the f32 result (as the
    # Pallas kernel): bitwise equal to that dense path.
    unscaled = jax.jit(lambda x, q: linear(x, dequantize_unscaled(q)) * q.global_scale)(x, q)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(unscaled))
    want = np.asarray(x).reshape(-1, 64).astype(np.float64) @ np.asarray(dequantize(q)).T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 48), want, rtol=1e-5, atol=1e-5)


def test_global_scale_is_applied():
    x = jnp.asarray(_rand((2, 32), 5))
    q = quantize(_rand((8, 32), 6))
    y1 = linear(x, q, backend="portable")
    y2 = linear(x, q.replace(global_scale=q.global_scale * 4), backend="portable")
    np.testing.assert_allclose(np.asarray(y2), 4 * np.asarray(y1), rtol=1e-6)


def test_bf16_activations():
    x = jnp.asarray(_rand((4, 64), 7), jnp.bfloat16)
    q = quantize(_rand((16, 64), 8))
    y = jax.jit(linear)(x, q)
    assert y.dtype == jnp.bfloat16
    # The weight is exact in bf16 without its tensor scale, which goes on the f32 result: only the output's one
    # rounding to bf16 separates y from the exact product (a weight rounded to bf16 with the scale in it would not
    # pass this: 2e-2 off here).
    want = (np.asarray(x.astype(jnp.float32), np.float64)
            @ np.asarray(dequantize(q, jnp.float32), np.float64).T)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, rtol=2 ** -8, atol=1e-4 * np.abs(want).max())
    yd = jax.jit(linear)(x, jnp.asarray(_rand((16, 64), 9), jnp.bfloat16))
    assert yd.dtype == jnp.bfloat16 and yd.shape == (4, 16)


@pytest.mark.parametrize("w", [np.zeros((8, 32), np.float32), quantize(np.ones((8, 32), np.float32))])
def test_shape_mismatch(w):
    with pytest.raises(ValueError, match=r"x shape \(2, 16\) does not match weight shape \(8, 32\)"):
        linear(jnp.ones((2, 16)), w)


def test_backend_selection(monkeypatch):
    if jax.default_backend() == "cpu":  # auto: W4A16 everywhere, portable on CPU, pallas on CUDA GPUs
        assert resolve_backend() == "portable"
    else:
        assert resolve_backend() in ("pallas", "portable")
    with pytest.raises(ValueError, match="unknown NVFP4 backend 'fast'"):
        set_default_backend("fast")
    with pytest.raises(ValueError, match="unknown NVFP4 backend"):
        resolve_backend("fast")
    set_default_backend("portable")
    assert resolve_backend() == "portable"
    set_default_backend(None)
    monkeypatch.setenv(linear_mod.ENV_VAR, "portable")
    assert resolve_backend() == "portable"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_native_refused_on_cpu(monkeypatch):
    q = quantize(_rand((8, 32), 10))
    with pytest.raises(RuntimeError, match="needs a GPU"):
        linear(jnp.ones((2, 32)), q, backend="native")
    monkeypatch.setenv(linear_mod.ENV_VAR, "native")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        linear(jnp.ones((2, 32)), q)


def _emulated_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    # jax.nn.scaled_matmul's documented semantics: scales repeated over blocks, contract last axes.
    a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), 16, axis=-1)
    b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), 16, axis=-1)
    return jnp.einsum("bmk,bnk->bmn", a, b).astype(preferred_element_type)


def test_native_wiring_with_emulated_kernel(monkeypatch):
    """Native path on CPU with scaled_matmul emulated: checks operand layout and both global scales.

    Native is W4A4, so it must equal x_q @ w_q^T with x quantized by the same recipe
    (a dynamic tensor scale per row), not the portable W4A16 result; a row's result does not depend on the others.
    """
    monkeypatch.setattr(linear_mod, "_scaled_matmul", _emulated_scaled_matmul)
    monkeypatch.setattr(linear_mod, "native_supported", lambda: True)
    x = jnp.asarray(_rand((2, 3, 64), 11) * 0.1)
    q = quantize(_rand((24, 64), 12) * 0.02)
    y = jax.jit(lambda x, q: linear(x, q, backend="native"))(x, q)
    assert y.shape == (2, 3, 24) and y.dtype == jnp.float32
    xd = np.stack([np.asarray(dequantize(quantize(r))) for r in x.reshape(6, 64)]).astype(np.float64)
    want = (xd @ np.asarray(dequantize(q)).T.astype(np.float64)).reshape(2, 3, 24)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-7)
    # A row 100x larger elsewhere in the batch changes nothing in the other rows (one scale per row, not per call).
    loud = x.at[1, 2].multiply(100.0)
    y_loud = np.asarray(jax.jit(lambda x, q: linear(x, q, backend="native"))(loud, q))
    np.testing.assert_array_equal(y_loud.reshape(6, 24)[:5], np.asarray(y).reshape(6, 24)[:5])
    portable = np.asarray(linear(x, q, backend="portable"))
    # W4A4 vs W4A16 differ by the activation's NVFP4 error (~10% relative, Frobenius).
    assert np.linalg.norm(np.asarray(y) - portable) < 0.2 * np.linalg.norm(portable)


@pytest.mark.skipif(not _is_blackwell(), reason="native NVFP4 needs a Blackwell GPU (compute capability >= 10.0)")
def test_native_vs_portable_on_blackwell():
    x = jnp.asarray(_rand((128, 256), 13), jnp.bfloat16)
    q = quantize(_rand((128, 256), 14) * 0.02)
    assert resolve_backend() == "pallas"  # auto is W4A16 everywhere; native is explicit
    y_n = np.asarray(jax.jit(lambda x, q: linear(x, q, backend="native"))(x, q).astype(jnp.float32))
    xd = np.stack([np.asarray(dequantize(quantize(r.astype(jnp.float32)))) for r in x]).astype(np.float64)
    want = xd @ np.asarray(dequantize(q)).T.astype(np.float64)
    np.testing.assert_allclose(y_n, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    y_p = np.asarray(linear(x, q, backend="portable").astype(jnp.float32))
    rel = np.linalg.norm(y_n - y_p) / np.linalg.norm(y_p)
    assert rel < 0.2, rel  # W4A4 vs W4A16: activation quantization noise only


def test_portable_and_pallas_agree_in_bf16():
    """Both apply the tensor scale to the f32 result, so they agree in bf16 too: they differ by at most the output's
    rounding of a different f32 summation order, not by a weight rounded with its scale."""
    x = jnp.asarray(_rand((4, 64), 21), jnp.bfloat16)
    q = quantize(_rand((48, 64), 22) * 0.05)
    y_port = np.asarray(linear(x, q, backend="portable").astype(jnp.float32))
    y_pallas = np.asarray(linear(x, q, backend="pallas").astype(jnp.float32))  # the kernel, interpreted on CPU
    np.testing.assert_allclose(y_pallas, y_port, rtol=2 ** -7, atol=1e-6 * np.abs(y_port).max())


def test_pallas_from_256_rows_dequantizes_once_for_the_library_gemm():
    from dflash_jax.quant import pallas_nvfp4
    q = quantize(_rand((48, 64), 23))
    for m, kernel in ((pallas_nvfp4.GEMM_MIN_ROWS - 1, True), (pallas_nvfp4.GEMM_MIN_ROWS, False)):
        x = jnp.asarray(_rand((m, 64), 24))
        jaxpr = str(jax.make_jaxpr(lambda x, q: linear(x, q, backend="pallas"))(x, q))
        assert ("pallas_call" in jaxpr) == kernel, m
    y = linear(x, q, backend="pallas")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(x, q, backend="portable")))
