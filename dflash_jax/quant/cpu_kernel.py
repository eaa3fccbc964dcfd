"""The CPU matmul kernel (`cpu_matmul.cc`, an XLA FFI custom call): built from this package's own source on first
use, cached, registered with XLA once per process.

Build: the C++ compiler (`$CXX`, else g++ / c++) with `-O3 -march=native` against the XLA FFI headers that jaxlib
ships (`jax.ffi.include_dir()`), into `$DFLASH_JAX_KERNEL_CACHE` (default `~/.cache/dflash_jax/kernels`), named by a
hash of the source, the flags, the compiler, jaxlib's version and this CPU's feature flags, so a changed source or
machine builds anew and concurrent processes never read a half-written library (write, then rename). Where no
compiler is found or the build fails, `available()` is False with the reason in `unavailable_reason()`, and callers
fall back to XLA's own dot (slower, same values up to summation order). `DFLASH_JAX_CPU_KERNEL=0` switches it off.

`matmul_many` is the only entry point, and `quant/linear.py` its only caller: x [..., K] (any float dtype; computed
in float32) times one or several weights sharing x (q / k / v, gate / up), each given as its raw arrays and a format
code, -> float32 [..., n_rows] per weight, in one call. Its derivative is the
plain XLA product with the dequantized weight (`dequantized`), so gradients and transposes work like a dense dot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
# what the build reads: the kernel, the vector code of its three builds and the Q8 dot (a change to any one rebuilds)
SOURCES = (SOURCE, *sorted(Path(__file__).parent.glob("cpu_*.h")))
ENV_SWITCH = "DFLASH_JAX_CPU_KERNEL"
ENV_CACHE = "DFLASH_JAX_KERNEL_CACHE"
TARGET_NAME = "dflash_block_matmul"
ATTENTION_TARGET = "dflash_row_attention"
ARGMAX_TARGET = "dflash_first_argmax"
SAMPLE_TARGET = "dflash_sample_rows"
LOGSUMEXP_TARGET = "dflash_row_logsumexp"
RESIDUAL_TARGET = "dflash_residual_rows"
SOFTMAX_DRAW_TARGET = "dflash_softmax_draw"
TOP_K_TARGET = "dflash_top_k"
# every custom-call target the library registers, with its handler symbol: what `_load` registers and what an export
# may hold (`bench.lowering`)
FFI_TARGETS = {TARGET_NAME: "DflashBlockMatmul", ATTENTION_TARGET: "DflashRowAttention",
               ARGMAX_TARGET: "DflashFirstArgmax", SAMPLE_TARGET: "DflashSampleRows",
               LOGSUMEXP_TARGET: "DflashRowLogsumexp", RESIDUAL_TARGET: "DflashResidualRows",
               SOFTMAX_DRAW_TARGET: "DflashSoftmaxDraw", TOP_K_TARGET: "DflashTopK"}
# -ffp-contract=off: g++ fuses a * b + c into one FMA wherever the target has FMA (even with -std=c++17), so without it
# the AVX2 / AVX-512 builds rounded the row attention's sums differently from the portable one (no FMA there); every
# FMA the kernel means to run is an explicit intrinsic or std::fma.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-fno-math-errno")
# Which of the kernel's builds to compile: the best this CPU runs (AVX-512, else AVX2 + FMA + F16C, else portable
# C++), or a lower one on purpose (the tests build each and compare them value for value).
ENV_ISA = "DFLASH_JAX_KERNEL_ISA"
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}
# "q4_1_q8" / "q8_0_q8": GGML weights times x rounded to Q8 blocks (llama.cpp's integer dot; cpu_q8_dot.h);
# "q4_1_bf16" / "q8_0_bf16": GGML weights and x rounded to bfloat16, AVX512-BF16's dot product (cpu_bf16_dot.h)
FORMATS = {"float32": 0, "bfloat16": 1, "q4_1": 2, "q8_0": 3, "nvfp4": 4, "q4_1_q8": 5, "q8_0_q8": 6, "q4_1_bf16": 7,
           "q8_0_bf16": 8}

_state: dict = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpuinfo_line(keys: tuple[str, ...]) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of `keys` ("" where none does), None without the file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(keys)), "")
    except OSError:
        return None


def _cpu_flags() -> str:
    line = _cpuinfo_line(("flags", "Features"))
    return platform.processor() if line is None else line


def _flags() -> tuple[str, ...]:
    isa = os.environ.get(ENV_ISA, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ENV_ISA}={isa!r}: expected one of {sorted(ISA_FLAGS)}")
    return FLAGS + ISA_FLAGS[isa]


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES), " ".join(_flags()).encode(), str(version).encode(),
                 jax.__version__.encode(),
                 jax.lib.__version__.encode() if hasattr(jax.lib, "__version__") else b"",
                 _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
    cache = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "dflash_jax" / "kernels")
    return cache / f"cpu_matmul-{key.hexdigest()[:16]}.so"


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *_flags(), f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"building the CPU kernel failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: a concurrent process sees no library or a whole one


def _load() -> None:
    """Build (if needed), load and register the kernel; records why not in _state["why"]."""
    if "ok" in _state:
        return
    _state["ok"], _state["why"] = False, None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _state["why"] = f"switched off by {ENV_SWITCH}=0"
        return
    cxx = _compiler()
    if cxx is None:
        _state["why"] = "no C++ compiler found ($CXX, g++, c++, clang++)"
        return
    try:
        path = _library_path(cxx)
        if not path.exists():
            _build(cxx, path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, symbol in FFI_TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # a broken toolchain must not break the package: XLA's dot still works
        _state["why"] = f"{type(e).__name__}: {e}"
        return
    lib.dflash_kernel_isa.restype = ctypes.c_char_p
    _state["ok"], _state["path"], _state["isa"] = True, path, lib.dflash_kernel_isa().decode()


def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed)."""
    _load()
    return _state["ok"]


def unavailable_reason() -> str | None:
    _load()
    return _state["why"]


def isa() -> str | None:
    """The build the kernel runs as: "avx512", "avx2" (+ FMA + F16C) or "portable" (C++ left to the compiler: ARM,
    older x86); None without the kernel. Values are the same in all three (tests/test_cpu_kernel.py), speed is not."""
    _load()
    return _state.get("isa")


def _cpu_vendor_family() -> tuple[str, int | None]:
    """/proc/cpuinfo's vendor_id and cpu family ("", None where it has none)."""
    vendor = (_cpuinfo_line(("vendor_id",)) or "").partition(":")[2].strip()
    family = (_cpuinfo_line(("cpu family",)) or "").partition(":")[2].strip()
    return vendor, int(family) if family.isdigit() else None


def avx512_on_256_bit_units() -> bool:
    """Whether this CPU runs each 512-bit operation as two 256-bit halves: AMD's fourth Zen generation (family 25,
    with AVX-512). There a float32 activation costs twice per row what it costs on full-width units (Zen 5, Intel),
    and Q8 activations decode ~1.3x faster; on Zen 5 they decode at the float32 speed (docs/cpu-step.md)."""
    vendor, family = _cpu_vendor_family()
    return isa() == "avx512" and vendor == "AuthenticAMD" and family == 25


def q8_has_vnni() -> bool:
    """Whether the AVX-512 build's Q8 products run on VNNI (`vpdpbusd`: a lane's 4 byte products in one instruction,
    the same sums): on such a CPU with 256-bit units (`avx512_on_256_bit_units`) Q8 activations decode faster than
    float32 ones even with AVX-512 (docs/cpu-step.md, "AVX-512 on 256-bit units")."""
    flags = _cpu_flags().split()
    return isa() == "avx512" and "avx512_vnni" in flags and "avx512vl" in flags


def bf16_products_native() -> bool:
    """Whether the running build's bfloat16 products (`cpu_bf16_dot.h`) run AVX512-BF16's `vdpbf16ps` (an AVX-512
    build on a CPU with AVX512-BF16: Zen 4 and 5, Sapphire Rapids); elsewhere they are emulated, the same values,
    slower than the float32 products."""
    return isa() == "avx512" and "avx512_bf16" in _cpu_flags().split()


def library_path() -> Path | None:
    _load()
    return _state.get("path")


def _require() -> None:
    """Raise, naming the reason, where the kernel is not built (every entry point below calls it first)."""
    if not available():
        raise RuntimeError(f"the CPU matmul kernel is not available: {unavailable_reason()}")


def _temperature(temperature) -> jax.Array:
    """A traced scalar temperature as the row kernels take it: float32 [1]."""
    return jnp.reshape(jnp.asarray(temperature, jnp.float32), (1,))


_NONE = np.zeros((1,), np.uint8)  # stands for an absent scale / mins operand
_ONE = np.ones((1,), np.float32)


def _call(x2: jax.Array, weights: tuple, fmts: tuple[int, ...], n_rows: tuple[int, ...]) -> tuple[jax.Array, ...]:
    outs = tuple(jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for n in n_rows)
    operands = []
    for codes, scale, mins, tensor_scale in weights:
        operands += [codes, _NONE if scale is None else scale, _NONE if mins is None else mins,
                     _ONE if tensor_scale is None else jnp.reshape(tensor_scale, (1,)).astype(jnp.float32)]
    return tuple(jax.ffi.ffi_call(TARGET_NAME, outs, vmap_method="sequential")(
        x2, *operands, formats=np.asarray(fmts, np.int64), n_rows=np.asarray(n_rows, np.int64)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _matmul(fmts: tuple[int, ...], n_rows: tuple[int, ...], dequantized: tuple[Callable, ...], x, weights):
    K = x.shape[-1]
    ys = _call(x.reshape(-1, K).astype(jnp.float32), weights, fmts, n_rows)
    return tuple(y.reshape(*x.shape[:-1], n) for y, n in zip(ys, n_rows))


@_matmul.defjvp
def _matmul_jvp(fmts, n_rows, dequantized, primals, tangents):
    # Each product is linear in x and in its weight's values: the tangent is the XLA product with the dequantized
    # weight, plus (dense formats) x times the weight's own tangent; quantized codes and scales carry none.
    x, weights = primals
    tx, tweights = tangents
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    out = []
    for fmt, n, dense, arrays, tarrays in zip(fmts, n_rows, dequantized, weights, tweights):
        t = jax.lax.dot_general(jnp.asarray(tx, jnp.float32), dense(*arrays), dims,
                                preferred_element_type=jnp.float32)
        tcodes = tarrays[0]
        if fmt in (FORMATS["float32"], FORMATS["bfloat16"]) and not isinstance(
                tcodes, jax.custom_derivatives.SymbolicZero):
            tw = jnp.asarray(tcodes, jnp.float32)[:n]
            t = t + jax.lax.dot_general(x.astype(jnp.float32), tw, dims, preferred_element_type=jnp.float32)
        out.append(t)
    return _matmul(fmts, n_rows, dequantized, *primals), tuple(out)


def matmul_many(x: jax.Array, weights: list[tuple]) -> tuple[jax.Array, ...]:
    """x [..., K] @ W_i[:n_i].T -> float32 [..., n_i] for each weight, in ONE kernel call; each weight given as
    (fmt (a FORMATS name), codes, scale, mins, tensor_scale, n_i, dequantized) with `dequantized(codes, scale, mins,
    tensor_scale)` -> float32 [n_i, K] (for derivatives only). Every output equals the call with that weight alone,
    bit for bit (a row's chain depends on nothing else in the call)."""
    _require()
    fmts = tuple(FORMATS[w[0]] for w in weights)
    n_rows = tuple(int(w[5]) for w in weights)
    return _matmul(fmts, n_rows, tuple(w[6] for w in weights), x, tuple(tuple(w[1:5]) for w in weights))


def attention_rows(qg: jax.Array, cached: tuple, fresh: tuple, scale: float) -> tuple[jax.Array, jax.Array]:
    """(l [B, nKV, G, T], o [B, nKV, G, T, hd]) float32: the softmax sum and the weighted values (not yet divided by
    l) of queries qg [B, T, nKV, G, hd] over two key sources, each (k, v, visible [B, T, n]): the cache (k, v
    [B, nKV, S, hd], head-major as the caches hold them), then this call's fresh keys (k, v [B, Tk, nKV, hd]). Every row's sums run over its visible keys in that order, in one pass
    (`cpu_attention.h`), so a row's values never depend on the other rows or on which source holds a key. No
    derivative (generation programs only)."""
    _require()
    B, T, nKV, G, hd = qg.shape
    outs = (jax.ShapeDtypeStruct((B, nKV, G, T), jnp.float32), jax.ShapeDtypeStruct((B, nKV, G, T, hd), jnp.float32))
    operands = [qg.astype(jnp.float32)]
    for k, v, vis in (cached, fresh):
        operands += [k.astype(jnp.float32), v.astype(jnp.float32), vis.astype(jnp.uint8)]
    return tuple(jax.ffi.ffi_call(ATTENTION_TARGET, outs, vmap_method="sequential")(*operands, scale=np.float32(scale)))


def sample_rows(x: jax.Array, u: jax.Array, temperature) -> jax.Array:
    """int32 [...]: the token each row of logits x [..., N] draws from softmax(x / temperature) for its uniform u
    [...] in (0, 1), by the inverse CDF in three passes over the row (`cpu_sample.h`): the first index whose
    cumulative mass reaches u x the total, as `decode.sampling._categorical` draws from `processed_probs` without
    top-k / top-p. temperature: a traced scalar > 0."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    t = _temperature(temperature)
    return jax.ffi.ffi_call(SAMPLE_TARGET, out, vmap_method="sequential")(
        x.astype(jnp.float32), jnp.reshape(u, x.shape[:-1]).astype(jnp.float32), t)


def row_logsumexp(x: jax.Array, temperature) -> jax.Array:
    """float32 [...]: log sum exp(x / temperature) of each row of x [..., N] (`cpu_sample.h`: the maximum, then one
    pass of exp in 16-lane blocks), -inf for a row of -inf; rejection sampling's p at an id is exp(x_id / T - this).
    temperature: a traced scalar > 0."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    t = _temperature(temperature)
    return jax.ffi.ffi_call(LOGSUMEXP_TARGET, out, vmap_method="sequential")(x.astype(jnp.float32), t)


def residual_draw(x: jax.Array, row: jax.Array, q: jax.Array, q_on: jax.Array, point: jax.Array, u: jax.Array,
                  temperature) -> jax.Array:
    """int32 [B]: the token each batch row draws where rejection sampling stops, from normalize(max(p - q, 0)), or
    from p where that is all zero (`decode.sampling.residual_probs`), by the inverse CDF with its uniform u [B]:
    p = softmax(x[b, row[b]] / temperature) over x [B, R, N]; q = q_on[b] x q[b] over the first nq ids (q [B, nq],
    nq <= N; zero past them) plus a point mass at point[b] (none where point[b] < 0). `cpu_sample.h`."""
    _require()
    B = x.shape[0]
    t = _temperature(temperature)
    return jax.ffi.ffi_call(RESIDUAL_TARGET, jax.ShapeDtypeStruct((B,), jnp.int32), vmap_method="sequential")(
        x.astype(jnp.float32), row.astype(jnp.int32), q.astype(jnp.float32), q_on.astype(jnp.float32),
        point.astype(jnp.int32), jnp.reshape(u, (B,)).astype(jnp.float32), t)


def softmax_draw(x: jax.Array, u: jax.Array, temperature) -> tuple[jax.Array, jax.Array]:
    """(probs float32 [..., N], tokens int32 [...]): softmax(x / temperature) of each row of x [..., N] and the token
    its uniform u [...] draws from it by the inverse CDF (`cpu_sample.h`; the draw as `sample_rows`): a drafter's q
    and its draft in one call. temperature: a traced scalar > 0."""
    _require()
    outs = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32))
    t = _temperature(temperature)
    return tuple(jax.ffi.ffi_call(SOFTMAX_DRAW_TARGET, outs, vmap_method="sequential")(
        x.astype(jnp.float32), jnp.reshape(u, x.shape[:-1]).astype(jnp.float32), t))


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values float32 [..., k], ids int32 [..., k]): each row's k largest of x [..., N], largest first, equal
    values in id order, as `lax.top_k` (a NaN ranks as -inf), in one pass over the row (`cpu_sample.h`)."""
    _require()
    shape = x.shape[:-1] + (k,)
    outs = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    return tuple(jax.ffi.ffi_call(TOP_K_TARGET, outs, vmap_method="sequential")(x.astype(jnp.float32)))


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of each row's maximum of x [..., N] (of the row's first NaN where it holds one),
    jnp.argmax's index, in one pass over the row (`cpu_argmax.h`); x is read as float32."""
    _require()
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return jax.ffi.ffi_call(ARGMAX_TARGET, out, vmap_method="sequential")(x.astype(jnp.float32))
