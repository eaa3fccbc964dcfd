"""One prepared device run: does NVFP4 pay on this GPU? Linear timings, decoding step costs, the embedded pair.

    python -m dflash_jax.bench.device_report --out reports/     # on a GPU, < 8 minutes (a budget guard skips the rest)
    python -m dflash_jax.bench.device_report --smoke --out DIR  # tiny shapes on CPU (the test suite runs this)
    python -m dflash_jax.device_report --out reports/           # the same, at its first documented path
    dflash-jax bench --device-report [--smoke] [--out DIR]

Run it from the repository root on the GPU host and commit device_report.json and device_report.md (they carry the
date and the device name) under reports/, with a line in reports/README.md (the first H200 run is there). The script
writes both files after every section, so a run cut short still returns what it measured.

What it does (each part is skipped, with the reason recorded, when a backend cannot run here or the time budget
is spent):
  0. the device (name, compute capability, multiprocessors), its datasheet HBM bandwidth (looked up by name) and a
     measured device-to-device copy bandwidth;
  1. correctness on the device: pallas NVFP4 vs a float64-exact reference, f32 and bf16 activations;
  2. `linear` at M = 1, 4, 16 on the Qwen3-8B shapes (out x in: 4096x4096, 12288x4096, 4096x12288, 1024x4096) for
     bf16 dense, portable NVFP4, pallas NVFP4 and native NVFP4: microseconds per call, weight bytes / time as a
     fraction of the HBM bandwidth, and the bf16 / pallas and portable / pallas time ratios (`device_linear`);
  3. per-step costs (step_costs: decode, verify, draft in ms; r = verify/decode, c = draft/decode) on a random
     Qwen3-8B-shaped bf16 target with fewer layers and a 5-layer DFlash drafter, dense vs NVFP4 (pallas and
     portable): the goal is c(NVFP4) <= 0.8 c(bf16) (`device_decoding`, as are 4-4d);
  4. the embedded pair (checkpoints/, bf16): bench.compare AR vs DFlash with the dense and the NVFP4 drafter (tau,
     tokens/s, speedup, exact-match count);
  4b. the decode core: while loops and conditionals in the speculative program lowered for CUDA (greedy and
     sampled: one dynamic loop, the generation loop, and no conditional is the goal: the device never waits on the
     host inside a step), compiled prefill temp memory (2k vs 8k tokens on a small shape; one Qwen3-8B layer at
     32k), a verify step at 64 live tokens in 256- vs 16,384-slot caches (attention reads the whole bucket), and
     portable vs pallas NVFP4 in bf16 (both apply the tensor scale after the dot, so they should agree to bf16
     rounding);
  4c. the embedded pair in bfloat16 compute: greedy speculative vs autoregressive over 32 prompts x 256 tokens
     (mismatch rate, first divergence) and the programs compiled for 20 prompt lengths over 1..1000 (prefill and
     loop apart);
  4d. a hybrid target (Gated DeltaNet layers, whose recurrent state speculative decoding must roll back exactly):
     one Gated DeltaNet and one gated-attention layer at Qwen3.5-27B-like shapes, verify (with the rollback) vs
     decode step cost at D = 7 and 15, the DeltaNet state bytes per row, greedy speculative == autoregressive, in
     bf16 and in float32 at full matmul precision;
  5. last, a sweep of pallas tiles (M = 1 on every shape, M = 16 on 4096x4096; the best per shape, so that
     choose_tiles can be tuned).
Timings are medians of one run; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import platform
import sys
import traceback
from pathlib import Path

import jax

from dflash_jax.bench.device_decoding import (decode_core_section, embedded_section, hybrid_exact_section,
                                              hybrid_section, programs_section, step_cost_section)
from dflash_jax.bench.device_linear import (MS, QWEN3_8B_SHAPES, SMOKE_SHAPES, copy_bandwidth, correctness,
                                            linear_timings, peak_hbm_tbps, tile_sweep)
from dflash_jax.bench.device_record import Report, markdown
from dflash_jax.quant.linear import native_supported, pallas_supported, resolve_backend


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


__all__ = ["main", "device_info", "SECTIONS", "SMOKE_SHAPES", "QWEN3_8B_SHAPES", "MS"]


if __name__ == "__main__":
    main(sys.argv[1:])
