"""GGML weights and x rounded to bfloat16, summed as AVX512-BF16's `vdpbf16ps` sums them (`quant/cpu_bf16_dot.h`,
the execution context's `bf16_products`): the rounding and the chain against a NumPy model of the instruction, a
row's result independent of the other rows (a verify equals a decode bit for bit), non-finite inputs kept to their
row, and generation with it: greedy speculative output identical to autoregressive output on a GGUF target.
tests/test_cpu_kernel.py holds every build of the kernel (the instruction where the CPU has it, plain C++ elsewhere)
to the same values, these formats included."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.quant import cpu_kernel, ggml
from dflash_jax.quant.ggml import GGMLArray
from dflash_jax.quant.linear import bf16_products_scope, linear
from helpers import assert_rounded_products_keep_greedy_exact

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.unavailable_reason()}")


def _weight(kind, N: int, K: int, seed: int) -> GGMLArray:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return ggml.from_blocks(gguf.quants.quantize(w, kind), Q(kind).name, w.shape)


def _product(x, w, bf16: bool):
    with bf16_products_scope(bf16):
        return np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w))


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 values (as float32) as `vcvtne2ps2bf16` rounds: subnormals read as zero, nearest even."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = np.where((bits & 0x7F800000) == 0, bits & 0x80000000, bits)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _vdpbf16ps_reference(x: np.ndarray, w: GGMLArray) -> np.ndarray:
    """The kernel's chain in NumPy: weights dequantized then rounded, x rounded; per output, 16 lanes, lane j of block
    b adding the pair (2j + 1, then 2j) of that block, each sum rounded once to float32 (products of two bfloat16
    values are exact in float64, and a float32 plus such a product rounds once from float64 here); even blocks in
    one accumulator, odd ones in another, then the 16-lane tree of `_mm512_reduce_add_ps`."""
    M, K = x.shape
    wd = _bf16(np.asarray(ggml.dequantize(w), np.float32)).astype(np.float64)  # [N, K]
    xb = _bf16(x).astype(np.float64)
    N = wd.shape[0]
    acc = np.zeros((2, M, N, 16), np.float32)
    for b in range(K // 32):
        for j in range(16):
            for e in (2 * j + 1, 2 * j):
                k = 32 * b + e
                s = acc[b % 2, :, :, j].astype(np.float64) + xb[:, k, None] * wd[None, :, k]
                acc[b % 2, :, :, j] = s.astype(np.float32)
    v = (acc[0] + acc[1]).astype(np.float32)  # [M, N, 16]
    for width in (8, 4, 2, 1):  # lanes l + (l + width)
        v = (v[..., :width] + v[..., width:2 * width]).astype(np.float32)
    return v[..., 0]


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("K", [64, 96])
def test_bf16_products_are_the_instructions_chain(kind, K):
    """The products equal the NumPy model of the instruction's chain (all but rare double roundings of its float64
    sums: > 99% of outputs bit for bit, the rest within an ulp of the largest), are not the float products (x left
    unrounded misses the model by far more), yet lie within bfloat16's rounding of them."""
    w = _weight(kind, 23, K, seed=1)
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    x[1, :32] *= 1e-3
    x[2, 3] = 1e-39  # a subnormal element reads as zero
    y, y_float = _product(x, w, True), _product(x, w, False)
    ref = _vdpbf16ps_reference(x, w)
    scale = np.abs(ref).max()
    assert np.mean(y == ref) > 0.99
    assert np.abs(y - ref).max() <= 1e-6 * scale
    assert np.abs(y_float - ref).max() > 1e-4 * scale  # the model tells the two apart
    assert np.abs(y - y_float).max() <= 2e-2 * scale


def test_a_rows_bf16_product_does_not_depend_on_the_other_rows():
    """Row r of an M-row call equals the 1-row call bit for bit, past one tile of rows: a decode and a verify
    compute the same function."""
    K = 96
    x = jnp.asarray(np.random.default_rng(3).standard_normal((11, K)), jnp.float32)
    for kind in (Q.Q4_1, Q.Q8_0):
        w = _weight(kind, 70, K, seed=4)
        alone = np.stack([_product(x[r:r + 1], w, True)[0] for r in range(11)])
        for M in (2, 3, 4, 5, 9, 11):
            np.testing.assert_array_equal(_product(x[:M], w, True), alone[:M], err_msg=f"{Q(kind).name} M={M}")


def test_a_non_finite_input_reaches_only_its_own_row():
    K = 64
    w = _weight(Q.Q4_1, 20, K, seed=5)
    x = np.random.default_rng(6).standard_normal((3, K)).astype(np.float32)
    clean = _product(x, w, True)
    x[1, 40] = np.inf
    y = _product(x, w, True)
    assert not np.isfinite(y[1]).any()
    np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])


def test_generation_with_bf16_products_is_greedy_exact_on_a_gguf_target(tmp_path):
    """A GGUF target of Q4_1 / Q8_0 blocks: the forward with bfloat16 products is another function (close to the
    float one), and greedy speculative decoding with it (a chain and a draft tree) equals autoregressive decoding with
    it token for token; `bf16_products=True` reaches the programs (its tokens are those of a call under the scope);
    asking for it with Q8 activations too is refused by name."""
    target, prompts = assert_rounded_products_keep_greedy_exact(tmp_path, bf16_products_scope, "bf16_products")
    with pytest.raises(ValueError, match="q8_activations and bf16_products"):
        dj.generate_autoregressive(target, prompts, max_new_tokens=4, eos_ids=(), bf16_products=True,
                                   q8_activations=True)
