"""The device report's NVFP4 `linear` sections: correctness against a float64-exact reference, microseconds per
call per backend at M = 1, 4, 16 on the Qwen3-8B shapes (weights rotating over copies larger than L2, many calls per
timed program, so neither the cache nor one call's launch latency is what is measured), the copy bandwidth they are
held against, and the pallas tile sweep."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.device_record import VARIANTS, Report
from dflash_jax.quant import pallas_nvfp4
from dflash_jax.quant.linear import linear, native_supported, resolve_backend
from dflash_jax.quant.nvfp4 import NVFP4Array, dequantize, quantize

QWEN3_8B_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]  # [out, in]
SMOKE_SHAPES = [(100, 208)]  # ragged N and K: the masked paths
MS = (1, 4, 16)

# Datasheet HBM bandwidth, TB/s, by a substring of jax's device_kind (most specific first).
PEAK_HBM_TBPS = [("GH200", 4.0), ("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35),
                 ("H800", 3.35), ("B200", 8.0), ("B100", 8.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
                 ("A100", 1.555), ("L40S", 0.864), ("L40", 0.864), ("L4", 0.3), ("RTX 5090", 1.792),
                 ("RTX 4090", 1.008), ("A10", 0.6)]


def peak_hbm_tbps(device_kind: str) -> float | None:
    for key, tbps in PEAK_HBM_TBPS:
        if key.lower() in device_kind.lower():
            return tbps
    return None


def weight_bytes(w) -> int:
    return w.nbytes if isinstance(w, NVFP4Array) else int(w.size) * w.dtype.itemsize


def _median_s(fn: Callable, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(smoke: bool) -> dict:
    n = (1 << 22) if smoke else (1 << 28)  # f32 elements: 16 MiB / 1 GiB
    x = jnp.arange(n, dtype=jnp.float32)
    f = jax.jit(lambda x: x + 1.0)  # reads and writes every byte once
    s = _median_s(f, (x,), 3 if smoke else 10)
    return {"bytes_moved": 8 * n, "seconds": s, "tbps": 8 * n / s / 1e12}


# -- 1. correctness on the device -------------------------------------------------------------------------------

def correctness(shapes, smoke: bool) -> list[dict]:
    rows = []
    for i, (n, k) in enumerate(shapes):
        q = quantize(jax.random.normal(jax.random.key(i), (n, k), jnp.float32) * 0.02)
        w64 = None
        for m in (1, 16):
            for dt in (jnp.float32, jnp.bfloat16):
                x = jax.random.normal(jax.random.key(100 + m), (m, k), jnp.float32).astype(dt)
                y = np.asarray(jax.jit(lambda x, q: linear(x, q, backend="pallas"))(x, q).astype(jnp.float32),
                               np.float64)
                if w64 is None:
                    w64 = np.asarray(dequantize(q), np.float64)
                want = np.asarray(x.astype(jnp.float32), np.float64) @ w64.T
                rel = float(np.abs(y - want).max() / np.abs(want).max())
                rows.append({"shape": [n, k], "m": m, "x_dtype": jnp.dtype(dt).name, "max_rel_err": rel,
                             "finite": bool(np.isfinite(y).all()),
                             "ok": bool(np.isfinite(y).all()) and rel <= (1e-5 if dt == jnp.float32 else 8e-3)})
                print(f"  correctness {n}x{k} M={m} {jnp.dtype(dt).name}: max rel err {rel:.2e}", flush=True)
    return rows


# -- 2. linear timings ------------------------------------------------------------------------------------------

def _copies(w, count: int):
    """`count` distinct device buffers holding w (rotating over them keeps the weights out of L2)."""
    return [jax.tree.map(lambda a: jnp.array(a, copy=True), w) for _ in range(count)]


def time_linear(apply: Callable, x, w, *, smoke: bool, rotate_bytes: int, target_s: float, reps: int) -> dict:
    """Microseconds per `apply(x, w)` call, weights rotating over copies that together exceed L2.

    One jitted program applies the linear to every copy (distinct buffers: nothing to merge, nothing cached);
    `programs` such programs are enqueued back to back and waited for once, so host dispatch overlaps the GPU
    and the per-program launch cost is spread over many calls. Median over `reps` of those batches.
    """
    wb = weight_bytes(w)
    copies = 1 if smoke else int(min(64, max(16, -(-rotate_bytes // wb))))
    ws = _copies(w, copies)
    run = jax.jit(lambda x, ws: [apply(x, v) for v in ws])
    t1 = _median_s(run, (x, ws), 2)  # compiles first
    programs = 1 if smoke else int(min(200, max(2, math.ceil(target_s / max(t1, 1e-6)))))

    def batch(x, ws):
        out = None
        for _ in range(programs):
            out = run(x, ws)
        return out

    s = _median_s(batch, (x, ws), reps)
    per_call = s / (programs * copies)
    del ws
    return {"us": 1e6 * per_call, "weight_bytes": wb, "tbps": wb / per_call / 1e12, "copies": copies,
            "programs": programs}


def linear_timings(shapes, report: Report, smoke: bool, peak: float | None) -> list[dict]:
    rows = []
    native_note = None
    if native_supported():
        cc = getattr(jax.devices()[0], "compute_capability", None)
        if cc is not None and float(cc) < 10.0:
            native_note = "XLA dequant+dot composite (no FP4 tensor cores below compute capability 10)"
    for i, (n, k) in enumerate(shapes):
        if report.left() < (5 if smoke else 60):
            report.skip(f"linear {n}x{k}", f"time budget ({report.budget_s:.0f} s) nearly spent")
            continue
        w32 = jax.random.normal(jax.random.key(10 + i), (n, k), jnp.float32) * 0.02
        weights = {"bf16 dense": w32.astype(jnp.bfloat16), "nvfp4": quantize(w32)}
        del w32
        for m in MS:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            row = {"shape": [n, k], "m": m}
            for v in VARIANTS:
                w = weights["bf16 dense"] if v == "bf16 dense" else weights["nvfp4"]
                backend = None if v == "bf16 dense" else v.split()[1]
                try:
                    if backend is not None:
                        resolve_backend(backend)  # refuses clearly where it cannot run
                    apply = (lambda x, w, b=backend: linear(x, w, backend=b))
                    r = time_linear(apply, x, w, smoke=smoke, rotate_bytes=256 << 20, target_s=0.02,
                                    reps=2 if smoke else 7)
                    if peak:
                        r["frac_peak"] = r["tbps"] / peak
                    if v == "nvfp4 native" and native_note:
                        r["note"] = native_note
                    if v == "nvfp4 pallas" and jax.default_backend() != "gpu":
                        r["note"] = "interpreted on CPU: not a GPU timing"
                    row[v] = r
                except Exception as e:  # a backend that cannot run here: recorded, not fatal
                    row[v] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            b, pal, por = (row.get(v, {}).get("us") for v in ("bf16 dense", "nvfp4 pallas", "nvfp4 portable"))
            if b and pal:
                row["bf16_over_pallas"] = b / pal
            if por and pal:
                row["portable_over_pallas"] = por / pal
            rows.append(row)
            print("  " + _linear_line(row), flush=True)
        report.section("linear", rows)
    return rows


def _linear_line(row: dict) -> str:
    cells = []
    for v in VARIANTS:
        r = row.get(v, {})
        cells.append(f"{v} {r['us']:.1f} us ({r['tbps']:.2f} TB/s)" if "us" in r else f"{v} n/a")
    extra = f" | bf16/pallas {row['bf16_over_pallas']:.2f}x" if "bf16_over_pallas" in row else ""
    return f"{row['shape'][0]}x{row['shape'][1]} M={row['m']}: " + "; ".join(cells) + extra


# -- 5. tile sweep ----------------------------------------------------------------------------------------------

SWEEP = [  # (block_n, block_k, split_k or None = choose_tiles' split for these tiles, warps, stages)
    (16, 512, None, 1, 3), (32, 256, None, 2, 3), (32, 512, None, 2, 3), (64, 256, 1, 4, 3), (64, 512, None, 4, 3),
    (64, 128, None, 4, 4), (64, 256, None, 4, 4), (64, 256, None, 8, 3), (128, 256, None, 8, 3), (128, 256, 1, 8, 3),
]


def tile_sweep(shapes, report: Report, smoke: bool) -> list[dict]:
    """The default tiles and SWEEP's alternatives, timed like `linear` (M = 1 on every shape, M = 16 on the
    first; smoke: two alternatives, interpreted: checks the code path only)."""
    rows = []
    sweep = SWEEP[:2] if smoke else SWEEP
    for i, (n, k) in enumerate(shapes):
        q = quantize(jax.random.normal(jax.random.key(20 + i), (n, k), jnp.float32) * 0.02)
        for m in ((1, 16) if i == 0 and not smoke else (1,)):
            if report.left() < (5 if smoke else 45):
                report.skip(f"tile sweep {n}x{k} M={m}", "time budget nearly spent")
                continue
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            default = pallas_nvfp4.choose_tiles(m, n, k)
            results = []
            for bn, bk, split, warps, stages in [(None,) * 5] + sweep:
                t = default if bn is None else pallas_nvfp4.choose_tiles(
                    m, n, k, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                if split is not None:
                    t = dataclasses.replace(t, split_k=split)
                try:
                    r = time_linear(lambda x, w, t=t: pallas_nvfp4.nvfp4_matmul(x, w, tiles=t), x, q, smoke=smoke,
                                    rotate_bytes=256 << 20, target_s=0.01, reps=2 if smoke else 5)
                    results.append({"tiles": dataclasses.asdict(t), "default": bn is None, "us": r["us"],
                                    "tbps": r["tbps"]})
                except Exception as e:
                    results.append({"tiles": dataclasses.asdict(t), "error": f"{type(e).__name__}: {e}"[:300]})
            ok = [r for r in results if "us" in r]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            rows.append({"shape": [n, k], "m": m, "results": results, "best": best,
                         "default_us": next((r["us"] for r in ok if r["default"]), None)})
            if best:
                print(f"  sweep {n}x{k} M={m}: best {best['tiles']} {best['us']:.1f} us "
                      f"({best['tbps']:.2f} TB/s); default {rows[-1]['default_us']}", flush=True)
            report.section("tile_sweep", rows)
    return rows


__all__ = ["QWEN3_8B_SHAPES", "SMOKE_SHAPES", "MS", "peak_hbm_tbps", "copy_bandwidth", "correctness", "time_linear",
           "linear_timings", "tile_sweep"]
