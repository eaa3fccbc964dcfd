"""The CPU matmul kernel (`quant/cpu_matmul.cc`) and GGML block weights (`quant/ggml.py`): values against a float64
reference of the dequantized weight, every row's result independent of how many rows share the call (what makes a
verify equal a decode bit for bit), the draft-vocabulary prefix, derivatives, the fallback without the kernel, and
GGUF targets that keep their blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import execution
from dflash_jax.models.layers import first_argmax
from dflash_jax.models.target import KVCache, forward_with_cache
from dflash_jax.train.drafter_data import target_fingerprint
from dflash_jax.io.gguf import GGUFFile
from dflash_jax.params import named_leaves
from dflash_jax.quant import cpu_kernel, ggml
from dflash_jax.quant.ggml import GGMLArray
from dflash_jax.quant.linear import (bf16_products_scope, cpu_kernel_scope, embedding_rows, linear, linear_many,
                                     q8_activations_scope)
from dflash_jax.quant.nvfp4 import quantize
from gguf_files import write_target_gguf
from helpers import tiny_qwen3

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"CPU kernel: {cpu_kernel.unavailable_reason()}")


def _blocks(w: np.ndarray, qtype) -> GGMLArray:
    raw = gguf.quants.quantize(np.asarray(w, np.float32), qtype)
    return ggml.from_blocks(raw, Q(qtype).name, w.shape)


def _weights(N: int, K: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    out = {"float32": jnp.asarray(w), "bfloat16": jnp.asarray(w, jnp.bfloat16), "nvfp4": quantize(jnp.asarray(w))}
    if K % 32 == 0:
        out.update(q4_0=_blocks(w, Q.Q4_0), q4_1=_blocks(w, Q.Q4_1), q8_0=_blocks(w, Q.Q8_0))
    return out


def _dense(w) -> np.ndarray:
    if isinstance(w, GGMLArray):
        return np.asarray(ggml.dequantize(w), np.float64)
    if hasattr(w, "packed"):
        from dflash_jax.quant.nvfp4 import dequantize
        return np.asarray(dequantize(w, jnp.float32), np.float64)
    return np.asarray(jnp.asarray(w, jnp.float32), np.float64)


def _kernel_linear(x, w, **kw):
    with cpu_kernel_scope(True):
        return jax.jit(lambda x, w: linear(x, w, **kw))(x, w)


@pytest.mark.parametrize("K", [64, 80, 48])  # whole blocks, a half block (NVFP4 / dense), a ragged block
def test_every_format_matches_its_dequantized_weight(K):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((11, K)), jnp.float32)
    for name, w in _weights(40, K).items():
        y = np.asarray(_kernel_linear(x, w), np.float64)
        ref = np.asarray(x, np.float64) @ _dense(w).T
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), name


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Row r of an M-row call equals the 1-row call of row r bit for bit, for every M up to two tiles and past: a
    decode (1 row) and a verify (D + 1 rows) compute the same function."""
    K = 96
    x = jnp.asarray(np.random.default_rng(2).standard_normal((19, K)), jnp.float32)
    for name, w in _weights(70, K, seed=3).items():
        alone = np.stack([np.asarray(_kernel_linear(x[r:r + 1], w))[0] for r in range(19)])
        for M in (2, 7, 8, 9, 16, 19):
            np.testing.assert_array_equal(np.asarray(_kernel_linear(x[:M], w)), alone[:M], err_msg=f"{name} M={M}")


def test_out_rows_is_the_prefix_of_the_full_product():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 64)), jnp.float32)
    for name, w in _weights(50, 64).items():
        full = np.asarray(_kernel_linear(x, w))
        np.testing.assert_array_equal(np.asarray(_kernel_linear(x, w, out_rows=17)), full[:, :17], err_msg=name)
    with pytest.raises(ValueError, match="out_rows 60 outside 1..50"):
        _kernel_linear(x, _weights(50, 64)["q8_0"], out_rows=60)


def test_linear_many_is_one_call_with_each_weights_own_values():
    """Several weights sharing x (q / k / v, gate / up) in one kernel call: every output equals `linear` with that
    weight alone bit for bit, formats and row counts mixed, at 1 and 9 rows; the compiled program holds one call;
    derivatives are the separate products'; where a weight cannot run through the kernel, each runs alone."""
    K = 64
    ws = _weights(40, K, seed=6)
    group = (ws["q4_1"], _weights(24, K, seed=7)["q8_0"], ws["nvfp4"], _weights(8, K, seed=8)["float32"],
             ws["bfloat16"])
    for M in (1, 9):
        x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
        with cpu_kernel_scope(True):
            many = jax.jit(lambda x, ws: linear_many(x, ws))
            ys = many(x, group)
            hlo = many.lower(x, group).as_text()
        assert hlo.count(f"custom_call_target=\"{cpu_kernel.TARGET_NAME}\"") + hlo.count(
            f"stablehlo.custom_call @{cpu_kernel.TARGET_NAME}") == 1
        for w, y in zip(group, ys):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(_kernel_linear(x, w)))

    x = jnp.asarray(np.random.default_rng(9).standard_normal((3, K)), jnp.float32)

    def loss(x, ws, on):
        with cpu_kernel_scope(on):
            return sum(jnp.sum(jnp.tanh(y) * (i + 1)) for i, y in enumerate(linear_many(x, ws)))
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x, group, True)), np.asarray(jax.grad(loss)(x, group, False)),
                               rtol=1e-4, atol=1e-5)
    dense = (ws["float32"], _weights(8, K, seed=8)["float32"])
    gw = jax.grad(loss, argnums=1)(x, dense, True)
    gw_ref = jax.grad(loss, argnums=1)(x, dense, False)
    for a, b in zip(gw, gw_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # outside the kernel scope dense weights take XLA's dot: one `linear` each, same values as before
    ys = jax.jit(lambda x, ws: linear_many(x, ws))(x, dense)
    for w, y in zip(dense, ys):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(linear)(x, w)))


def test_derivative_is_the_dense_products():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 64)), jnp.float32)
    for name, w in _weights(24, 64).items():
        def loss(x, w, on):
            with cpu_kernel_scope(on):
                return jnp.sum(jnp.tanh(linear(x, w)))
        g_kernel = jax.grad(loss)(x, w, True)
        g_xla = jax.grad(loss)(x, w, False)
        np.testing.assert_allclose(np.asarray(g_kernel), np.asarray(g_xla), rtol=1e-4, atol=1e-5, err_msg=name)
    w = _weights(24, 64)["float32"]
    gw = jax.grad(lambda w: jnp.sum(jnp.tanh(_kernel_linear(x, w))))(w)
    gw_ref = jax.grad(lambda w: jnp.sum(jnp.tanh(linear(x, w))))(w)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw_ref), rtol=1e-4, atol=1e-5)


def test_ggml_blocks_dequantize_as_gguf_py_and_embed_rows():
    w = np.random.default_rng(6).standard_normal((33, 64)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = gguf.quants.quantize(w, qtype)
        leaf = ggml.from_blocks(raw, qtype.name, w.shape)
        ref = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(ggml.dequantize(leaf)), ref, err_msg=qtype.name)
        ids = jnp.asarray([[3, 0, 32], [5, 5, 1]])  # a few rows (one slice each) and many (a gather): the same rows
        np.testing.assert_array_equal(np.asarray(embedding_rows(leaf, ids, jnp.float32)), ref[np.asarray(ids)])
        many = jnp.asarray(np.random.default_rng(7).integers(0, 33, (3, 9)))
        np.testing.assert_array_equal(np.asarray(jax.jit(embedding_rows, static_argnums=2)(leaf, many, jnp.float32)),
                                      ref[np.asarray(many)])
    with pytest.raises(ValueError, match="Q5_0 is not kept as blocks"):
        ggml.from_blocks(gguf.quants.quantize(w, Q.Q5_0), "Q5_0", w.shape)


def test_without_the_kernel_the_same_values_come_from_xla():
    """DFLASH_JAX_CPU_KERNEL=0 (or no compiler): the GGML weight is dequantized and multiplied by XLA's dot."""
    code = ("import jax, jax.numpy as jnp, numpy as np, gguf\n"
            "from dflash_jax.quant import cpu_kernel, ggml\n"
            "from dflash_jax.quant.linear import linear\n"
            "w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)\n"
            "q = ggml.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), 'Q4_1', w.shape)\n"
            "x = jnp.ones((2, 64))\n"
            "y = linear(x, q)\n"
            "ref = np.asarray(x) @ np.asarray(ggml.dequantize(q)).T\n"
            "assert not cpu_kernel.available() and 'DFLASH_JAX_CPU_KERNEL=0' in cpu_kernel.unavailable_reason()\n"
            "assert np.abs(np.asarray(y) - ref).max() < 1e-4\n"
            "print('fallback ok')\n")
    env = dict(os.environ, DFLASH_JAX_CPU_KERNEL="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "fallback ok" in out.stdout, out.stderr[-2000:]


def test_gguf_target_keeps_its_blocks_and_decodes_exactly(tmp_path):
    """A quantized GGUF target on CPU keeps its Q4_0 / Q4_1 / Q8_0 tensors as GGMLArray leaves (param_dtype='gguf',
    the CPU default; 'float32' decodes them); both forwards agree, and greedy speculative decoding with blocks equals
    autoregressive decoding with blocks token for token."""
    cfg = tiny_qwen3(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=96, tie_word_embeddings=True, max_position_embeddings=256,
                     num_hidden_layers=2)
    target = dj.init_target(cfg, jax.random.key(7))
    types = {"attn_q.weight": int(Q.Q4_0), "attn_k.weight": int(Q.Q4_1), "ffn_up.weight": int(Q.Q4_1),
             "ffn_down.weight": int(Q.Q4_1), "token_embd.weight": int(Q.Q8_0)}
    path = write_target_gguf(tmp_path / "t.gguf", target, types=types)
    blocks, dense = dj.load_target(path), dj.load_target(path, param_dtype="float32")
    kinds = {n: type(v).__name__ for n, v in named_leaves(blocks.params).items()}
    assert kinds["layers.0.self_attn.q_proj"] == kinds["embed_tokens"] == "GGMLArray"
    assert kinds["layers.0.self_attn.v_proj"] == "ArrayImpl" and not any(
        isinstance(v, GGMLArray) for v in named_leaves(dense.params).values())
    assert dj.load_target(path, param_dtype="gguf").config == blocks.config
    # one target however it was loaded: training data made with either is read with the other
    assert target_fingerprint(blocks) == target_fingerprint(dense) != target_fingerprint(target)
    tokens = np.arange(40, dtype=np.int32).reshape(2, 20) % 96
    a, b = dj.target_forward(blocks, tokens)[0], dj.target_forward(dense, tokens)[0]
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * float(jnp.max(jnp.abs(b)))
    drafter = dj.init_drafter(dj.DrafterConfig(model=cfg.drafter_stack(1), block_size=4, mask_token_id=0,
                                               target_layer_ids=(0, 1), num_target_layers=2), jax.random.key(8))
    prompts = [list(range(3, 20)), list(range(40, 45))]
    ar = dj.generate_autoregressive(blocks, prompts, max_new_tokens=24, eos_ids=())
    sp = dj.generate(blocks, drafter, prompts, max_new_tokens=24, eos_ids=())
    assert ar.token_lists() == sp.token_lists()
    with pytest.raises(dj.CheckpointError if hasattr(dj, "CheckpointError") else Exception, match="not a GGUF"):
        dj.load_target(Path(__file__).parents[1] / "checkpoints" / "target", param_dtype="gguf")


def test_smollm2_blocks_are_its_dequantized_weights():
    """The default model's blocks (Q4_1 matrices with llama's q / k rows un-permuted, a Q8_0 embedding and tied
    head) read as GGMLArray leaves equal its float32 decoding row for row; the forwards agree to float rounding."""
    from dflash_jax.io import shipped
    path = shipped.smollm2_path()
    blocks = dj.load_target(path)
    dense = dj.load_target(path, param_dtype="float32")
    nb, nd = named_leaves(blocks.params), named_leaves(dense.params)
    for name in ("layers.0.self_attn.q_proj", "layers.17.self_attn.k_proj", "layers.29.mlp.down_proj", "embed_tokens"):
        assert isinstance(nb[name], GGMLArray), name
        np.testing.assert_array_equal(np.asarray(ggml.dequantize(nb[name])), np.asarray(nd[name]), err_msg=name)
    tokens = np.asarray([[1, 504, 3458, 30, 2209, 1380, 14]], np.int32)
    a, b = dj.target_forward(blocks, tokens)[0], dj.target_forward(dense, tokens)[0]
    assert float(jnp.max(jnp.abs(a - b))) <= 2e-5 * float(jnp.max(jnp.abs(b)))


def test_concurrent_calls_from_several_threads_agree():
    """The kernel's worker threads take one call at a time; a call that finds them busy runs alone on its own thread.
    Several Python threads running kernel programs at once (XLA runs each on its own) all get the exact values."""
    import concurrent.futures

    K = 576
    w = _weights(1536, K, seed=11)["q4_1"]
    xs = [jnp.asarray(np.random.default_rng(20 + i).standard_normal((1 + i % 3, K)), jnp.float32) for i in range(6)]
    f = jax.jit(lambda x, w: linear(x, w))
    expected = [np.asarray(f(x, w)) for x in xs]

    def run(i):
        return all(np.array_equal(np.asarray(f(xs[i % 6], w)), expected[i % 6]) for _ in range(15))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(12)))


def _products_of_every_format(out: str) -> None:
    """Every format's product at 1, 3, 8 and 9 rows (whole, ragged and half blocks; GGML's also with x as Q8 blocks
    and as bfloat16 products) and the row attention's sums, saved to `out` (npz): what
    `test_every_build_computes_the_same_values` compares across the kernel's builds (run in a subprocess there)."""
    found = {}
    for K in (96, 80, 48, 352):  # 352: 11 blocks
        x = jnp.asarray(np.random.default_rng(7).standard_normal((9, K)), jnp.float32)
        for name, w in _weights(37, K, seed=8).items():
            for M in (1, 3, 8, 9):
                found[f"{name}-K{K}-M{M}"] = np.asarray(_kernel_linear(x[:M], w))
                if name in ("q4_1", "q8_0"):  # x as Q8 blocks (llama.cpp's integer dot: cpu_q8_dot.h)
                    with q8_activations_scope(True):
                        found[f"{name}-q8-K{K}-M{M}"] = np.asarray(_kernel_linear(x[:M], w))
                    # weights and x as bfloat16 (cpu_bf16_dot.h: the instruction where the CPU has it, plain C++
                    # elsewhere), with subnormal elements in x (read as zero by both)
                    tiny = x[:M].at[:, ::7].multiply(1e-39)
                    with bf16_products_scope(True):
                        found[f"{name}-bf16-K{K}-M{M}"] = np.asarray(_kernel_linear(x[:M], w))
                        found[f"{name}-bf16-subnormal-K{K}-M{M}"] = np.asarray(_kernel_linear(tiny, w))
    rng = np.random.default_rng(9)  # the fixed-order row attention (cpu_attention.h) of the CPU loops
    # one chunk of keys, and rows over several 64-key chunks (merged); head sizes of whole and half 16-lane slices
    for T, S, hd in ((1, 37, 64), (5, 11, 128), (3, 150, 64), (2, 90, 24), (1, 70, 8)):
        def arr(*shape):
            return jnp.asarray(rng.standard_normal(shape), jnp.float32)
        vis_c = jnp.asarray(rng.random((2, T, S)) < 0.8, jnp.uint8)
        vis_f = jnp.asarray(np.tril(np.ones((T, T)))[None].repeat(2, 0), jnp.uint8)
        q = arr(2, T, 2, 3, hd)
        # the cache's keys head-major [B, nKV, S, hd], the fresh ones as projected [B, T, nKV, hd]
        cached, fresh = (arr(2, 2, S, hd), arr(2, 2, S, hd), vis_c), (arr(2, T, 2, hd), arr(2, T, 2, hd), vis_f)
        l, o = jax.jit(cpu_kernel.attention_rows, static_argnums=3)(q, cached, fresh, hd ** -0.5)
        found[f"attention-T{T}-l"], found[f"attention-T{T}-o"] = np.asarray(l), np.asarray(o)
    found["argmax"] = np.asarray(jax.jit(cpu_kernel.first_argmax)(_argmax_rows()))  # cpu_argmax.h
    rows = jnp.asarray(np.random.default_rng(14).standard_normal((64, 197)) * 3, jnp.float32)  # cpu_sample.h
    u = jnp.asarray(np.random.default_rng(15).random(64), jnp.float32)
    found["sample"] = np.asarray(jax.jit(cpu_kernel.sample_rows)(rows, u, 0.8))
    np.savez(out, **found)


def _argmax_rows() -> jax.Array:
    """Rows that find an argmax's edges: ties (the first one wins), NaN (the first NaN wins, as in jnp.argmax), all
    -inf, +inf, -0 against +0, rows shorter than a vector and with a ragged end."""
    rng = np.random.default_rng(12)
    n = 197
    x = rng.standard_normal((10, n)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, [150, 40]] = np.nan
    x[3] = -np.inf
    x[4, [17, 180]] = np.inf
    x[5] = np.where(rng.random(n) < 0.5, 0.0, -0.0)
    x[6, 190:] = 10.0  # the maximum in the ragged end only
    x[7, 5] = x[7, 100] = 50.0  # a tie across lanes: 5 and 100 sit in lanes 5 and 4
    x[8, 196] = np.nan  # the last element
    x[9, :] = 1.0
    return jnp.asarray(x)


def test_the_kernel_argmax_is_jnp_argmax():
    """The kernel's one-pass argmax (the CPU loops' `first_argmax`) returns jnp.argmax's index on every edge: ties,
    NaN, infinities, signed zeros, and every row length around its 16-lane vectors."""
    rng = np.random.default_rng(13)
    f = jax.jit(cpu_kernel.first_argmax)
    x = _argmax_rows()
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(jnp.argmax(x, axis=-1)))
    for n in (1, 2, 15, 16, 17, 31, 32, 33, 47, 49152):
        for kind in range(4):
            x = rng.standard_normal((3, n)).astype(np.float32)
            if kind == 1:
                x = np.round(x * 2)
            elif kind == 2:
                x[:, rng.integers(0, n, 2)] = np.nan
            elif kind == 3:
                x[0] = -np.inf
                x[1, -1] = np.inf
            np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))), np.asarray(jnp.argmax(x, axis=-1)),
                                          err_msg=f"n={n} kind={kind}")
    with cpu_kernel_scope(True):  # the CPU loops' first_argmax runs it; elsewhere XLA's two reductions
        assert "dflash_first_argmax" in jax.jit(first_argmax).lower(x).as_text()
    assert "dflash_first_argmax" not in jax.jit(first_argmax).lower(x).as_text()


def test_the_kernel_draw_is_the_inverse_cdf_of_the_softmax():
    """The kernel's draw (`cpu_sample.h`, the CPU loops' sampled token without top-k / top-p) is the inverse CDF of
    softmax(x / T): the same token as `sampling._categorical` over `processed_probs` for all but the uniforms that
    fall within float rounding of a boundary, a histogram within the sampling noise of the exact law, never a token of
    zero probability (-inf logits), and in the CPU loops `sample_tokens` lowers to it."""
    from dflash_jax import execution
    from dflash_jax.decode import sampling
    rng = np.random.default_rng(16)
    V, R, T = 300, 60000, 0.7
    x = rng.standard_normal(V).astype(np.float32) * 2
    x[rng.choice(V, 40, replace=False)] = -np.inf  # masked ids
    u = rng.random(R).astype(np.float32) * np.float32(1 - 1e-6) + np.float32(1e-7)
    rows = jnp.broadcast_to(jnp.asarray(x), (R, V))
    drawn = np.asarray(jax.jit(cpu_kernel.sample_rows)(rows, jnp.asarray(u), T))
    sp = sampling.SamplingParams.make(temperature=T)
    probs = sampling.processed_probs(jnp.asarray(x)[None], sp)
    xla = np.asarray(jax.jit(sampling._categorical)(jnp.asarray(u), jnp.broadcast_to(probs, (R, V))))
    assert (drawn == xla).mean() > 0.999
    p = np.asarray(probs[0], np.float64)
    assert not np.isin(drawn, np.flatnonzero(p == 0)).any()
    counts = np.bincount(drawn, minlength=V)
    big = p * R >= 20  # a chi-square over the ids with expected counts >= 20, the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(p[big] * R, p[~big].sum() * R)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    dof = observed.size - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)  # ~5 sigma
    logits = jnp.asarray(x)[None]
    keys = jnp.zeros((1, 2), jnp.uint32)
    with execution.changed(cpu_kernel=True):
        assert cpu_kernel.SAMPLE_TARGET in jax.jit(
            lambda l, k: sampling.sample_tokens(l, k, sp.as_arrays())).lower(logits, keys).as_text()
        top_p = sampling.SamplingParams.make(temperature=T, top_p=0.9).as_arrays()
        assert cpu_kernel.SAMPLE_TARGET not in jax.jit(
            lambda l, k: sampling.sample_tokens(l, k, top_p)).lower(logits, keys).as_text()
    assert cpu_kernel.SAMPLE_TARGET not in jax.jit(
        lambda l, k: sampling.sample_tokens(l, k, sp.as_arrays())).lower(logits, keys).as_text()


def test_the_kernel_acceptance_reads_the_target_rows_as_accept_block_does():
    """Rejection sampling's two reads of the target's rows in the CPU loops (`cpu_sample.h`): the log-sum-exp of a
    row equals XLA's to float rounding; the residual's draw is `_categorical` over `residual_probs` (a dense q over
    the first nq ids, a point mass, no q, and a q that covers p everywhere, where the residual is empty and p itself
    is drawn from) for all but uniforms within rounding of a boundary; and `accept_block` in the CPU loops lowers to
    both and keeps the same drafts and tokens as its XLA form, with the same keys, for a PrefixQ, a dense q and
    greedy drafts."""
    from dflash_jax import execution
    from dflash_jax.decode import sampling
    rng = np.random.default_rng(17)
    B, R, V, nq, T = 4, 3, 700, 300, 0.7
    x = rng.standard_normal((B, R, V)).astype(np.float32) * 2
    x[:, :, rng.choice(V, 30, replace=False)] = -np.inf
    lse = np.asarray(cpu_kernel.row_logsumexp(jnp.asarray(x), T))
    np.testing.assert_allclose(lse, np.asarray(jax.scipy.special.logsumexp(x / T, axis=-1)), rtol=2e-6)
    row = np.array([0, 2, 1, 2], np.int32)
    p = np.asarray(jax.nn.softmax(x[np.arange(B), row] / T, axis=-1))  # [B, V]
    q = rng.dirichlet(np.ones(nq), B).astype(np.float32)
    point = np.array([5, -1, int(np.argmax(p[2])), -1], np.int32)
    q_on = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
    q_over = np.zeros((B, nq), np.float32)  # row 3: q = 2p over every id (nq = V below): the residual is empty
    cases = [(q, q_on, point), (np.pad(q_over, ((0, 0), (0, V - nq))) + 2 * p * (np.arange(B) == 3)[:, None],
                                 np.array([0, 0, 0, 1], np.float32), point)]
    n_u = 4000
    u = rng.random(n_u).astype(np.float32) * np.float32(1 - 1e-6) + np.float32(1e-7)
    for qq, on, pt in cases:
        full = np.zeros((B, V), np.float32)
        full[:, :qq.shape[1]] = qq * on[:, None]
        full[np.arange(B)[pt >= 0], pt[pt >= 0]] += 1.0
        res = sampling.residual_probs(jnp.asarray(p), jnp.asarray(full))  # [B, V]
        rep = lambda a: jnp.asarray(np.repeat(a, n_u, axis=0))  # noqa: E731
        drawn = np.asarray(jax.jit(cpu_kernel.residual_draw)(
            rep(x), rep(row), rep(qq), rep(on), rep(pt), jnp.asarray(np.tile(u, B)), T))
        want = np.asarray(jax.jit(sampling._categorical)(jnp.asarray(np.tile(u, B)), rep(np.asarray(res))))
        assert (drawn == want).mean() > 0.999
        assert not np.isin(drawn.reshape(B, n_u)[3], np.flatnonzero(p[3] == 0)).any()
        for b in range(B):  # a point mass is never drawn from its residual
            assert pt[b] < 0 or not (drawn.reshape(B, n_u)[b] == pt[b]).any()

    D, n, M = 3, 64, 3000
    v_logits = jnp.asarray(rng.standard_normal((M, D + 1, n * 2)).astype(np.float32))
    d_logits = jnp.asarray(rng.standard_normal((M, D, n)).astype(np.float32) + 2 * np.asarray(v_logits)[:, :D, :n])
    sp = sampling.SamplingParams.make(temperature=T)
    keys = jax.random.key_data(jax.random.split(jax.random.key(3), M))
    probs = sampling.processed_probs(d_logits, sp)
    drafts, _ = sampling.sample_tokens(d_logits, keys, sp, draft=True, probs=probs)
    copied = jnp.asarray(rng.random((M, D)) < 0.3)
    drafts = jnp.where(copied, jnp.asarray(rng.integers(0, 2 * n, (M, D)), jnp.int32), drafts)
    runs = [(sampling.PrefixQ(probs, copied), sp), (jnp.pad(probs, ((0, 0), (0, 0), (0, n))), sp),
            (None, sampling.SamplingParams.make(temperature=T, draft_sampling="greedy"))]
    for q_kw, spq in runs:
        def accept(dl, dr, vl, k, q=q_kw, s=spq):
            return sampling.accept_block(dl, dr, vl, k, s, draft_probs=q)
        xla = [np.asarray(a) for a in jax.jit(accept)(d_logits, drafts, v_logits, keys)]
        with execution.changed(cpu_kernel=True):
            text = jax.jit(accept).lower(d_logits, drafts, v_logits, keys).as_text()
            assert cpu_kernel.RESIDUAL_TARGET in text and cpu_kernel.LOGSUMEXP_TARGET in text
            kern = [np.asarray(a) for a in jax.jit(accept)(d_logits, drafts, v_logits, keys)]
        assert (kern[0] == xla[0]).mean() > 0.999  # n_acc
        assert (kern[1] == xla[1]).all(axis=1).mean() > 0.995  # committed
        np.testing.assert_array_equal(kern[2], xla[2])  # keys


def test_the_kernel_top_k_and_softmax_draw_are_laxs_and_the_samplers():
    """The draft side's row reductions in the CPU loops (`cpu_sample.h`): `top_k` gives `lax.top_k`'s values and ids
    (ties in id order, +0 above -0, -inf rows; a NaN ranks as -inf); `softmax_draw` gives softmax(x / T) to float
    rounding and the token `sample_rows` draws for the same uniform, so a sampled draft step's kernel form (same keys
    and uniforms) keeps the drafts and q of its XLA form (tests/test_device_lowering.py checks that the CPU loops
    lower to these calls)."""
    from dflash_jax.decode import sampling
    rng = np.random.default_rng(19)
    for _ in range(60):
        n = int(rng.integers(1, 200))
        k = int(rng.integers(1, min(n, 33) + 1))
        x = np.round(rng.standard_normal((3, n)) * 2).astype(np.float32)  # ties, and -0 / +0
        x[rng.random((3, n)) < 0.2] = -np.inf
        x[2] = -np.inf
        vals, ids = jax.jit(cpu_kernel.top_k, static_argnums=1)(jnp.asarray(x), k)
        want_vals, want_ids = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(np.signbit(vals), np.signbit(want_vals))
        np.testing.assert_array_equal(vals, want_vals)
    nan = np.array([[np.nan, 1.0, np.nan, 3.0, 2.0]], np.float32)
    assert np.asarray(cpu_kernel.top_k(jnp.asarray(nan), 3)[1]).tolist() == [[3, 4, 1]]

    T = 0.7
    x = jnp.asarray(rng.standard_normal((2, 3, 1000)).astype(np.float32) * 3)
    u = jnp.asarray(rng.random((2, 3)).astype(np.float32))
    probs, tokens = jax.jit(cpu_kernel.softmax_draw)(x, u, T)
    np.testing.assert_allclose(probs, jax.nn.softmax(x / T, axis=-1), rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(tokens, cpu_kernel.sample_rows(x, u, T))

    sp = sampling.SamplingParams.make(temperature=T)
    keys = jax.random.key_data(jax.random.split(jax.random.key(4), 2))

    def draft(logits, k):  # the draft step's XLA form: q, then drafts drawn from it
        q = sampling.processed_probs(logits, sp)
        return sampling.sample_tokens(logits, k, sp, draft=True, probs=q) + (q,)
    xla_drafts, xla_keys, xla_q = jax.jit(draft)(x, keys)
    next_keys, u_draft = sampling._draw(keys, 3)  # what the kernel form draws with
    q, drafts = cpu_kernel.softmax_draw(x, u_draft, T)
    np.testing.assert_array_equal(next_keys, xla_keys)
    assert (np.asarray(drafts) == np.asarray(xla_drafts)).mean() > 0.99
    np.testing.assert_allclose(q, xla_q, rtol=1e-5, atol=1e-8)


def _cpu_has(*features: str) -> bool:
    flags = cpu_kernel._cpu_flags().split()  # the kernel's own reading of /proc/cpuinfo (its cache key)
    return all(f in flags for f in features)


def test_every_build_computes_the_same_values(tmp_path):
    """The kernel has three builds (AVX-512, AVX2 + FMA + F16C, portable C++) of the same chains; the best one this CPU
    runs is the default, and DFLASH_JAX_KERNEL_ISA builds a lower one. Each must give every format's products (and
    the row attention's sums) bit for bit, so a machine's speed never changes a value (and the AVX2 and portable
    builds, which CI's CPU may never pick by itself, are held to the one this CPU picks)."""
    isas = ["portable"] + (["avx2"] if _cpu_has("avx2", "fma", "f16c") else [])
    assert cpu_kernel.isa() in ("avx512", "avx2", "portable")
    _products_of_every_format(str(tmp_path / "native.npz"))
    native = np.load(tmp_path / "native.npz")
    tests_dir = str(Path(__file__).parent)
    for isa in isas:
        out = tmp_path / f"{isa}.npz"
        code = (f"import sys; sys.path.insert(0, {tests_dir!r}); import test_cpu_kernel as t; "
                "from dflash_jax.quant import cpu_kernel; "
                "assert cpu_kernel.available(), cpu_kernel.unavailable_reason(); "
                f"assert cpu_kernel.isa() == {isa!r}, cpu_kernel.isa(); "
                f"t._products_of_every_format({str(out)!r})")
        env = {**os.environ, cpu_kernel.ENV_ISA: isa, "JAX_PLATFORMS": "cpu"}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{isa}: {res.stderr[-3000:]}"
        other = np.load(out)
        assert sorted(other.files) == sorted(native.files)
        for key in native.files:
            np.testing.assert_array_equal(other[key], native[key], err_msg=f"{isa} build, {key}")


def test_an_unknown_kernel_build_is_refused_by_name():
    env = {**os.environ, cpu_kernel.ENV_ISA: "avx9000", "JAX_PLATFORMS": "cpu"}
    code = "from dflash_jax.quant import cpu_kernel; print(cpu_kernel.available(), cpu_kernel.unavailable_reason())"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "False" in res.stdout and "DFLASH_JAX_KERNEL_ISA='avx9000'" in res.stdout, res.stdout


@pytest.mark.parametrize("q8", [False, True])
def test_a_cpu_loop_forwards_row_is_the_same_bits_alone_and_in_a_verify(q8):
    """In the CPU loop programs (float32 or Q8 activations) every reduction of a row runs in an order of its own:
    the kernel's matmul rows, its fixed-order attention, RMSNorm's fixed tree. So the logits of a token verified as
    one of 8 rows equal, bit for bit, those of the decode of that token after the tokens before it: greedy
    speculative output equals autoregressive output by construction, not only where no two logits nearly tie.
    Control: outside the loops (XLA's attention and reductions) the same rows are only close."""
    cfg = tiny_qwen3(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=96, num_hidden_layers=2)
    rng = np.random.default_rng(3)
    target = dj.init_target(cfg, jax.random.key(4))
    target = target.replace(params=jax.tree.map(lambda a: a * 3.0, target.params))  # far from uniform attention
    prompt = jnp.asarray(rng.integers(0, 96, (2, 30)), jnp.int32)
    block = jnp.asarray(rng.integers(0, 96, (2, 8)), jnp.int32)

    def logits(loops: bool):
        with execution.changed(cpu_kernel=loops, q8_activations=q8 and loops, live_length_loop=loops):
            step = jax.jit(lambda t, c: forward_with_cache(target, t, c)[::2])
            _, cache = step(prompt, KVCache.empty(cfg, 2, 64))
            verify, _ = step(block, cache)
            decodes = []
            for t in range(8):
                row, cache = step(block[:, t:t + 1], cache)
                decodes.append(np.asarray(row[:, 0]))
        return np.asarray(verify), np.stack(decodes, axis=1)

    verify, decodes = logits(True)
    np.testing.assert_array_equal(verify, decodes)
    if not q8:
        xla_verify, xla_decodes = logits(False)
        np.testing.assert_allclose(xla_verify, verify, rtol=1e-4, atol=1e-4)
        assert not np.array_equal(xla_verify, xla_decodes)  # XLA's shape-dependent orders: close, not equal
