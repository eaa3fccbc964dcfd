"""W4A16 NVFP4 matmul as one Pallas kernel (Triton lowering): y = x @ dequant(w).T without a dequantized weight.

Why: on GPUs without FP4 tensor cores (Hopper and older) the portable path dequantizes the whole weight to
bf16 in HBM and reads it back, so an NVFP4 drafter is slower than a bf16 one (XLA's Triton GEMM fusion
takes neither uint8 nibble unpacking nor per-16-element scales by default). Here each
program reads packed codes and E4M3 block scales of one [block_n, block_k] weight tile, decodes them in
registers and feeds the tensor cores; HBM sees 4.5 bits per weight.

Layout (NVFP4Array, ModelOpt): packed uint8 [N, K/2], element 2i in the low nibble; block scales [N, K/16]
(float8_e4m3fn, or float32 as audit.py passes them); one float32 tensor scale s2.

How the kernel computes it (one program = one [block_m, block_n] output tile and a range of K tiles):
- x [M, K] is read in place (a free reshape of the caller's [..., K]); rows past M are masked loads of 0, so
  M = 1..15 still feeds a 16-row dot (Triton's dot needs every dimension >= 16, and power-of-two shapes) without
  moving padding through memory. Each [block_m, block_k] x tile is split into its even and odd columns in
  registers (reshape to [..., 2] + unstack, i.e. Triton's split): the low nibbles meet the even columns, the high
  nibbles the odd ones, so there are two dots per tile and no interleave of the weight.
- E2M1 decode by bit arithmetic (Triton has no gather, so no table lookup): a nibble s|e1 e0|m placed as
  s<<15 | (e m)<<9 is the float16 e2m1(c) * 2^-14, the E2M1 subnormal 0.5 included (float16 keeps
  subnormals; float32 denormals might be flushed). The 2^14 is folded into the block scale.
- E4M3 block scales are decoded from their bits too (no fp8 type inside the kernel, so it also lowers for GPUs
  before sm_89; see e4m3_times_2p14), one scale broadcast over 8 packed bytes = 16 elements.
- code * scale is exact in bf16, f16 and f32 (2 x 4 significant bits), so the tile fed to the dot is exactly the
  dequantized weight over s2; accumulation is f32; s2 multiplies the result once, in the epilogue, which stores
  [M, N] in x's dtype directly (masked): one kernel launch per linear.
- Split K: when N has too few tiles to fill the GPU, grid axis 2 splits the K loop; partial sums [S, M, N]
  (f32) are added outside the kernel in a fixed order (deterministic), one small extra fusion.
- Partial tiles (N or K not a multiple of the tile, K tiles past K when the split does not divide them) use
  masked loads with `other=0`: out-of-bounds reads return garbage on a GPU (NaN in interpret mode). The masks
  are emitted only where a tile can leave its array (static shapes), so aligned shapes load unmasked.
Only integers of >= 16 bits enter pointwise ops (Triton rejects 8-bit arithmetic): uint8 loads are cast to
int32 first.

`nvfp4_matmul(x, w)` runs the Triton kernel on a GPU and the same kernel interpreted (`interpret=True`) on
CPU, so CPU tests execute exactly this code. Its derivative (for `audit_scales`) is the portable formula.
From GEMM_MIN_ROWS rows of x on (prefill, big batches) the kernel is not used: each M block would decode every
weight tile again (M / 64 times in all), while one dequantization (to x's dtype, without the tensor scale) and the
library GEMM pay for the decode once and run at the GEMM's full speed (`dequant_matmul`, the same numbers).

Performance notes (read off sm_90 SASS compiled on a CPU host with XLA's Triton pipeline and ptxas, jaxlib 0.10.2;
timed on an H200 in reports/device_report.md: 17 us for 4096x4096 at M = 1, 0.55-0.74 TB/s of packed weights,
12-15% of HBM, slower than bf16 dense at 54-70%): with the default tiles the bf16 kernel issues ~12 instructions per weight element
(~9 of them the decode: LOP3/IMAD/PRMT for the bits, HADD2.F32, FMUL, F2FP), 142-180 registers, no spills,
35 KiB of shared memory at M <= 16 (172 KiB at M = 64); loads are 16-byte cp.async. At ~12 instructions per
element a 4096x4096 GEMV needs ~6 us of issue time on an H200 against ~2 us of HBM time for its 9.4 MB, so
the kernel is issue-bound, not bandwidth-bound (the device report's timings agree): the next step is a
packed decode (two f16/bf16 values per 32-bit op, e.g. plgpu.elementwise_inline_asm on 4 packed bytes) with
this bit-arithmetic path kept for the interpreter. block_n below 16 x num_warps makes warps decode the same
weights (4x the instructions at block_n 16 with 4 warps), hence num_warps = block_n / 16 in choose_tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax import execution
from dflash_jax.quant.nvfp4 import BLOCK_SIZE, NVFP4Array, dequantize, dequantize_unscaled

DEFAULT_CORES = 132  # H200 / H100 SXM multiprocessors; sizes the grid when no GPU is visible (CPU tests, export)
MAX_BLOCK_M = 64  # rows of x per program; decode shapes (M <= 64) are one M block
GEMM_MIN_ROWS = 256  # from this many rows of x on, dequantize once and call the library GEMM (module doc)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static launch configuration. block_n, block_k: powers of two, block_n >= 16, block_k >= 32 (two dots of
    block_k/2 >= 16); both shrink to the problem. split_k: programs sharing one N tile's K loop (>= 1).
    num_warps / num_stages: Triton's (warps per program, software-pipelining depth of the K loop)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name, v, lo in (("block_n", self.block_n, 16), ("block_k", self.block_k, 32)):
            if v < lo or v & (v - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= {lo}, got {v}")
        if self.split_k < 1:
            raise ValueError(f"Tiles.split_k must be >= 1, got {self.split_k}")


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def _block_m(m: int) -> int:
    return min(_pow2_at_least(m, 16), MAX_BLOCK_M)


def num_cores() -> int:
    """Multiprocessors of the first GPU, else DEFAULT_CORES (what an export for an H200 should assume)."""
    try:
        d = jax.devices()[0]
        if d.platform == "gpu":
            return int(getattr(d, "core_count", 0) or DEFAULT_CORES)
    except Exception:
        pass
    return DEFAULT_CORES


def choose_tiles(m: int, n: int, k: int, *, x_dtype=jnp.bfloat16, cores: int | None = None,
                 block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                 num_stages: int = 3) -> Tiles:
    """Default tiles for x [m, k] @ w[n, k].T (a heuristic: the device report sweeps alternatives on a GPU);
    block_n / block_k / num_warps override single choices, the split is then derived the same way.

    - block_n: 64 up to M = 16, 128 above (every program re-reads its x tile for each weight tile: x is 2 bytes
      per element per row, a weight element 0.56 bytes, so block_n grows with M); num_warps = block_n / 16, since
      Triton spreads a [16, block_n] dot over warps in 16-column slices and fewer columns per warp makes warps
      decode the same weights twice (seen in the sm_90 SASS: 4x the instructions per element at block_n 16 with
      4 warps).
    - float32 activations (IEEE f32 dots, operands staged in shared memory at 4 bytes) use smaller tiles so the
      pipeline fits in the 227 KiB of shared memory a Hopper program may use.
    - split K until the grid has about four warps per multiprocessor (the decode is arithmetic-heavy: the
      schedulers need several warps to hide latency), preferring splits that divide the K tiles (no masked tail)
      and keeping >= 2 K tiles per program for the software pipeline. A split costs one more small kernel (the
      sum of the partial results), so none is made when the N tiles alone fill the GPU.
    """
    cores = cores or num_cores()
    f32 = jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    bn = block_n or (128 if m > 16 and not f32 else 32 if m > 16 else 64)
    bn = min(bn, _pow2_at_least(n, 16))
    bk = min(block_k or (128 if f32 else 256), _pow2_at_least(k, 32))
    warps = num_warps or max(1, min(8, bn // 16))
    n_tiles, m_blocks, k_tiles = -(-n // bn), -(-m // _block_m(m)), -(-k // bk)
    busy = n_tiles * m_blocks * warps  # warps the grid occupies without a split
    want = 1 if busy >= 4 * cores else -(-4 * cores // busy)
    cap = max(1, k_tiles // 2)
    exact = [s for s in range(1, cap + 1) if k_tiles % s == 0 and want / 2 <= s <= 2 * want]
    split = min(exact, key=lambda s: (abs(s - want), s)) if exact else min(want, cap)
    return Tiles(bn, bk, split, warps, num_stages)


# -- in-kernel decoding (shared by the kernel and the tests) -----------------------------------------------------

def e2m1_pair_times_2m14(p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 bytes p (0..255) -> (low-nibble value, high-nibble value) * 2^-14 as float32.

    float16 layout 1-5-10: the nibble's 2 exponent + 1 mantissa bits go to bits 9..11 (exponent field e, top
    mantissa bit m), the sign to bit 15: value 2^(e-15) (1 + m/2) = e2m1 * 2^-14 for e >= 1, and for e = 0 the
    float16 subnormal m * 2^-15 = 0.5 m * 2^-14, E2M1's own subnormal. Exact, no table, no branch.
    """
    lo = ((p & 0x8) << 12) | ((p & 0x7) << 9)
    hi = ((p & 0x80) << 8) | ((p & 0x70) << 5)
    f = lambda b: jax.lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
    return f(lo), f(hi)


def e4m3_times_2p14(b: jax.Array) -> jax.Array:
    """int32 E4M3 bit patterns (0..255) -> float32 value * 2^14 (the factor the E2M1 decode left out).

    Normal (exponent field e >= 1): (b & 0x7F) << 20 puts e and the 3 mantissa bits into float32's exponent and
    top mantissa bits; adding (127 - 7 + 14) << 23 rebiases the exponent and multiplies by 2^14. Subnormal
    (e = 0): m * 2^-9 * 2^14 = 32 m. 0x7F / 0xFF are NaN, as float8_e4m3fn.
    """
    mag = b & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + ((127 - 7 + 14) << 23), jnp.float32)
    sub = (mag & 0x7).astype(jnp.float32) * 32.0
    v = jnp.where(mag < 8, sub, normal)
    v = jnp.where(mag == 0x7F, jnp.float32(jnp.nan), v)
    return jnp.where(b >= 0x80, -v, v)


# -- the kernel --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one launch (derived from the problem and the Tiles)."""

    m: int
    n: int
    k: int
    bm: int
    bn: int
    bk: int
    per: int  # K tiles per program
    split: int
    mask_m: bool  # some x tile has rows past M
    mask_n: bool  # some weight tile has rows past N
    mask_k: bool  # some K tile runs past K (ragged K, or a split that does not divide the K tiles)
    scale_bits: bool  # block scales arrive as E4M3 bits (uint8), else float32
    dot_dtype: jnp.dtype
    num_warps: int
    num_stages: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return -(-self.n // self.bn), -(-self.m // self.bm), self.split


def make_plan(m: int, n: int, k: int, x_dtype, scale_dtype, tiles: Tiles | None) -> _Plan:
    t = tiles or choose_tiles(m, n, k, x_dtype=x_dtype)
    bn = min(t.block_n, _pow2_at_least(n, 16))
    bk = min(t.block_k, _pow2_at_least(k, 32))
    bm = _block_m(m)
    k_tiles = -(-k // bk)
    per = -(-k_tiles // t.split_k)
    split = -(-k_tiles // per)  # no empty splits
    x_dtype = jnp.dtype(x_dtype)
    # bf16 / f16 activations use the 16-bit tensor cores (the decoded weight is exact in both); anything else f32.
    dot_dtype = x_dtype if x_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)
    return _Plan(m=m, n=n, k=k, bm=bm, bn=bn, bk=bk, per=per, split=split, mask_m=m % bm != 0,
                 mask_n=n % bn != 0, mask_k=split * per * bk != k, scale_bits=jnp.dtype(scale_dtype) != jnp.float32,
                 dot_dtype=dot_dtype, num_warps=t.num_warps, num_stages=t.num_stages)


def _kernel(x_ref, packed_ref, scale_ref, s2_ref, out_ref, *, p: _Plan):
    i_n, i_m, i_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk, gk = p.bk // 2, p.bk // BLOCK_SIZE  # packed bytes and scale groups per weight-tile row
    m0, n0 = i_m * p.bm, i_n * p.bn
    m_ok = (m0 + jnp.arange(p.bm, dtype=jnp.int32) < p.m)[:, None]  # [BM, 1]
    n_ok = (n0 + jnp.arange(p.bn, dtype=jnp.int32) < p.n)[:, None]  # [BN, 1]
    dims = (((1,), (1,)), ((), ()))  # contract the K axes: x [BM, HK] . w [BN, HK] -> [BM, BN]
    precision = jax.lax.Precision.HIGHEST if p.dot_dtype == jnp.float32 else None  # f32: IEEE, not TF32

    def masked(ref, ok_rows, mask_rows, width, k_limit, k_start):
        """Load ref[rows, k_start:k_start+width] with the masks this plan needs (None when none can fail)."""
        mask = None
        if mask_rows:
            mask = ok_rows
        if p.mask_k:
            ok_k = (k_start + jnp.arange(width, dtype=jnp.int32) < k_limit)[None, :]
            mask = ok_k if mask is None else mask & ok_k
        if mask is not None:
            mask = jnp.broadcast_to(mask, (ok_rows.shape[0], width))
        return plgpu.load(ref, mask=mask, other=None if mask is None else 0)

    def tile(t, acc):
        kt = i_s * p.per + t  # global K tile
        k0 = kt * p.bk
        x = masked(x_ref.at[pl.ds(m0, p.bm), pl.ds(k0, p.bk)], m_ok, p.mask_m, p.bk, p.k, k0)  # [BM, BK]
        codes = masked(packed_ref.at[pl.ds(n0, p.bn), pl.ds(kt * hk, hk)], n_ok, p.mask_n, hk, p.k // 2, kt * hk)
        s = masked(scale_ref.at[pl.ds(n0, p.bn), pl.ds(kt * gk, gk)], n_ok, p.mask_n, gk, p.k // BLOCK_SIZE, kt * gk)
        # Masked bytes read as 0: code 0 (value 0) times scale 0, so padding contributes exact zeros.
        s = e4m3_times_2p14(s.astype(jnp.int32)) if p.scale_bits else s.astype(jnp.float32) * jnp.float32(2.0**14)
        lo, hi = e2m1_pair_times_2m14(codes.astype(jnp.int32))  # [BN, HK] each
        s = s[:, :, None]  # [BN, GK, 1]: one scale per 8 bytes = 16 elements
        w_lo = (lo.reshape(p.bn, gk, 8) * s).reshape(p.bn, hk).astype(p.dot_dtype)  # even elements
        w_hi = (hi.reshape(p.bn, gk, 8) * s).reshape(p.bn, hk).astype(p.dot_dtype)  # odd elements
        xe, xo = jax.lax.unstack(x.astype(p.dot_dtype).reshape(p.bm, hk, 2), axis=2)  # [BM, HK] each (tt.split)
        acc = acc + jax.lax.dot_general(xe, w_lo, dims, precision=precision, preferred_element_type=jnp.float32)
        return acc + jax.lax.dot_general(xo, w_hi, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, p.per, tile, jnp.zeros((p.bm, p.bn), jnp.float32))
    val = (acc * s2_ref[0]).astype(out_ref.dtype)
    dest = out_ref.at[pl.ds(m0, p.bm), pl.ds(n0, p.bn)] if p.split == 1 else \
        out_ref.at[i_s, pl.ds(m0, p.bm), pl.ds(n0, p.bn)]
    mask = None
    if p.mask_m or p.mask_n:
        mask = m_ok & (n0 + jnp.arange(p.bn, dtype=jnp.int32) < p.n)[None, :]
    plgpu.store(dest, val, mask=mask)  # a plain store (`ref[...] = v` would also load the old tile)


def _launch(x2: jax.Array, packed: jax.Array, block_scale: jax.Array, global_scale: jax.Array, *, n: int, k: int,
            tiles: Tiles | None, interpret: bool) -> jax.Array:
    """The pallas_call: x2 [M, K] -> [M, N] in x2.dtype (split_k == 1) or f32 partial sums [split, M, N]."""
    m = x2.shape[0]
    if block_scale.dtype not in (jnp.float32, jnp.float8_e4m3fn):
        raise TypeError(f"NVFP4 block scales must be float8_e4m3fn or float32, got {block_scale.dtype}")
    p = make_plan(m, n, k, x2.dtype, block_scale.dtype, tiles)
    if p.scale_bits:
        block_scale = jax.lax.bitcast_convert_type(block_scale, jnp.uint8)  # free; decoded from bits in-kernel
    out_shape = (m, n) if p.split == 1 else (p.split, m, n)
    whole = pl.no_block_spec  # whole arrays: the kernel indexes and masks its tiles itself
    return pl.pallas_call(
        functools.partial(_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct(out_shape, x2.dtype if p.split == 1 else jnp.float32),
        grid=p.grid,
        in_specs=[whole, whole, whole, whole],
        out_specs=whole,
        compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
        interpret=interpret,
        debug=execution.current().pallas_debug,  # prints the kernel jaxpr and the Triton IR (tests read it)
        name="nvfp4_matmul",
    )(x2, packed, block_scale, global_scale.astype(jnp.float32).reshape(1))


def _forward(x2, packed, block_scale, global_scale, *, n, k, tiles, interpret):
    """x2 [M, K] -> [M, N] in x2.dtype."""
    out = _launch(x2, packed, block_scale, global_scale, n=n, k=k, tiles=tiles, interpret=interpret)
    return out if out.ndim == 2 else out.sum(axis=0).astype(x2.dtype)  # fixed-order sum of the K splits


def _portable(x2, packed, block_scale, global_scale, *, n, k):
    w = dequantize(NVFP4Array(packed=packed, block_scale=block_scale, global_scale=global_scale, shape=(n, k)),
                   jnp.float32)
    return jax.lax.dot_general(x2.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST).astype(x2.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def _matmul(x2, packed, block_scale, global_scale, n, k, tiles, interpret):
    return _forward(x2, packed, block_scale, global_scale, n=n, k=k, tiles=tiles, interpret=interpret)


@_matmul.defjvp
def _matmul_jvp(n, k, tiles, interpret, primals, tangents):
    # Forward value from the kernel; the tangent (linear in x, block_scale, global_scale) from the portable
    # formula, so reverse mode (audit_scales) works. Never on the decode path.
    y = _matmul(*primals, n, k, tiles, interpret)
    _, ty = jax.jvp(functools.partial(_portable, n=n, k=k), primals, tangents)
    return y, ty


def dequant_matmul(x: jax.Array, w: NVFP4Array) -> jax.Array:
    """x [..., K] @ dequant(w).T -> [..., N] in x.dtype with the library GEMM: the weight dequantized once to x's
    dtype without its tensor scale (exact, see `dequantize_unscaled`), f32 accumulation, the tensor scale applied to
    the f32 result (as the kernel's epilogue does), one rounding to x's dtype at the end."""
    wb = dequantize_unscaled(w, x.dtype)  # [N, K]
    y = jax.lax.dot_general(x, wb, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * jnp.asarray(w.global_scale, jnp.float32)).astype(x.dtype)


def nvfp4_matmul(x: jax.Array, w: NVFP4Array, *, tiles: Tiles | None = None, interpret: bool | None = None,
                 gemm_min_rows: int | None = GEMM_MIN_ROWS) -> jax.Array:
    """x [..., K] @ dequant(w).T -> [..., N] in x.dtype, w an NVFP4Array [N, K] (W4A16: x is not quantized).

    interpret: None = the execution context's `pallas_interpret`, by default the Triton kernel on a GPU and the Pallas
    interpreter elsewhere. tiles: None = choose_tiles(M, N, K, x_dtype=x.dtype). gemm_min_rows: from this many rows
    of x on, `dequant_matmul` instead of the kernel (None: always the kernel).
    """
    if not isinstance(w, NVFP4Array) or len(w.shape) != 2:
        raise TypeError(f"nvfp4_matmul needs a 2-D NVFP4Array weight, got {type(w).__name__} "
                        f"{getattr(w, 'shape', '')}")
    n, k = w.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"NVFP4 weight: in features {k} (shape {w.shape}) is not a multiple of {BLOCK_SIZE}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"nvfp4_matmul: x shape {tuple(x.shape)} does not match weight shape {w.shape}")
    if tuple(w.packed.shape) != (n, k // 2) or tuple(w.block_scale.shape) != (n, k // BLOCK_SIZE):
        raise ValueError(f"NVFP4 weight {w.shape}: packed {tuple(w.packed.shape)} / block_scale "
                         f"{tuple(w.block_scale.shape)} should be {(n, k // 2)} / {(n, k // BLOCK_SIZE)}")
    if interpret is None:
        interpret = execution.current().pallas_interpret
        interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)  # [M, K]: a free reshape
    if x2.shape[0] == 0:
        return jnp.zeros(lead + (n,), x.dtype)
    if gemm_min_rows is not None and x2.shape[0] >= gemm_min_rows:
        return dequant_matmul(x, w)
    y = _matmul(x2, w.packed, w.block_scale, jnp.asarray(w.global_scale, jnp.float32), n, k, tiles, bool(interpret))
    return y.reshape(lead + (n,))
