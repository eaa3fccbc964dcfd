"""The one matmul of dflash-jax: `linear(x, w)` for dense and NVFP4 weights.

Every scale of an NVFP4 weight is applied in here, so no model code can forget one
(the llama.cpp DFlash bug of PR #28000 was exactly a caller dropping `weight_scale_2`).

Backends for NVFP4 weights:
  portable  W4A16: dequantize the weight to x.dtype without its tensor scale (exact), the same
            f32-accumulating dot as a dense weight, then the tensor scale on the f32 result, as the
            Pallas kernel does: the backends agree in bf16 too, not only in f32. Runs everywhere,
            but on a GPU XLA writes the dequantized weight to memory and reads it back (its Triton GEMM
            fusion takes no uint8 nibble unpacking and, by default, no per-16-element scales).
  pallas    W4A16: one Pallas/Triton kernel (pallas_nvfp4.py) reads the packed codes and
            block scales tile by tile and dequantizes in registers; no dequantized weight
            exists outside it. CUDA GPUs of any compute capability; on CPU the same kernel runs
            interpreted (slow, exact: what the tests use). From 256 rows of x on (prefill) it
            dequantizes once and calls the library GEMM instead (pallas_nvfp4.GEMM_MIN_ROWS).
  native    W4A4 (explicit only): quantize x to NVFP4 on the fly and call `jax.nn.scaled_matmul`
            (cuDNN block-scaled GEMM on Blackwell; an XLA dequant+dot composite on other CUDA
            GPUs). Without a calibrated `input_scale` the activation tensor scale is dynamic, one
            per row (amax of the row / (6*448)), so a row's result never depends on the other rows
            of the batch. Results differ from portable by the activation quantization error.
W4A4 weights (`input_scale` set) quantize x with that calibrated static scale first on every
backend, so all keep the same activation semantics.
Selection: explicit `backend=` > `backend_scope(...)` > `set_default_backend(...)` > env DFLASH_JAX_NVFP4_BACKEND
> auto: W4A16 everywhere, pallas on CUDA GPUs (any compute capability), portable elsewhere (CPU, TPU, ROCm).
`resolve_backend` and `BACKENDS` are the one source of truth for names and availability. `backend_scope` and
`set_default_backend` set the `nvfp4_backend` of the execution context (`dflash_jax.execution`: the local one and the
process default), which is part of every jit cache key, so a program traced under one backend is never reused under
another. The package's jitted calls resolve the backend on the host (`program_backend`) and run under a context
holding that name.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax import execution
from dflash_jax.frozen import Replaceable
from dflash_jax.quant import cpu_kernel, ggml, pallas_nvfp4
from dflash_jax.quant.ggml import GGMLArray
from dflash_jax.quant.nvfp4 import BLOCK_SIZE, NVFP4Array, _quantize, dequantize, unpack_e2m1

BACKENDS = ("portable", "pallas", "native")
ENV_VAR = "DFLASH_JAX_NVFP4_BACKEND"

# Indirection so tests can emulate the native kernel on CPU (jax <= 0.10.2 has no CPU lowering).
_scaled_matmul = jax.nn.scaled_matmul


def set_default_backend(backend: str | None) -> None:
    """Process-wide NVFP4 backend (the process default's `ExecutionContext.nvfp4_backend`); None restores env/auto
    selection."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown NVFP4 backend {backend!r}; expected one of {BACKENDS} or None")
    execution.set_process_default(execution.process_default().replace(nvfp4_backend=backend))


def _compute_capability() -> float | None:
    try:
        dev = jax.devices()[0]
        if dev.platform != "gpu":
            return None
        return float(dev.compute_capability)
    except Exception:  # no GPU, no attribute, odd version string: treat as "not Blackwell"
        return None


def native_supported() -> bool:
    """scaled_matmul lowers only on GPU backends in jax <= 0.10.2 (never on CPU)."""
    try:
        return jax.default_backend() == "gpu"
    except Exception:
        return False


def _platform() -> str:
    """'cuda', 'rocm', 'cpu', 'tpu', ... of the default device (what the Pallas kernel would lower for)."""
    try:
        dev = jax.devices()[0]
    except Exception:
        return "unknown"
    if dev.platform != "gpu":
        return dev.platform
    try:
        version = dev.client.platform_version.lower()
    except Exception:
        version = ""
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


def pallas_supported() -> bool:
    """The Pallas NVFP4 kernel lowers through Triton for CUDA GPUs, and runs interpreted on CPU."""
    return _platform() in ("cuda", "cpu")


def backend_scope(backend: str | None):
    """Inside the block, `linear(x, w)` without `backend=` uses `backend` (None: the usual selection)."""
    return execution.changed(nvfp4_backend=backend)


def resolve_backend(backend: str | None = None) -> str:
    choice = (backend or execution.current().nvfp4_backend or execution.process_default().nvfp4_backend
              or os.environ.get(ENV_VAR) or None)
    if choice is None:  # W4A16 everywhere: a row's result never depends on the batch, backends agree
        return "pallas" if _platform() == "cuda" else "portable"
    if choice not in BACKENDS:
        raise ValueError(f"unknown NVFP4 backend {choice!r}; expected one of {BACKENDS}")
    if choice == "native" and not native_supported():
        raise RuntimeError(
            f"NVFP4 backend 'native' needs a GPU (jax.nn.scaled_matmul has no lowering on "
            f"{jax.default_backend()!r}); use backend='portable' (or 'pallas' to run the W4A16 kernel, "
            f"interpreted on CPU)"
        )
    if choice == "pallas" and not pallas_supported():
        raise RuntimeError(
            f"NVFP4 backend 'pallas' needs a CUDA GPU (its kernel lowers through Triton) or the CPU (interpreted); "
            f"this device is {_platform()!r}; use backend='portable'"
        )
    return choice


def program_backend(*models, backend: str | None = None) -> str | None:
    """The NVFP4 backend a program over `models` (pytrees) is compiled for, resolved now, on the host: a concrete
    name when any leaf is an NVFP4Array (or `backend` is given, which is validated), else None (dense models do not
    depend on it). Run the program under an execution context holding it."""
    has_nvfp4 = any(isinstance(leaf, NVFP4Array) for leaf in
                    jax.tree.leaves(models, is_leaf=lambda x: isinstance(x, NVFP4Array)))
    return resolve_backend(backend) if has_nvfp4 or backend is not None else None


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    # x [..., in] . w [out, in] -> [..., out], contracting the last axes (HF layout, no transpose).
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def quantize_activations(x: jax.Array, input_scale: jax.Array | None) -> jax.Array:
    """W4A4 emulation: x rounded through NVFP4 with the calibrated tensor scale (blocks of 16 along in); None =
    the dynamic scale of the native backend, one per row: amax(row) / (6 * 448).

    The derivative is the identity (straight-through, as in quantization-aware training): the rounding is piecewise
    constant, so its true derivative is 0 almost everywhere and nothing upstream of a W4A4 layer would get a gradient
    (audit_scales could then not see whether the scales of earlier layers reach the output).
    """
    if input_scale is None:
        return _round_activations_dynamic(x)
    return _round_activations(x, jnp.asarray(input_scale, jnp.float32))


@jax.custom_jvp
def _round_activations(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    return dequantize(_quantize(x.astype(jnp.float32), input_scale), x.dtype)


@_round_activations.defjvp
def _round_activations_jvp(primals, tangents):
    return _round_activations(*primals), tangents[0]


def _quantize_rows(x2: jax.Array) -> NVFP4Array:
    """x2 [M, K] -> NVFP4 with one dynamic tensor scale per row (global_scale [M]): rows never mix."""
    return jax.vmap(lambda r: _quantize(r, None))(x2.astype(jnp.float32))


@jax.custom_jvp
def _round_activations_dynamic(x: jax.Array) -> jax.Array:
    k = x.shape[-1]
    q = _quantize_rows(x.reshape(-1, k))
    return jax.vmap(lambda r: dequantize(r, x.dtype))(q).reshape(x.shape)


@_round_activations_dynamic.defjvp
def _round_activations_dynamic_jvp(primals, tangents):
    return _round_activations_dynamic(*primals), tangents[0]


@jax.custom_jvp
def _linear_native(x: jax.Array, w: NVFP4Array) -> jax.Array:
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    # The calibrated static activation scale a W4A4 checkpoint carries, or a dynamic one per row ([M]).
    if w.input_scale is not None:
        xq = _quantize(x.reshape(1, m, k), w.input_scale)  # unchecked: x may be traced
        x_scale = xq.global_scale  # []
    else:
        rows = _quantize_rows(x.reshape(m, k))
        xq = NVFP4Array(packed=rows.packed[None], block_scale=rows.block_scale[None],
                        global_scale=jnp.ones((), jnp.float32), shape=(1, m, k))
        x_scale = rows.global_scale[None, :, None]  # [1, M, 1]
    out = _scaled_matmul(
        unpack_e2m1(xq.packed),  # [1, M, K] f4
        unpack_e2m1(w.packed)[None],  # [1, N, K] f4
        xq.block_scale,  # [1, M, K/16] e4m3
        w.block_scale.astype(jnp.float8_e4m3fn)[None],  # [1, N, K/16] e4m3
        preferred_element_type=jnp.float32,
    )  # [1, M, N]
    # scaled_matmul knows no tensor scales: both go on the result.
    out = out * (x_scale * w.global_scale.astype(jnp.float32))
    return out.reshape(x.shape[:-1] + (w.shape[0],))


@_linear_native.defjvp
def _linear_native_jvp(primals, tangents):
    # The block-scaled kernel has no derivative (and the float8 casts of its operands none either). It computes
    # rounded(x) @ dequantize(w).T, so differentiate that instead (straight through the activation rounding): the
    # same derivative as the portable W4A4 path, and what lets audit_scales see the block scales on this backend.
    x, w = primals

    def same_product(x, w):
        return _dot(quantize_activations(x, w.input_scale), dequantize(w, x.dtype))

    _, tangent = jax.jvp(same_product, (x, w), tangents)
    return _linear_native(x, w), tangent.astype(jnp.float32)


def _check_nvfp4(w: NVFP4Array) -> None:
    n, k = w.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"linear: NVFP4 weight shape {tuple(w.shape)}: in features {k} is not a multiple of "
                         f"{BLOCK_SIZE} (the NVFP4 block size)")
    if tuple(w.packed.shape) != (n, k // 2) or tuple(w.block_scale.shape) != (n, k // BLOCK_SIZE):
        raise ValueError(f"linear: NVFP4 weight shape {tuple(w.shape)} needs packed {(n, k // 2)} and block_scale "
                         f"{(n, k // BLOCK_SIZE)}, got {tuple(w.packed.shape)} and {tuple(w.block_scale.shape)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DequantizedNVFP4(Replaceable):
    """The exact dense equivalent of an NVFP4Array, in the same clothes: what `audit_scales` runs a forward with.

    `linear` computes x @ weight.T, first rounding x through NVFP4 when `round_input` (a W4A4 leaf, or any leaf on
    the native backend: `act_scale` None = the dynamic per-call scale). The scale fields are ONES and `input_scale`
    is inert: the scales are already inside `weight`, so a forward that reads, replaces or multiplies a leaf's scales
    itself sees here what a correct dequantization implies (scale x 1), and one that tampers with them changes
    nothing in this reference.
    """

    weight: jax.Array  # [out, in] float32 e2m1(code) * block_scale * global_scale
    packed: jax.Array  # the original codes (not used by linear)
    block_scale: jax.Array  # ones [out, in/16]
    global_scale: jax.Array  # 1.0
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    input_scale: Any = None  # the original leaf's (not used by linear)
    act_scale: Any = None  # float32 [] or None: activation tensor scale when round_input
    round_input: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _leading_rows(w: Any, n: int) -> Any:
    """The first n output rows of a weight [out, in]: rows carry their own block scales, and the tensor scale is
    shared, so a prefix of an NVFP4Array is the NVFP4Array of that prefix."""
    out = w.shape[0]
    if not 1 <= n <= out:
        raise ValueError(f"linear: out_rows {n} outside 1..{out} (the weight has {out} output rows)")
    if isinstance(w, NVFP4Array):
        return w.replace(packed=w.packed[:n], block_scale=w.block_scale[:n], shape=(n, *w.shape[1:]))
    if isinstance(w, DequantizedNVFP4):
        return w.replace(weight=w.weight[:n], packed=w.packed[:n], block_scale=w.block_scale[:n],
                         shape=(n, *w.shape[1:]))
    return w[:n]


def cpu_kernel_scope(on: bool):
    """Inside the block, `linear` runs dense and NVFP4 weights through the CPU kernel when it can (the execution
    context's `cpu_kernel`; the CPU generation loops run under it)."""
    return execution.changed(cpu_kernel=bool(on))


def q8_activations_scope(on: bool):
    """Inside the block, GGML weights' products on a CPU round x to Q8 blocks: llama.cpp's integer dot (the execution
    context's `q8_activations`; `generate(..., q8_activations=True)` sets it for its programs)."""
    return execution.changed(q8_activations=bool(on))


def bf16_products_scope(on: bool | None):
    """Inside the block, GGML weights' products on a CPU round the weights and x to bfloat16: AVX512-BF16's dot
    product (the execution context's `bf16_products`; `generate(..., bf16_products=True)` sets it for its
    programs). False: float32 products in generation too; None: generation's default
    (`generation_bf16_products`)."""
    return execution.changed(bf16_products=None if on is None else bool(on))


def cpu_kernel_runs() -> bool:
    """Whether `linear` can run weights through the CPU kernel here (a CPU device, the kernel built)."""
    return _platform() == "cpu" and cpu_kernel.available()


def _kernel_form(x: jax.Array, w: Any, backend: str | None):
    """(format, (codes, scale, mins, tensor scale), dequantize) of a weight the CPU kernel takes, or None: GGML
    blocks always (on a CPU); inside the CPU generation loops (the context's `cpu_kernel`) also dense float32 /
    bfloat16 weights and W4A16 NVFP4 ones with E4M3 block scales where the portable backend would run them (the same
    values: exact dequantization, float32 sums, the tensor scale on the result)."""
    if not cpu_kernel_runs() or x.ndim < 1 or len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        return None
    if isinstance(w, GGMLArray):
        def dense(codes, scale, mins, _):
            return ggml.dequantize(w.replace(codes=codes, scale=scale, mins=mins))
        context = execution.current()  # x rounded: llama.cpp's integer dot, or AVX512-BF16's dot product
        suffix = "_q8" if context.q8_activations else "_bf16" if context.bf16_products else ""
        return w.kind + suffix if w.kind in ("q4_1", "q8_0") else w.kind, (w.codes, w.scale, w.mins, None), dense
    if not execution.current().cpu_kernel:
        return None
    if isinstance(w, NVFP4Array):
        if (w.input_scale is not None or w.block_scale.dtype != jnp.float8_e4m3fn or w.shape[1] % BLOCK_SIZE
                or resolve_backend(backend) != "portable"):
            return None
        return ("nvfp4", (w.packed, w.block_scale, None, w.global_scale),
                lambda p, b, _, g: dequantize(w.replace(packed=p, block_scale=b, global_scale=g), jnp.float32))
    if isinstance(w, DequantizedNVFP4) or not hasattr(w, "dtype"):
        return None
    kinds = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}
    if jnp.dtype(w.dtype) not in kinds:
        return None
    return kinds[jnp.dtype(w.dtype)], (w, None, None, None), lambda c, *_: jnp.asarray(c, jnp.float32)


def embedding_rows(table: Any, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` [...] of an embedding table [V, H] (dense or GGML blocks) -> [..., H] in `dtype`."""
    if isinstance(table, GGMLArray):
        return ggml.take_rows(table, ids, dtype)
    if isinstance(table, NVFP4Array):
        raise TypeError("embedding tables are never NVFP4 (only linear layers are quantized)")
    return jnp.take(table, ids, axis=0).astype(dtype)


def linear_many(x: jax.Array, weights: tuple, *, backend: str | None = None) -> tuple[jax.Array, ...]:
    """(linear(x, w) for w in weights), the same values bit for bit, as ONE CPU kernel call where every weight runs
    through the kernel: a layer's q / k / v or gate / up share their input, and a decode step is short enough that
    the per-call cost of ~90 extra calls shows (`docs/cpu-step.md`). Elsewhere, one `linear` per weight."""
    forms = [_kernel_form(x, w, backend) for w in weights]
    if len(weights) < 2 or any(f is None for f in forms):
        return tuple(linear(x, w, backend=backend) for w in weights)
    return _kernel_products(x, weights, forms, [w.shape[0] for w in weights])


def _kernel_products(x: jax.Array, weights, forms, rows) -> tuple[jax.Array, ...]:
    """The CPU kernel's products of x with each weight (its `_kernel_form`), the first `rows` outputs of each, in one
    call; [..., rows_i] in x.dtype. The calibration recorder sees every (x, weight) pair as `linear` would."""
    recorder = execution.current().input_recorder
    if recorder is not None:
        for w in weights:
            recorder(x, w)
    ys = cpu_kernel.matmul_many(x, [(fmt, *arrays, n, lambda *a, dense=dense, n=n: dense(*a)[:n])
                                    for (fmt, arrays, dense), n in zip(forms, rows)])
    return tuple(y.astype(x.dtype) for y in ys)


def linear(x: jax.Array, w: Any, *, backend: str | None = None, out_rows: int | None = None) -> jax.Array:
    """y = x @ w.T for w [out, in] (dense array, NVFP4Array or GGMLArray); returns [..., out] in x.dtype.

    Accumulates in float32. `backend` only matters for NVFP4 weights (see module doc). out_rows: compute only the
    first out_rows outputs (a static prefix of w's rows, with their scales; the rest of w is never read), e.g. a
    drafter's LM head over its draft vocabulary. GGML weights run through the CPU kernel on a CPU (`cpu_kernel`),
    else as the XLA product with their dequantized values; inside the CPU generation loops dense and NVFP4 weights
    do too (`_kernel_form`), so a row's result there never depends on how many rows share the product.
    """
    recorder = execution.current().input_recorder  # calibration (quantize.collect_linear_inputs), eager only
    kernel = _kernel_form(x, w, backend)
    if kernel is not None:
        n = w.shape[0] if out_rows is None else out_rows
        if not 1 <= n <= w.shape[0]:
            raise ValueError(f"linear: out_rows {n} outside 1..{w.shape[0]} (the weight has {w.shape[0]} output rows)")
        return _kernel_products(x, (w,), (kernel,), (n,))[0]
    if isinstance(w, GGMLArray):  # no kernel here: the XLA product with the dequantized values
        if recorder is not None:
            recorder(x, w)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"linear: x shape {tuple(x.shape)} does not match weight shape {tuple(w.shape)} "
                             f"(expected x [..., {w.shape[1]}] and weight [out, in])")
        n = w.shape[0] if out_rows is None else out_rows
        if not 1 <= n <= w.shape[0]:
            raise ValueError(f"linear: out_rows {n} outside 1..{w.shape[0]} (the weight has {w.shape[0]} output rows)")
        return _dot(x, ggml.dequantize(ggml.leading_rows(w, n) if n != w.shape[0] else w, x.dtype)).astype(x.dtype)
    if out_rows is not None and out_rows != w.shape[0]:
        w = _leading_rows(w, out_rows)
    if recorder is not None:
        recorder(x, w)
    w_shape = tuple(w.shape)
    if len(w_shape) != 2 or x.ndim < 1 or x.shape[-1] != w_shape[1]:
        raise ValueError(
            f"linear: x shape {tuple(x.shape)} does not match weight shape {w_shape} "
            f"(expected x [..., {w_shape[-1] if w_shape else '?'}] and weight [out, in])"
        )
    if isinstance(w, NVFP4Array):
        _check_nvfp4(w)
        choice = resolve_backend(backend)
        if choice == "native":
            return _linear_native(x, w).astype(x.dtype)
        if w.input_scale is not None:
            x = quantize_activations(x, w.input_scale)
        if choice == "pallas":
            return pallas_nvfp4.nvfp4_matmul(x, w)  # [..., out] in x.dtype; x reshaped to [M, in] inside
        return pallas_nvfp4.dequant_matmul(x, w)  # portable: tensor scale on the f32 result, like the kernel
    elif isinstance(w, DequantizedNVFP4):
        if w.round_input:
            x = quantize_activations(x, w.act_scale)
        w = jnp.asarray(w.weight).astype(x.dtype)
    else:
        w = jnp.asarray(w).astype(x.dtype)
    return _dot(x, w).astype(x.dtype)
