"""The SmolLM2 drafter's experiments in one file: held-out tau at D 3 and D 7 against training CPU time and answer
tokens, from the trainer's reports (`<out>/train_report.json`, and the long run's `report_<step>.json` per chunk),
written to checkpoints/smollm2/drafter_curve.json, which the training notebook plots; and the held-out measure itself
for any drafter folder, dense and NVFP4.

    python -m dflash_jax.train.tau_curve measure checkpoints/smollm2/drafter [--nvfp4] [--out FILE]
    python -m dflash_jax.train.tau_curve collect --variant base=.train/exp/base_out ... \\
        --long LEG1_WORK_DIR [LEG2_WORK_DIR ...] [--branch NAME=WORK_DIR ...] --baseline BASELINE.json \\
        --out checkpoints/smollm2/drafter_curve.json

Held-out tau is the trainer's: the 8 requests `chat_prompt_ids(tok, 8, split="eval", seed=1)`, greedy, 256 new
tokens, stopping at the answers' EOS, the float32 target, the drafter's own draft vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.shipped import smollm2_path
from dflash_jax.quant.quantize import quantize_nvfp4
from dflash_jax.train.drafter import measure_tau
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.train.loop import load_training_tokenizer

KEYS = ("step", "cpu_s", "data_answer_tokens", "answer_tokens_seen", "train_loss", "train_acc_slot1",
        "heldout_tau_D3", "heldout_tau", "layers", "block_size", "init", "kl_weight", "loss_vocab")


def measure(folder, *, nvfp4: bool = False, lengths=(3, 7), prompts: int = 8, new_tokens: int = 256) -> dict:
    """Held-out tau of the drafter in `folder` (for the packaged SmolLM2 target) at each draft length."""
    gguf = smollm2_path()
    tok = load_training_tokenizer(gguf)
    target = load_target(gguf, compute_dtype="float32", param_dtype="float32")
    drafter = load_drafter(folder, compute_dtype="float32")
    if nvfp4:
        drafter = quantize_nvfp4(drafter)
    ids = chat_prompt_ids(tok, prompts, split="eval", seed=1)
    out = {"drafter": str(folder), "nvfp4": nvfp4, "draft_vocab": drafter.config.drafted_vocab}
    for d in lengths:
        m = measure_tau(target, drafter, ids, max_new_tokens=new_tokens, draft_length=d, eos_ids=(tok.eos_id,))
        out[f"tau_D{d}"] = round(m["tau"], 4)
        out[f"position_acceptance_D{d}"] = m["position_acceptance"]
    return out


def row(report: dict, name: str) -> dict:
    r = {"name": name, **{k: report.get(k) for k in KEYS}}
    r["cpu_min"] = round(report["cpu_s"] / 60, 2) if report.get("cpu_s") is not None else None
    r["tau_D7"], r["tau_D3"] = r.pop("heldout_tau"), r.pop("heldout_tau_D3")
    return r


def _out_file(path, name: str) -> Path:
    """--out: a JSON file, or a folder to write `name` into."""
    path = Path(path)
    return path / name if path.is_dir() else path


def _variant_name(path: str) -> str:
    """A variant given as a bare path is named after it: its folder, or its report file without `_report`."""
    p = Path(path)
    return p.stem.removesuffix("_report") if p.suffix == ".json" else p.name


def _report_file(path) -> Path:
    """A trainer's report: `<out>/train_report.json`, or a report file kept elsewhere (checkpoints/.../experiments)."""
    path = Path(path)
    return path if path.suffix == ".json" else path / "train_report.json"


def _offset_reports(run_dir, offset: dict) -> list[dict]:
    """A run's `report_<step>.json` files in step order, each's step, CPU time and tokens read moved on by `offset`
    (where the run started in the long run's count)."""
    reports = []
    for p in sorted(Path(run_dir).glob("report_*.json"), key=lambda p: int(p.stem.split("_")[1])):
        report = json.loads(p.read_text())
        report.update({k: report[k] + base for k, base in offset.items() if report.get(k) is not None})
        reports.append(report)
    return reports


def collect(variants: dict[str, Path], long_dir, baseline: dict | None, branches: dict | None = None,
            branch_after: int | None = None) -> dict:
    """The curve file's contents. long_dir: the long run's work dir, or its legs' work dirs in order. branches:
    {name: work dir} of runs that continue from the end of leg `branch_after` (default: the leg before the last)
    instead of the last leg (another recipe at the same point, e.g. the drafter grown to 2 layers), offset alike."""
    out = {"heldout": "8 eval-split chat requests (seed 1), greedy, 256 new tokens, answers' EOS, float32 target",
           "variants": [row(json.loads(_report_file(p).read_text()), n) for n, p in variants.items()],
           "long": []}
    # Legs of one long run (each leg --init-from the previous leg's result, its own schedule and work dir): a leg's
    # steps, CPU time and tokens read continue from where the previous leg ended.
    legs = [] if long_dir is None else [long_dir] if isinstance(long_dir, (str, Path)) else list(long_dir)
    offset = {"step": 0, "cpu_s": 0.0, "answer_tokens_seen": 0}
    ends = []  # ends[i]: the offsets when leg i + 1 starts (the end of leg i)
    for leg, leg_dir in enumerate(legs):
        rows = [{**row(r, f"long@{r['step']}"), "leg": leg + 1} for r in _offset_reports(leg_dir, offset)]
        out["long"] += rows
        ends.append(dict(offset))
        if rows:
            offset = {k: rows[-1][k] or 0 for k in offset}
    if branches:
        after = len(legs) - 1 if branch_after is None else branch_after
        if not 0 <= after <= len(legs):
            raise ValueError(f"--branch-after {after}: the long run has legs 1..{len(legs)} (0 = before the first)")
        start = ends[after] if after < len(ends) else offset  # the offsets at the end of leg `after`
        out["branches"] = []
        for name, branch_dir in branches.items():
            out["branches"] += [{**row(r, f"{name}@{r['step'] - start['step']}"), "branch": name, "after_leg": after}
                                for r in _offset_reports(branch_dir, start)]
    if baseline is not None:
        out["baseline"] = baseline
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.train.tau_curve", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="held-out tau of a drafter folder at D 3 and D 7")
    m.add_argument("folder", help="a drafter folder for the SmolLM2 target")
    m.add_argument("--nvfp4", action="store_true", help="quantize it first (dflash_jax.quantize_nvfp4)")
    m.add_argument("--prompts", type=int, default=8, help="held-out requests (default 8, the trainer's)")
    m.add_argument("--new-tokens", type=int, default=256, help="new tokens per request (default 256, the trainer's)")
    m.add_argument("--out", default=None, help="also write the result (JSON) here")
    c = sub.add_parser("collect", help="the experiments' reports -> one JSON file")
    c.add_argument("--variant", action="append", default=[],
                   help="[NAME=]OUT_DIR (its train_report.json) or [NAME=]REPORT.json (named after the path when "
                        "NAME= is left out)")
    c.add_argument("--long", nargs="+", default=None,
                   help="the long run's work dir (its report_<step>.json files), or its legs' work dirs in order")
    c.add_argument("--branch", action="append", default=[],
                   help="NAME=WORK_DIR: a run (its report_<step>.json files) that continues from the end of leg "
                        "--branch-after instead of the last leg")
    c.add_argument("--branch-after", type=int, default=None,
                   help="the leg the branches continue (default: the one before the last --long leg)")
    c.add_argument("--baseline", default=None, help="a `measure` result (JSON) of the drafter it started from")
    c.add_argument("--out", required=True, help="the JSON file to write (or a folder: drafter_curve.json in it)")
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        res = measure(args.folder, nvfp4=args.nvfp4, prompts=args.prompts, new_tokens=args.new_tokens)
        print(json.dumps(res, indent=1))
        if args.out:
            _out_file(args.out, "drafter_tau.json").write_text(json.dumps(res, indent=1) + "\n")
        return 0
    variants = dict(v.split("=", 1) if "=" in v else (_variant_name(v), v) for v in args.variant)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    branches = dict(b.split("=", 1) for b in args.branch)
    try:
        res = collect(variants, [Path(d) for d in args.long] if args.long else None, baseline, branches,
                      args.branch_after)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    out = _out_file(args.out, "drafter_curve.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{out}: {len(res['variants'])} variants, {len(res['long'])} long-run points, "
          f"{len(res.get('branches', []))} branch points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
