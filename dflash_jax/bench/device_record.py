"""The device report's record: the figures of every section as JSON (`device_report.json`) and as markdown tables
(`device_report.md`), both rewritten after every section, so a run cut short still returns what it measured."""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.bench.speculative import format_bf16_exactness

# The `linear` table's columns: the dense baseline and each NVFP4 backend.
VARIANTS = ("bf16 dense", "nvfp4 portable", "nvfp4 pallas", "nvfp4 native")


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
        lines += ["## Decode core (no host round trip inside a step, bounded prefill memory, long caches)", ""]
        for name, v in dc.items():
            lines.append(f"- {name}: " + json.dumps(v, default=_json_default))
        lines.append("")
    pr = d.get("programs")
    if pr:
        ex, c = pr["bf16_exactness"], pr["compiles"]
        lines += ["## Programs and bf16 exactness (embedded pair, bfloat16 compute)", "",
                  f"- {format_bf16_exactness(ex)}",
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


__all__ = ["Report", "markdown", "VARIANTS"]
