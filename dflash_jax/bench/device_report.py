"""One prepared device run: does NVFP4 pay on this GPU? Linear timings, decoding step costs, the embedded pair.

    python -m dflash_jax.bench.device_report --out DIR          # on a GPU, < 8 minutes (a budget guard skips the rest)
    python -m dflash_jax.bench.device_report --smoke --out DIR  # tiny shapes on CPU (the test suite runs this)
    dflash-jax bench --device-report [--smoke] [--out DIR]

The exact command for a later session with an H200 lent through the device tool (`run`), from the repository root:

    run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 -m dflash_jax.bench.device_report --out $OUT 2>&1 | tee $OUT/device_report.log",
        timeout_s=560)

then copy device_report.json and device_report.md from the returned files into reports/ and commit them (they carry
the date and the device name). The script writes both files after every section, so a run cut short still returns
what it measured.

What it does (each part is skipped, with the reason recorded, when a backend cannot run here or the time budget
is spent):
  0. the device (name, compute capability, multiprocessors), its datasheet HBM bandwidth (looked up by name) and a
     measured device-to-device copy bandwidth;
  1. correctness on the device: pallas NVFP4 vs a float64-exact reference, f32 and bf16 activations;
  2. `linear` at M = 1, 4, 16 on the Qwen3-8B shapes (out x in: 4096x4096, 12288x4096, 4096x12288, 1024x4096) for
     bf16 dense, portable NVFP4, pallas NVFP4 and native NVFP4: microseconds per call, weight bytes / time as a
     fraction of the HBM bandwidth, and the bf16 / pallas and portable / pallas time ratios. Weights rotate over
     copies larger than L2 and each timed program chains many calls, so neither the cache nor launch latency of a
     single call is what is measured;
  3. per-step costs (bench.step_costs: decode, verify, draft in ms; r = verify/decode, c = draft/decode) on a random
     Qwen3-8B-shaped bf16 target with fewer layers and a 5-layer DFlash drafter, dense vs NVFP4 (pallas and
     portable): the goal is c(NVFP4) <= 0.8 c(bf16);
  4. the embedded pair (checkpoints/, bf16): bench.compare AR vs DFlash with the dense and the NVFP4 drafter (tau,
     tokens/s, speedup, exact-match count);
  4b. the decode core (issue 26, part 1; `decode_core_section`): while loops and conditionals in the speculative
     program lowered for CUDA (greedy and sampled: one dynamic loop, the generation loop, and no conditional is
     the goal), compiled prefill temp memory (2k vs 8k tokens on a small shape; one Qwen3-8B layer at 32k), a verify
     step at 64 live tokens in 256- vs 16,384-slot caches (attention reads the whole bucket), and portable vs
     pallas NVFP4 in bf16 (both apply the tensor scale after the dot, so they should agree to bf16 rounding);
  4c. the embedded pair in bfloat16 compute: greedy speculative vs autoregressive over 32 prompts x 256 tokens
     (mismatch rate, first divergence) and the programs compiled for 20 prompt lengths over 1..1000 (prefill and
     loop apart);
  4d. a hybrid target (issue 25; `hybrid_section`): one Gated DeltaNet and one gated-attention layer at
     Qwen3.5-27B-like shapes, verify (with the exact recurrent-state rollback) vs decode step cost at D = 7 and 15,
     the DeltaNet state bytes per row, greedy speculative == autoregressive;
  5. last, a sweep of pallas tiles (M = 1 on every shape, M = 16 on 4096x4096; the best per shape, so that
     choose_tiles can be tuned).
Timings are medians of one run; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quant import pallas_nvfp4
from dflash_jax.quant.linear import linear, native_supported, pallas_supported, resolve_backend, set_default_backend
from dflash_jax.quant.nvfp4 import NVFP4Array, dequantize, quantize
from dflash_jax.bench import compile as compilebench
from dflash_jax.bench import speculative as bench
from dflash_jax.bench.lowering import loop_report, speculative_module
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decode import programs as G
from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.target import init_target
from dflash_jax.quant.quantize import quantize_nvfp4
from dflash_jax.train import corpus

QWEN3_8B_SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]  # [out, in]
SMOKE_SHAPES = [(100, 208)]  # ragged N and K: the masked paths
MS = (1, 4, 16)
VARIANTS = ("bf16 dense", "nvfp4 portable", "nvfp4 pallas", "nvfp4 native")

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


# -- the report object: written after every section -------------------------------------------------------------

class Report:
    def __init__(self, out: Path | None, budget_s: float, smoke: bool):
        self.t0 = time.perf_counter()
        self.out, self.budget_s = out, budget_s
        self.data: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                     "smoke": smoke, "budget_s": budget_s, "skipped": []}
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def skip(self, what: str, why: str):
        print(f"[skip] {what}: {why}", flush=True)
        self.data["skipped"].append({"what": what, "why": why})

    def section(self, name: str, value):
        self.data[name] = value
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        self.write()

    def write(self):
        if self.out is None:
            return
        (self.out / "device_report.json").write_text(json.dumps(self.data, indent=1, default=_json_default))
        (self.out / "device_report.md").write_text(markdown(self.data))


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


# -- 0. device ---------------------------------------------------------------------------------------------------

def device_info() -> dict:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    info = {"platform": d.platform, "device_kind": kind, "num_devices": jax.device_count(),
            "jax": jax.__version__, "python": platform.python_version(),
            "compute_capability": getattr(d, "compute_capability", None),
            "cores": getattr(d, "core_count", None), "peak_hbm_tbps": peak_hbm_tbps(kind) if d.platform == "gpu"
            else None, "auto_backend": resolve_backend(), "pallas_supported": pallas_supported(),
            "native_supported": native_supported()}
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    return info


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


# -- 3. step costs on a random Qwen3-8B-shaped target ------------------------------------------------------------

def _qwen3_8b_pair(target_layers: int, drafter_layers: int, smoke: bool):
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if smoke:
        cfg = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=target_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, param_dtype=dtype,
                          compute_dtype=dtype)
    else:  # Qwen3-8B shapes (36 layers in the real model)
        cfg = TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=target_layers, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, param_dtype=dtype, compute_dtype=dtype)
    taps = tuple(sorted({min(target_layers - 1, max(0, round(1 + i * (target_layers - 2) / 4))) for i in range(5)}))
    dcfg = DrafterConfig(cfg.replace(num_hidden_layers=drafter_layers), 16, cfg.vocab_size - 1, taps, target_layers)
    return init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))


def step_cost_section(report: Report, smoke: bool, target_layers: int) -> dict:
    t0 = time.perf_counter()
    target, dense = _qwen3_8b_pair(target_layers, 1 if smoke else 5, smoke)
    q = quantize_nvfp4(dense)
    jax.block_until_ready((target, dense, q))
    out = {"target_layers": target_layers, "drafter_layers": dense.config.model.num_hidden_layers,
           "target_layer_ids": list(dense.config.target_layer_ids),
           "hidden": target.config.hidden_size, "vocab": target.config.vocab_size,
           "dtype": target.config.compute_dtype, "setup_s": time.perf_counter() - t0, "drafters": {}}
    kw = dict(context_len=64 if smoke else 256, draft_length=15 if not smoke else 3, reps=3 if smoke else 20)
    # On CPU (smoke) pallas runs interpreted: it checks the path, not a speed.
    variants = [("dense", dense, None), ("nvfp4 pallas", q, "pallas"), ("nvfp4 portable", q, "portable")]
    for name, d, backend in variants:
        if report.left() < (5 if smoke else 60):
            report.skip(f"step costs {name}", "time budget nearly spent")
            continue
        try:
            _set_backend(backend)
            c = bench.step_costs(target, d, **kw)
            out["drafters"][name] = c
            print("  " + name + ": " + bench.format_step_costs(c).replace("\n", " | "), flush=True)
        except Exception as e:
            out["drafters"][name] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        finally:
            _set_backend(None)
        report.section("step_costs", out)
    dense_c = next((v.get("c") for k, v in out["drafters"].items() if "dense" in k), None)
    for name, v in out["drafters"].items():
        if dense_c and "c" in v and "dense" not in name:
            v["c_over_dense"] = v["c"] / dense_c
    report.section("step_costs", out)
    return out


# Qwen3.5-27B-like shapes for one layer of each kind (taken as: hidden 5120, MLP 17408, gated attention 24 q / 4 KV
# heads of 256 with a quarter rotated, DeltaNet 16 key / 48 value heads of 128, conv kernel 4, vocabulary 248,320).
QWEN3_5_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                   num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
HYBRID_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)


def _hybrid_pair(smoke: bool, dtype: str | None = None):
    """A random hybrid target with one Gated DeltaNet and one gated-attention layer, and a 1-layer DFlash drafter
    tapping both layers (dtype: float32 on CPU, bfloat16 on accelerators, unless given)."""
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    shape = HYBRID_SMOKE if smoke else QWEN3_5_27B
    cfg = TargetConfig(num_hidden_layers=2, model_type="qwen3_5", layer_types=("linear_attention", "full_attention"),
                      partial_rotary_factor=0.25, rope_theta=1e7, param_dtype=dtype, compute_dtype=dtype, **shape)
    heads = (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16) if smoke else
             dict(num_attention_heads=cfg.hidden_size // 128, num_key_value_heads=8, head_dim=128))
    dmodel = TargetConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=1, param_dtype=dtype,
                         compute_dtype=dtype, **heads)
    dcfg = DrafterConfig(dmodel, 8, cfg.vocab_size - 1, (0, 1), 2)
    return init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))


def hybrid_section(report: Report, smoke: bool) -> dict:
    """Issue 25 on the device: a hybrid target's verify (with the exact recurrent-state rollback) vs autoregressive
    step cost at D = 7 and 15, the DeltaNet state bytes per row, and greedy speculative == autoregressive."""
    t0 = time.perf_counter()
    target, drafter = _hybrid_pair(smoke)
    jax.block_until_ready((target, drafter))
    cfg = target.config
    out = {"shape": "smoke" if smoke else "Qwen3.5-27B-like, one layer of each kind", "hidden": cfg.hidden_size,
           "vocab": cfg.vocab_size, "dtype": cfg.compute_dtype, "setup_s": time.perf_counter() - t0, "steps": {}}
    for D in ((3,) if smoke else (7, 15)):
        if report.left() < (5 if smoke else 60):
            report.skip(f"hybrid step costs D={D}", "time budget nearly spent")
            continue
        c = bench.step_costs(target, drafter, context_len=64 if smoke else 256, draft_length=D, reps=3 if smoke else 20)
        out["steps"][f"D{D}"] = c
        print(f"  hybrid D={D}: " + bench.format_step_costs(c).replace("\n", " | ")
              + f" | DeltaNet state {c['state_bytes_per_row'] / 2 ** 20:.2f} MiB per row", flush=True)
        report.section("hybrid", out)
    if not smoke and report.left() > 60:  # the loop with rollback on the device (CPU: tests/test_hybrid.py)
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (37, 64)]
        sp = G.generate(target, drafter, prompts, max_new_tokens=64, eos_ids=())
        ar = G.generate_autoregressive(target, prompts, max_new_tokens=64, eos_ids=())
        out["greedy_identical_rows"] = sum(a == b for a, b in zip(sp.token_lists(), ar.token_lists()))
        out["rows"], out["tau"] = len(prompts), sp.tau
        print(f"  hybrid greedy speculative == autoregressive: {out['greedy_identical_rows']}/{len(prompts)} rows "
              f"(tau {sp.tau:.2f}, random drafter)", flush=True)
    report.section("hybrid", out)
    return out


def hybrid_exact_section(report: Report, smoke: bool) -> dict:
    """Greedy speculative == autoregressive on the hybrid target in float32 compute on the device. The bfloat16 check
    above may part at a near-tie (a random target's logits are nearly flat); float32 is where equality is promised,
    so a mismatch here is a bug, not a rounding (dots at full float32 precision, not a GPU's default TF32)."""
    target, drafter = _hybrid_pair(smoke, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, target.config.vocab_size, n)) for n in ((5, 9) if smoke else (37, 64))]
    new = 8 if smoke else 64
    with jax.default_matmul_precision("highest"):  # a GPU's default runs float32 dots in TF32
        sp = G.generate(target, drafter, prompts, max_new_tokens=new, eos_ids=())
        ar = G.generate_autoregressive(target, prompts, max_new_tokens=new, eos_ids=())
    out = {"dtype": "float32 (matmul precision highest)", "rows": len(prompts), "max_new_tokens": new, "tau": sp.tau,
           "greedy_identical_rows": sum(a == b for a, b in zip(sp.token_lists(), ar.token_lists()))}
    print(f"  hybrid float32 greedy speculative == autoregressive: {out['greedy_identical_rows']}/{len(prompts)} rows "
          f"(tau {sp.tau:.2f}, random drafter)", flush=True)
    report.section("hybrid_exact", out)
    return out


def _set_backend(backend: str | None):
    # generate's programs are keyed on the backend resolved per call, so setting the default is enough
    set_default_backend(backend)


# -- 4b. the decode core (issue 26, part 1) ---------------------------------------------------------------------

def _lowering_counts(smoke: bool) -> dict:
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
    dcfg = DrafterConfig(cfg.replace(num_hidden_layers=1), 4, 63, (0, 1), 2)
    target, drafter = init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))
    out = {}
    for name, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, top_k=5, top_p=0.9, p_min=0.05))):
        text = speculative_module(target, drafter, [list(range(1, 21))], chunk=8, max_new_tokens=16, **kw)
        out[name] = loop_report(text)
        print(f"  lowered for CUDA, {name}: {out[name]}", flush=True)
    return out


def _bf16_backend_agreement(smoke: bool) -> dict:
    n, k = SMOKE_SHAPES[0] if smoke else QWEN3_8B_SHAPES[0]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, k)), jnp.bfloat16)
    q = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.float32))
    ys = {b: np.asarray(jax.jit(lambda x, q, b=b: linear(x, q, backend=b))(x, q).astype(jnp.float32))
          for b in ("portable", "pallas")}
    rel = float(np.max(np.abs(ys["pallas"] - ys["portable"])) / np.max(np.abs(ys["portable"])))
    print(f"  bf16 {n}x{k}, M=4: max |pallas - portable| / max |portable| = {rel:.2e}", flush=True)
    return {"shape": [n, k], "m": 4, "max_rel_diff": rel}


def decode_core_section(report: Report, smoke: bool) -> dict:
    """Issue 26, part 1: no host round trip inside a step, bounded prefill memory, long-cache attention, NVFP4 bf16
    agreement. Each part records its own failure instead of losing the others."""
    out: dict[str, Any] = {}

    def part(name, fn):
        if report.left() < (5 if smoke else 30):
            report.skip(f"decode core {name}", "time budget nearly spent")
            return
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        report.section("decode_core", out)

    part("lowering", lambda: _lowering_counts(smoke))

    def prefill_memory():
        small = (512, 2048) if smoke else (2048, 8192)
        a, b = (compilebench.prefill_temp_bytes(compilebench.SMALL_PREFILL, n) for n in small)
        res = {"small_tokens": list(small), "small_bytes": [a, b], "ratio": b / a}
        if not smoke:
            res["qwen3_8b_layer_32k_bytes"] = compilebench.prefill_temp_bytes(compilebench.QWEN3_8B_LAYER, 32768)
        print(f"  prefill temp memory: {res}", flush=True)
        return res

    part("prefill_memory", prefill_memory)

    def long_cache():
        target, drafter = _qwen3_8b_pair(2, 1, smoke)
        lens = (32, 96) if smoke else (256, 16384)
        return compilebench.attention_section(target, drafter, live=8 if smoke else 64, cache_lens=lens,
                                              reps=2 if smoke else 10)

    part("long_cache_attention", long_cache)
    part("nvfp4_bf16_agreement", lambda: _bf16_backend_agreement(smoke))
    return out


# -- 4. the embedded pair ---------------------------------------------------------------------------------------

def embedded_section(report: Report, smoke: bool) -> dict:
    root = checkpoints_dir()
    # bfloat16 as on a GPU; the CPU smoke run too (the programs section below then reuses its compiled programs)
    dtype = "float32" if jax.default_backend() == "cpu" and not smoke else "bfloat16"
    target = load_target(root / "target", param_dtype=dtype, compute_dtype=dtype)
    drafter = load_drafter(root / "drafter", param_dtype=dtype, compute_dtype=dtype)
    tok = Tokenizer.from_file(root / "tokenizer.json")
    n_prompts, new = (1, 8) if smoke else (6, 128)
    prompts = [tok.encode(t) for t in corpus.held_out_prompts(n_prompts, seed=0)]
    q = quantize_nvfp4(drafter)
    _set_backend(None)
    res = bench.compare(target, drafter, prompts, max_new_tokens=new, eos_ids=(), drafters={"nvfp4": q})
    out = {"dtype": dtype, "prompts": n_prompts, "max_new_tokens": new, "nvfp4_backend": resolve_backend(),
           "ar_tokens_per_s": res["ar_tokens_per_s"]}
    for name in ("dflash", "nvfp4"):
        r = res[name]
        out[name] = {k: r[k] for k in ("tokens_per_s", "tau", "acceptance_rate", "speedup", "exact_match")}
        print(f"  embedded {name}: tau {r['tau']:.2f}, {r['tokens_per_s']:.1f} tok/s, speedup {r['speedup']:.2f}x, "
              f"exact {r['exact_match']}", flush=True)
    report.section("embedded", out)
    return out


# -- 4c. programs and bf16 exactness (issue 26, items 4 and 6) ------------------------------------------------------

def programs_section(report: Report, smoke: bool) -> dict:
    """The embedded pair in bfloat16 compute: greedy speculative vs autoregressive over 32 prompts x 256 tokens
    (mismatch rate, first divergence), and the programs compiled for prompt lengths spread over 1..1000 (prefill and
    loop counted apart: a new prompt bucket should compile prefill only)."""
    root = checkpoints_dir()
    target = load_target(root / "target", param_dtype="bfloat16", compute_dtype="bfloat16")
    drafter = load_drafter(root / "drafter", param_dtype="bfloat16", compute_dtype="bfloat16")
    tok = Tokenizer.from_file(root / "tokenizer.json")
    _set_backend(None)
    n_prompts, new = (2, 8) if smoke else (32, 256)
    prompts = [tok.encode(t) for t in corpus.held_out_prompts(n_prompts, seed=0)]
    ex = bench.bf16_exactness(target, drafter, prompts, max_new_tokens=new)
    print("  " + bench.format_bf16_exactness(ex), flush=True)
    n_lens, max_len = (3, 40) if smoke else (20, 1000)
    p0, l0 = G.TRACE_COUNTS["prefill"], G.TRACE_COUNTS["speculative"]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for n in np.linspace(1, max_len, n_lens).astype(int):
        bench.generate(target, drafter, [rng.integers(2, tok.vocab_size, int(n)).tolist()], max_new_tokens=8,
                       eos_ids=(), prefill_timing=bench.PREFILL_TIMING)
    counts = {"prompt_lengths": n_lens, "max_len": max_len, "prefill_programs": G.TRACE_COUNTS["prefill"] - p0,
              "loop_programs": G.TRACE_COUNTS["speculative"] - l0, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  {n_lens} prompt lengths over 1..{max_len}: {counts['loop_programs']} loop program(s), "
          f"{counts['prefill_programs']} prefill programs ({counts['seconds']} s)", flush=True)
    out = {"bf16_exactness": ex, "compiles": counts}
    report.section("programs", out)
    return out


# -- markdown ---------------------------------------------------------------------------------------------------

def markdown(d: dict) -> str:
    dev = d.get("device", {})
    lines = [f"# dflash-jax device report: {dev.get('device_kind', '?')}", "",
             f"Date {d['date']}; jax {dev.get('jax')}, jaxlib {dev.get('jaxlib')}, platform {dev.get('platform')}, "
             f"compute capability {dev.get('compute_capability')}, {dev.get('cores')} multiprocessors; "
             f"automatic NVFP4 backend: {dev.get('auto_backend')}; smoke: {d.get('smoke')}; "
             f"elapsed {d.get('elapsed_s')} s.", ""]
    if d.get("smoke") or dev.get("platform") != "gpu":
        lines += ["**Not a GPU measurement** (smoke / CPU run): timings below only show the script works.", ""]
    bw = d.get("copy_bandwidth")
    if bw:
        lines += [f"Measured copy bandwidth {bw['tbps']:.3f} TB/s (read + write); datasheet HBM "
                  f"{dev.get('peak_hbm_tbps')} TB/s.", ""]
    if d.get("correctness"):
        lines += ["## Correctness (pallas vs float64-exact reference)", "",
                  "| out x in | M | x | max rel err | ok |", "|---|---|---|---|---|"]
        lines += [f"| {r['shape'][0]}x{r['shape'][1]} | {r['m']} | {r['x_dtype']} | {r['max_rel_err']:.2e} | "
                  f"{r['ok']} |" for r in d["correctness"]]
        lines.append("")
    if d.get("linear"):
        lines += ["## linear: microseconds per call (weight TB/s, fraction of datasheet HBM)", "",
                  "| out x in | M | " + " | ".join(VARIANTS) + " | bf16 / pallas | portable / pallas |",
                  "|---|---|" + "---|" * (len(VARIANTS) + 2)]
        for r in d["linear"]:
            cells = []
            for v in VARIANTS:
                x = r.get(v, {})
                if "us" in x:
                    frac = f", {100 * x['frac_peak']:.0f}%" if "frac_peak" in x else ""
                    cells.append(f"{x['us']:.1f} ({x['tbps']:.2f} TB/s{frac})")
                else:
                    cells.append("n/a")
            ratio = lambda k: f"{r[k]:.2f}x" if k in r else "n/a"
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['m']} | " + " | ".join(cells)
                         + f" | {ratio('bf16_over_pallas')} | {ratio('portable_over_pallas')} |")
        notes = sorted({f"{v}: {r[v].get('note') or r[v].get('unavailable')}" for r in d["linear"] for v in VARIANTS
                        if isinstance(r.get(v), dict) and (r[v].get("note") or r[v].get("unavailable"))})
        lines += [""] + [f"- {n}" for n in notes] + [""]
    if d.get("tile_sweep"):
        lines += ["## pallas tile sweep (best per shape)", "", "| out x in | M | best tiles | us | default us |",
                  "|---|---|---|---|---|"]
        for r in d["tile_sweep"]:
            b = r.get("best") or {}
            t = b.get("tiles", {})
            desc = (f"bn {t.get('block_n')} bk {t.get('block_k')} split {t.get('split_k')} warps {t.get('num_warps')}"
                    f" stages {t.get('num_stages')}") if t else "n/a"
            lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['m']} | {desc} | {b.get('us', float('nan')):.1f} |"
                         f" {r.get('default_us') or float('nan'):.1f} |")
        lines.append("")
    sc = d.get("step_costs")
    if sc:
        lines += [f"## Step costs: random target ({sc['target_layers']} layers, hidden {sc['hidden']}, vocab "
                  f"{sc['vocab']}, {sc['dtype']}), {sc['drafter_layers']}-layer drafter", "",
                  "| drafter | decode ms | verify ms | draft ms | r | c | c / dense c |",
                  "|---|---|---|---|---|---|---|"]
        for name, v in sc["drafters"].items():
            if "c" in v:
                lines.append(f"| {name} | {v['decode_ms']:.2f} | {v['verify_ms']:.2f} | {v['draft_ms']:.2f} | "
                             f"{v['r']:.2f} | {v['c']:.2f} | {v.get('c_over_dense', 1.0):.2f} |")
            else:
                lines.append(f"| {name} | n/a: {v.get('unavailable')} | | | | | |")
        lines.append("")
    em = d.get("embedded")
    if em:
        lines += [f"## Embedded pair ({em['dtype']}, {em['prompts']} prompts, {em['max_new_tokens']} new tokens, "
                  f"NVFP4 backend {em['nvfp4_backend']})", "",
                  f"AR {em['ar_tokens_per_s']:.1f} tok/s", "",
                  "| drafter | tok/s | tau | acceptance | speedup | exact |", "|---|---|---|---|---|---|"]
        for name in ("dflash", "nvfp4"):
            r = em[name]
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | {100 * r['acceptance_rate']:.1f}% | "
                         f"{r['speedup']:.2f}x | {r['exact_match']} |")
        lines.append("")
    dc = d.get("decode_core")
    if dc:
        lines += ["## Decode core (issue 26, part 1)", ""]
        for name, v in dc.items():
            lines.append(f"- {name}: " + json.dumps(v, default=_json_default))
        lines.append("")
    pr = d.get("programs")
    if pr:
        ex, c = pr["bf16_exactness"], pr["compiles"]
        lines += ["## Programs and bf16 exactness (embedded pair, bfloat16 compute)", "",
                  f"- {bench.format_bf16_exactness(ex)}",
                  f"- {c['prompt_lengths']} prompt lengths over 1..{c['max_len']}: {c['loop_programs']} loop "
                  f"program(s), {c['prefill_programs']} prefill programs", ""]
    if d.get("hybrid"):
        h = d["hybrid"]
        lines += [f"## Hybrid target ({h['shape']}, {h['dtype']})", ""]
        for name, c in h.get("steps", {}).items():
            lines.append(f"- {name}: decode {c['decode_ms']:.2f} ms, verify {c['verify_ms']:.2f} ms (with rollback), "
                         f"draft {c['draft_ms']:.2f} ms: r {c['r']:.2f}, c {c['c']:.2f}; DeltaNet state "
                         f"{c['state_bytes_per_row'] / 2 ** 20:.2f} MiB per row")
        if "greedy_identical_rows" in h:
            lines.append(f"- greedy speculative == autoregressive: {h['greedy_identical_rows']}/{h['rows']} rows")
        lines.append("")
    if d.get("hybrid_exact"):
        h = d["hybrid_exact"]
        lines += ["## Hybrid target, float32 compute", "",
                  f"- greedy speculative == autoregressive: {h['greedy_identical_rows']}/{h['rows']} rows "
                  f"({h['max_new_tokens']} new tokens, tau {h['tau']:.2f})", ""]
    if d.get("errors"):
        lines += ["## Errors", ""] + [f"- {e['section']}: {e['error']}" for e in d["errors"]] + [""]
    if d.get("skipped"):
        lines += ["## Skipped", ""] + [f"- {s['what']}: {s['why']}" for s in d["skipped"]] + [""]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------------------

SECTIONS = ("copy_bandwidth", "correctness", "linear", "step_costs", "decode_core", "embedded", "programs", "hybrid",
            "hybrid_exact", "tile_sweep")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.device_report", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for device_report.json and device_report.md")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU; checks the script, not a GPU)")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 420 s, smoke 300 s)")
    ap.add_argument("--target-layers", type=int, default=None, help="layers of the random target (default 4)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the pallas tile sweep")
    ap.add_argument("--no-embedded", action="store_true", help="skip the embedded pair")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to run (default: all): " + ", ".join(SECTIONS))
    args = ap.parse_args(argv)
    smoke = args.smoke
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not smoke:
        raise SystemExit("device_report: no GPU here (jax backend {!r}); run with --smoke to check the script on "
                         "CPU, or run it on a GPU".format(jax.default_backend()))
    report = Report(args.out, args.budget_s or (300.0 if smoke else 420.0), smoke)
    info = device_info()
    report.section("device", info)
    print(f"device_report: {info['device_kind']} ({info['platform']}), jax {info['jax']}, auto NVFP4 backend "
          f"{info['auto_backend']}, smoke={smoke}, budget {report.budget_s:.0f} s", flush=True)
    shapes = SMOKE_SHAPES if smoke else QWEN3_8B_SHAPES
    steps = [
        ("copy_bandwidth", lambda: report.section("copy_bandwidth", copy_bandwidth(smoke))),
        ("correctness", lambda: report.section("correctness", correctness(shapes, smoke))),
        ("linear", lambda: linear_timings(shapes, report, smoke, info["peak_hbm_tbps"])),
        ("step_costs", lambda: step_cost_section(report, smoke, args.target_layers or (2 if smoke else 4))),
        ("decode_core", lambda: decode_core_section(report, smoke)),
        ("embedded", lambda: embedded_section(report, smoke) if not args.no_embedded
         else report.skip("embedded pair", "--no-embedded")),
        ("programs", lambda: programs_section(report, smoke) if not args.no_embedded
         else report.skip("programs", "--no-embedded")),
        ("hybrid", lambda: hybrid_section(report, smoke)),
        ("hybrid_exact", lambda: hybrid_exact_section(report, smoke)),
        ("tile_sweep", lambda: tile_sweep(shapes, report, smoke) if not args.no_sweep
         else report.skip("tile sweep", "--no-sweep")),  # last: it only tunes, the rest answers the question
    ]
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    if only is not None and (unknown := only - set(SECTIONS)):
        raise SystemExit(f"device_report: unknown section(s) {sorted(unknown)}; the sections are "
                         + ", ".join(SECTIONS))
    assert [n for n, _ in steps] == list(SECTIONS)
    for name, step in steps:
        if only is not None and name not in only:
            continue
        if report.left() <= 0:
            report.skip(name, "time budget spent")
            continue
        print(f"== {name} (elapsed {report.elapsed():.0f} s)", flush=True)
        try:
            step()
        except Exception as e:  # one broken part must not lose the others
            traceback.print_exc()
            report.data.setdefault("errors", []).append({"section": name, "error": f"{type(e).__name__}: {e}"[:500]})
            report.write()
    report.data["elapsed_s"] = round(report.elapsed(), 1)
    report.write()
    print()
    print(markdown(report.data))
    return report.data


if __name__ == "__main__":
    main(sys.argv[1:])
