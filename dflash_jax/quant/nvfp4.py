"""NVFP4 (E2M1 codes, E4M3 block scales, FP32 tensor scale) as a pytree value.

Layout and numerics follow NVIDIA ModelOpt's NVFP4 weight recipe bit for bit (NVIDIA
Model-Optimizer `modelopt/torch/quantization/qtensor/nvfp4_tensor.py`): blocks of 16 along the last axis, two codes
per byte with element 2i in the LOW nibble, value = e2m1(code) * f32(block_scale) * global_scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.frozen import Replaceable

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9  # lower clamp for block scales so tiny blocks never underflow to 0

# Value of each 4-bit code; bit 3 is the sign (code 8 is -0.0).
E2M1_GRID: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

# Decision points between consecutive magnitude codes 0..7. A value exactly on a
# threshold goes to the EVEN code (IEEE round-to-nearest-even on the E2M1 grid), so
# ties at 0.75, 1.75, 3.5 round up and ties at 0.25, 1.25, 2.5, 5.0 round down.
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def e2m1_values() -> np.ndarray:
    """The 16 E2M1 code values, indexed by code (a copy of `E2M1_GRID`)."""
    return E2M1_GRID.copy()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array(Replaceable):
    """A quantized tensor of logical shape `shape`, blocks of 16 along the last axis.

    Leading dims are free ([out, in], [L, out, in], ...); `global_scale` is always one
    scalar for the whole array. Fields stay plain uint8 / float8_e4m3fn / float32
    arrays so orbax and safetensors never see float4 dtypes.
    """

    packed: jax.Array  # uint8 [..., K/2]; element 2i low nibble, 2i+1 high nibble
    block_scale: jax.Array  # float8_e4m3fn [..., K/16] (float32 accepted, see audit.py)
    global_scale: jax.Array  # float32 [] (ModelOpt weight_scale_2)
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    # float32 [] or None. W4A4 only (ModelOpt `input_scale` = calibrated amax_act / (6*448)): when present, linear
    # quantizes its activations to NVFP4 with this tensor scale, as a Blackwell W4A4 GEMM would; None = W4A16.
    input_scale: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        # +4: the float32 global scale.
        return int(self.packed.nbytes) + int(self.block_scale.nbytes) + 4


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _exact_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den with IEEE division, jit or not.

    XLA's algebraic simplifier rewrites `a / c` (c a constant) and `a / broadcast(b)`
    into `a * (1/c)` / `a * broadcast(1/b)`; the rounded reciprocal is one ulp off for
    ~20% of inputs, which flips block scales and codes versus ModelOpt. Broadcasting
    the divisor to full shape *behind* an optimization barrier hides both patterns.
    Not robust under `vmap` (the barrier is then applied before the batch broadcast);
    quantize stacked weights through leading dims instead.
    """
    den = jnp.broadcast_to(den, jnp.broadcast_shapes(num.shape, den.shape))
    return num / jax.lax.optimization_barrier(den)


def _validate(w: Any, global_scale: Any) -> None:
    shape = tuple(np.shape(w))
    if len(shape) < 1:
        raise ValueError(f"NVFP4 quantize needs rank >= 1, got a rank-0 input of shape {shape}")
    k = shape[-1]
    if k <= 0 or k % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 quantize: last axis length {k} (shape {shape}) is not a positive multiple of {BLOCK_SIZE}"
        )
    # Value checks need concrete data; under jit they cannot run and are skipped.
    if not _is_traced(w) and not bool(np.all(np.isfinite(np.asarray(w, dtype=np.float32)))):
        raise ValueError("NVFP4 quantize: input contains NaN or Inf")
    if global_scale is not None:
        if np.shape(global_scale) not in ((), (1,)):
            raise ValueError(f"NVFP4 quantize: global_scale must be a scalar, got shape {np.shape(global_scale)}")
        if not _is_traced(global_scale):
            g = float(np.asarray(global_scale, dtype=np.float32).reshape(()))
            if not (np.isfinite(g) and g > 0):
                raise ValueError(f"NVFP4 quantize: global_scale must be finite and > 0, got {g}")


def _round_to_e2m1_codes(v: jax.Array) -> jax.Array:
    """float32 -> uint8 code in [0, 16), RNE on the E2M1 grid, saturating at +-6.

    Comparisons are exact on every backend, unlike float4 converts whose GPU
    rounding is unverified. Sign follows ModelOpt (`v < 0`): -0.0 -> code 0, while a
    negative value that rounds to zero keeps its sign (code 8).
    """
    mag = jnp.abs(v)
    code = jnp.zeros(v.shape, jnp.uint8)
    for t, up in zip(_THRESHOLDS, _TIE_ROUNDS_UP):
        code = code + (mag >= t if up else mag > t).astype(jnp.uint8)
    return code | jnp.where(v < 0, jnp.uint8(8), jnp.uint8(0))


def _quantize(w: jax.Array, global_scale: jax.Array | None) -> NVFP4Array:
    """Unchecked quantizer (traceable); `quantize` validates, linear's native path calls this directly."""
    shape = tuple(w.shape)
    w = w.astype(jnp.float32)
    if global_scale is None:
        amax = jnp.max(jnp.abs(w))
        s2 = _exact_div(amax, jnp.float32(E2M1_MAX * E4M3_MAX))  # 2688 = 6 * 448
        # All-zero (or denormal-tiny) tensor: s2 = 0 would make every block 0/0. s2 = 1.0
        # makes every block scale 0 -> 1.0 and every code 0, so dequantize is exactly 0.
        s2 = jnp.where(s2 > 0, s2, jnp.float32(1.0))
    else:
        s2 = jnp.asarray(global_scale, jnp.float32).reshape(())
    blocks = w.reshape(shape[:-1] + (shape[-1] // BLOCK_SIZE, BLOCK_SIZE))  # [..., K/16, 16]
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., K/16]
    sb = _exact_div(block_amax, jnp.float32(E2M1_MAX) * s2)
    sb = jnp.where(sb == 0, jnp.float32(1.0), sb)  # all-zero block -> 1.0 (ModelOpt)
    # Upper clamp: a non-saturating E4M3 cast turns overflow into NaN (explicit global_scale).
    sb = jnp.clip(sb, E4M3_MIN_SUBNORMAL, E4M3_MAX).astype(jnp.float8_e4m3fn)
    step = sb.astype(jnp.float32) * s2  # [..., K/16]; the *rounded* scale, as ModelOpt
    v = _exact_div(blocks, step[..., None])  # [..., K/16, 16]
    codes = _round_to_e2m1_codes(v).reshape(shape[:-1] + (shape[-1] // 2, 2))  # [..., K/2, 2]
    packed = codes[..., 0] | (codes[..., 1] << 4)  # [..., K/2]
    return NVFP4Array(packed=packed, block_scale=sb, global_scale=s2, shape=shape)


# `quantize` runs the recipe as one compiled program per weight shape: run eagerly, each of its ~40 primitives is
# compiled on its own for every new shape (a 5.8M drafter's first quantization took 10.8 s of such compiles on 2 CPU
# cores). Bit-identical either way: `_exact_div` and the threshold compares are what make it exact, jit or not.
_quantize_compiled = jax.jit(_quantize)


def quantize(w: jax.Array | np.ndarray, *, global_scale: Any = None) -> NVFP4Array:
    """Quantize `w` ([..., K], K % 16 == 0) with the ModelOpt NVFP4 recipe, bit-exactly.

    global_scale: defaults to amax(|w|) / (6 * 448) over the whole tensor. An all-zero
    tensor gets global_scale 1.0 (block scales 1.0, codes 0, dequantizes to exact 0).
    Raises ValueError on rank 0, a bad last axis, NaN/Inf in `w` (only when `w` is
    concrete; under jit the check cannot run), or a non-positive/NaN global_scale.
    """
    _validate(w, global_scale)
    return _quantize_compiled(jnp.asarray(w), global_scale)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> uint8 codes [..., K] in element order."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)  # [..., K/2, 2]
    return codes.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def unpack_e2m1(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> float4_e2m1fn [..., K] in element order (ModelOpt's: element 2i is the LOW nibble).

    XLA's constant folder orders the two nibbles of this uint8 -> 2 x float4 bitcast the other way from compiled code
    (jax 0.10.2), so a jitted function that closed over a packed weight (a constant to XLA) decoded other values than
    one that took it as an argument. The optimization barrier keeps the bitcast out of constant folding (one nibble at
    a time through uint4 also folds right, but runs the CPU matmul ~2x slower). tests/test_nvfp4.py checks both ways.
    """
    e = jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(packed), jnp.float4_e2m1fn)  # [..., K/2, 2]
    return e.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def dequantize_unscaled(q: NVFP4Array, dtype: Any = jnp.float32) -> jax.Array:
    """e2m1(code) * f32(block_scale), without the tensor scale, shape `q.shape`, in `dtype`.

    Exact in bfloat16, float16 and float32: an E2M1 value has 2 significant bits and an E4M3 scale 4, so their
    product has at most 6 (the smallest, 0.5 * 2^-9, is a normal bf16/f32 number and an f16 subnormal). A matmul
    with this weight and the tensor scale applied to its f32 result rounds only x and the accumulation, the same in
    every dtype (what the Pallas kernel computes, and the portable backend too: the backends agree in bf16).
    """
    values = unpack_e2m1(q.packed).astype(jnp.float32)  # [..., K]
    blocks = values.reshape(q.shape[:-1] + (q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    return (blocks * q.block_scale.astype(jnp.float32)[..., None]).reshape(q.shape).astype(dtype)


def dequantize(q: NVFP4Array, dtype: Any = jnp.float32) -> jax.Array:
    """e2m1(code) * f32(block_scale) * global_scale, shape `q.shape`, cast to `dtype`.

    Scale product first, as ModelOpt's dequantize does (`f32(scale) * weight_scale_2`),
    so both give the same float32 bits.
    """
    values = unpack_e2m1(q.packed).astype(jnp.float32)  # [..., K]
    step = q.block_scale.astype(jnp.float32) * q.global_scale.astype(jnp.float32)  # [..., K/16]
    blocks = values.reshape(q.shape[:-1] + (q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    return (blocks * step[..., None]).reshape(q.shape).astype(dtype)
