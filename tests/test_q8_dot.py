"""GGML weights times x as Q8 blocks (`quant/cpu_q8_dot.h`, the execution context's `q8_activations`): llama.cpp's
rounding of x, exact integer block sums, a row's result independent of the other rows (a verify equals a decode bit
for bit), non-finite inputs kept to their row, and generation with it: greedy speculative output identical to
autoregressive output on a GGUF target. tests/test_cpu_kernel.py holds every build of the kernel to the same values,
these formats included."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.quant import cpu_kernel, ggml
from dflash_jax.quant.ggml import GGMLArray
from dflash_jax.quant.linear import linear, q8_activations_scope
from helpers import assert_rounded_products_keep_greedy_exact

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.unavailable_reason()}")


def _weight(kind, N: int, K: int, seed: int) -> GGMLArray:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return ggml.from_blocks(gguf.quants.quantize(w, kind), Q(kind).name, w.shape)


def _product(x, w, q8: bool):
    with q8_activations_scope(q8):
        return np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w))


def _llama_cpp_reference(x: np.ndarray, w: GGMLArray) -> np.ndarray:
    """x rounded to Q8 blocks as llama.cpp's quantize_row_q8_1 (d = max|x| / 127, q = round-half-even(x / d) in
    float32), each block's integer sum with the weight's codes, scaled by d_w * d_x (+ Q4_1's min times d_x * sum(q)),
    summed in float64."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32).astype(np.float32)
    d = np.abs(xb).max(-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(np.clip(xb * inv[..., None], -127, 127)).astype(np.int64)
    dw = np.asarray(w.scale, np.float32).astype(np.float64)  # [N, K/32]
    if w.kind == "q4_1":
        codes = np.asarray(w.codes).reshape(w.shape[0], K // 32, 16)
        wq = np.concatenate([codes & 15, codes >> 4], -1).astype(np.int64)  # [N, K/32, 32]
    else:
        wq = np.asarray(w.codes).view(np.int8).reshape(w.shape[0], K // 32, 32).astype(np.int64)
    isum = np.einsum("mbj,nbj->mnb", q, wq)  # exact integers
    ddx = (dw[None] * d.astype(np.float64)[:, None]).astype(np.float32).astype(np.float64)  # one float32 product
    y = (ddx * isum).sum(-1)
    if w.kind == "q4_1":
        s = (d * q.sum(-1).astype(np.float32)).astype(np.float64)  # [M, K/32]
        y = y + (np.asarray(w.mins, np.float32).astype(np.float64)[None] * s[:, None]).sum(-1)
    return y


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("K", [128, 576])
def test_q8_products_are_llama_cpps_integer_dots(kind, K):
    """The products follow x's Q8 rounding (float64 reference of llama.cpp's arithmetic, 1e-6 of the largest output:
    only the float summation order differs), and they are not the float products (an x left unrounded misses the
    reference by far more), yet within the rounding's ~1% of them."""
    w = _weight(kind, 45, K, seed=1)
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    x[1, :32] *= 1e-3  # a block of small values gets its own scale
    x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
    y, y_float = _product(x, w, True), _product(x, w, False)
    ref = _llama_cpp_reference(x, w)
    scale = np.abs(ref).max()
    assert np.abs(y - ref).max() <= 1e-6 * scale
    assert np.abs(y_float - ref).max() > 1e-4 * scale  # the reference tells the two apart
    assert np.abs(y - y_float).max() <= 3e-2 * scale


def test_a_rows_q8_product_does_not_depend_on_the_other_rows():
    """Row r of an M-row call equals the 1-row call bit for bit, past one tile of rows: the Q8 rounding reads only its
    own row, so a decode and a verify compute the same function."""
    K = 96
    x = jnp.asarray(np.random.default_rng(3).standard_normal((11, K)), jnp.float32)
    for kind in (Q.Q4_1, Q.Q8_0):
        w = _weight(kind, 70, K, seed=4)
        alone = np.stack([_product(x[r:r + 1], w, True)[0] for r in range(11)])
        for M in (2, 4, 5, 9, 11):
            np.testing.assert_array_equal(_product(x[:M], w, True), alone[:M], err_msg=f"{Q(kind).name} M={M}")


def test_a_non_finite_input_reaches_only_its_own_row():
    K = 64
    w = _weight(Q.Q4_1, 20, K, seed=5)
    x = np.random.default_rng(6).standard_normal((3, K)).astype(np.float32)
    clean = _product(x, w, True)
    x[1, 40] = np.inf
    y = _product(x, w, True)
    assert np.isnan(y[1]).all()
    np.testing.assert_array_equal(y[[0, 2]], clean[[0, 2]])


def test_generation_with_q8_activations_is_greedy_exact_on_a_gguf_target(tmp_path):
    """A GGUF target of Q4_1 / Q8_0 blocks: the forward under Q8 activations is another function (close to the float
    one), and greedy speculative decoding with it (a chain and a draft tree) equals autoregressive decoding with it
    token for token; `q8_activations=True` reaches the programs (its tokens are those of a call under the scope)."""
    assert_rounded_products_keep_greedy_exact(tmp_path, q8_activations_scope, "q8_activations")


def _attend(q, pos, cache_k, cache_v, lens, *, fixed: bool, window=None):
    from dflash_jax import execution
    from dflash_jax.models.attention import attention
    cache_k, cache_v = cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 1, 3)  # the cache's head-major layout
    with execution.changed(cpu_kernel=fixed, q8_activations=fixed, live_length_loop=True):
        return np.asarray(jax.jit(lambda *a: attention(*a[:2], cache_k=a[2], cache_v=a[3], cache_len=a[4],
                                                       causal=True, window=window))(q, pos, cache_k, cache_v, lens))


@pytest.mark.parametrize("window", [None, 40])
def test_fixed_order_attention_is_xlas_and_a_rows_result_ignores_the_other_rows(window):
    """Under Q8 activations the CPU loop programs attend through the kernel's fixed-order partial softmax
    (`cpu_attention.h`): the same values as XLA's attention to float32 rounding (GQA, per-query lengths over two
    key blocks, a sliding window, a row with no key), and a query's row is bit-identical whether it is attended alone
    (a decode) or as one of 8 (a verify), which XLA's own attention does not promise."""
    rng = np.random.default_rng(7)
    B, S, nKV, G, hd, T = 2, 300, 2, 3, 16, 8
    cache_k = jnp.asarray(rng.standard_normal((B, S, nKV, hd)), jnp.float32)
    cache_v = jnp.asarray(rng.standard_normal((B, S, nKV, hd)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, T, nKV * G, hd)), jnp.float32)
    start = np.array([270, 20], np.int32)  # row 0's block reaches past the first key block of 256
    pos = jnp.asarray(start[:, None] + np.arange(T, dtype=np.int32))
    lens = pos + 1  # per query: the cache holds the block, each query sees up to itself
    verify = _attend(q, pos, cache_k, cache_v, lens, fixed=True, window=window)
    xla = _attend(q, pos, cache_k, cache_v, lens, fixed=False, window=window)
    np.testing.assert_allclose(verify, xla, rtol=2e-5, atol=2e-6)
    for t in range(T):
        alone = _attend(q[:, t:t + 1], pos[:, t:t + 1], cache_k, cache_v, lens[:, t:t + 1], fixed=True, window=window)
        np.testing.assert_array_equal(alone[:, 0], verify[:, t], err_msg=f"query {t}")
    nothing = _attend(q[:, :1], pos[:, :1], cache_k, cache_v, jnp.zeros((B, 1), jnp.int32), fixed=True)
    assert not np.abs(nothing).any()


@pytest.mark.parametrize("n", [20, 63, 130])
def test_a_tree_nodes_row_equals_the_decode_of_its_path(n):
    """A draft tree's node attends to the cache plus its ancestors among the fresh keys; the decode of the same
    token attends to the cache holding that path. Under the fixed order both take the same keys in the same order,
    in the same 64-key chunks of the row's visible sequence (n = 63: the path's two keys fall in two chunks; 130:
    three chunks merged): the same bits."""
    from dflash_jax import execution
    from dflash_jax.models.attention import attention
    rng = np.random.default_rng(8)
    B, S, nKV, G, hd = 1, 160, 2, 2, 8
    ck = np.asarray(rng.standard_normal((B, S, nKV, hd)), np.float32)
    cv = np.asarray(rng.standard_normal((B, S, nKV, hd)), np.float32)
    # n: committed
    # nodes: 0 = child of the root at depth 1, 1 = its sibling, 2 = child of node 0 at depth 2
    fk = np.asarray(rng.standard_normal((B, 3, nKV, hd)), np.float32)
    fv = np.asarray(rng.standard_normal((B, 3, nKV, hd)), np.float32)
    q = jnp.asarray(rng.standard_normal((B, 3, nKV * G, hd)), jnp.float32)
    k_pos = jnp.asarray([[n, n, n + 1]], jnp.int32)
    mask = jnp.asarray([[[1, 0, 0], [0, 1, 0], [1, 0, 1]]], bool)
    with execution.changed(cpu_kernel=True, q8_activations=True, live_length_loop=True):
        head_major = (0, 2, 1, 3)  # the cache's layout, [B, nKV, S, hd]
        tree = np.asarray(jax.jit(lambda q: attention(q, k_pos, cache_k=jnp.asarray(ck.transpose(head_major)),
                                                      cache_v=jnp.asarray(cv.transpose(head_major)),
                                                      cache_len=jnp.asarray([n], jnp.int32), k=jnp.asarray(fk),
                                                      v=jnp.asarray(fv), k_pos=k_pos, k_mask=mask, causal=True))(q))
        path_k, path_v = ck.copy(), cv.copy()
        path_k[:, n], path_v[:, n], path_k[:, n + 1], path_v[:, n + 1] = fk[:, 0], fv[:, 0], fk[:, 2], fv[:, 2]
        decode = np.asarray(jax.jit(lambda q: attention(q, jnp.asarray([[n + 1]], jnp.int32), cache_k=jnp.asarray(
            path_k.transpose(head_major)), cache_v=jnp.asarray(path_v.transpose(head_major)), cache_len=jnp.asarray([n + 2], jnp.int32), causal=True))(q[:, 2:3]))
    np.testing.assert_array_equal(decode[:, 0], tree[:, 2])
