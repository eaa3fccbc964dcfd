"""Answer tokens/s (with features) of the refilling generator against the old path (`make_sequences` + a second
`target_features` pass), on the same prompts, in one process; then the refilling generator's steady-state rate per
batch size and K (decode steps per program call).

    python -m dflash_jax.train.datagen_bench --prompts 128 --rows 16 32 64 128 --steps 8 32

Compile time is measured apart (jax.monitoring) and taken out of the rates; the machine's load is printed with them
(a shared machine's figures are medians of noisy samples, not the hardware's rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from dflash_jax.train import datagen
from dflash_jax.train.drafter_data import chat_prompt_ids, make_sequences, target_features
from dflash_jax.train.refill import Job, RefillSettings, RefillStats, generate_answers, prompt_keys

_COMPILE = {"s": 0.0}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
        _COMPILE["s"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _timed(fn):
    """(fn(), wall seconds, compile seconds, this process's CPU seconds) of one call."""
    c0, t0, p0 = _COMPILE["s"], time.perf_counter(), time.process_time()
    out = fn()
    wall = time.perf_counter() - t0
    return out, wall, _COMPILE["s"] - c0, time.process_time() - p0


def old_path(target, prompts, taps, *, new_tokens: int, max_prompt: int, fraction: float, temp: float, eos: int,
             batch: int = 64) -> dict:
    """make_sequences (batch-64 generate_autoregressive calls) + target_features, as build_data runs them."""
    seq_len = max_prompt + new_tokens
    data, w1, c1, p1 = _timed(lambda: make_sequences(target, prompts, max_new_tokens=new_tokens, seq_len=seq_len,
                                                 sampled_fraction=fraction, temperature=temp, batch=batch,
                                                 eos_ids=(eos,)))
    width = len(taps) * target.config.hidden_size
    out = np.zeros(data["tokens"].shape + (width,), np.float16)
    _, w2, c2, p2 = _timed(lambda: target_features(target, data["tokens"], taps, out=out))
    new = data["lengths"] - data["prompt_lens"]
    # rows x steps of each batch-64 call: every row runs until the batch's longest answer ends
    spent = sum(len(new[i:i + batch]) * int(new[i:i + batch].max()) for i in range(0, len(new), batch))
    tokens = int(new.sum())
    return {"answer_tokens": tokens, "generate_s": round(w1, 1), "features_s": round(w2, 1),
            "compile_s": round(c1 + c2, 1), "tokens_per_s": round(tokens / (w1 + w2 - c1 - c2), 1),
            "tokens_per_s_with_compile": round(tokens / (w1 + w2), 1),
            "tokens_per_cpu_s_with_compile": round(tokens / (p1 + p2), 1),
            "finished_row_step_share": round(1 - tokens / spent, 4)}


def _jobs(prompts, fraction, temp, seed=0):
    keys = prompt_keys(seed, range(len(prompts)))
    return [Job(i, tuple(p), datagen.temperature_of(i, fraction, temp), keys[i]) for i, p in enumerate(prompts)]


def new_path(target, prompts, settings: RefillSettings, *, fraction: float, temp: float) -> dict:
    stats = RefillStats()
    answers, wall, comp, cpu = _timed(lambda: list(generate_answers(target, _jobs(prompts, fraction, temp), settings,
                                                               stats)))
    return {"rows": settings.rows, "steps": settings.steps, "answer_tokens": stats.answer_tokens,
            "wall_s": round(wall, 1), "compile_s": round(comp, 1),
            "tokens_per_s": round(stats.answer_tokens / (wall - comp), 1),
            "tokens_per_s_with_compile": round(stats.answer_tokens / wall, 1),
            "tokens_per_cpu_s_with_compile": round(stats.answer_tokens / cpu, 1),
            "live_row_share": round(stats.live_row_steps / max(stats.row_steps, 1), 4),
            "decode_calls": stats.decode_calls, "refill_calls": stats.refill_calls}


def steady_rate(target, prompts, settings: RefillSettings, *, fraction: float, temp: float, seconds: float,
                window: float) -> dict:
    """Answer tokens run per second over `seconds` after the first decode call (compiles taken out), in windows of
    `window` seconds: their median and range. The queue (prompts, cycled) never runs dry."""
    jobs = _jobs(prompts * 8, fraction, temp)
    stats = RefillStats()
    rates, cpu_rates, t_start, mark = [], [], None, None
    for _ in generate_answers(target, jobs, settings, stats):
        now = time.perf_counter()
        if t_start is None:
            t_start = mark = (now, stats.live_row_steps, _COMPILE["s"], time.process_time())
            continue
        t, n, c, p = mark
        if now - t >= window and _COMPILE["s"] == c:  # windows with a compile in them are left out
            rates.append((stats.live_row_steps - n) / (now - t))
            cpu_rates.append((stats.live_row_steps - n) / (time.process_time() - p))
        if now - t >= window:
            mark = (now, stats.live_row_steps, _COMPILE["s"], time.process_time())
        if now - t_start[0] >= seconds:
            break
    return {"rows": settings.rows, "steps": settings.steps, "windows": len(rates),
            "median_tokens_per_s": round(statistics.median(rates), 1) if rates else None,
            "min": round(min(rates), 1) if rates else None, "max": round(max(rates), 1) if rates else None,
            "median_tokens_per_cpu_s": round(statistics.median(cpu_rates), 1) if rates else None,
            "live_row_share": round(stats.live_row_steps / max(stats.row_steps, 1), 4)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.train.datagen_bench", description=__doc__)
    ap.add_argument("--prompts", type=int, default=128, help="prompts of the old-vs-new comparison")
    ap.add_argument("--no-old", action="store_true", help="skip the old path")
    ap.add_argument("--sweep-only", action="store_true", help="skip the old-vs-new comparison")
    ap.add_argument("--sweep-rows", type=int, nargs="*", default=[16, 32, 64, 128])
    ap.add_argument("--sweep-steps", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--sweep-seconds", type=float, default=90.0, help="steady-state seconds per sweep point")
    ap.add_argument("--window", type=float, default=15.0, help="seconds per rate sample in the sweep")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    datagen.add_recipe_arguments(ap)
    ap.set_defaults(prompt_seed=7)  # benchmark prompts: another draw than the production run's seed 0
    args = ap.parse_args(argv)
    target, drafter, tok = datagen.load_pair(args)
    taps = tuple(args.taps or drafter.config.target_layer_ids)
    prompts = chat_prompt_ids(tok, args.prompts, split=args.split, seed=args.prompt_seed,
                              max_prompt_tokens=args.max_prompt_tokens)
    settings = RefillSettings(layer_ids=taps, eos_ids=(tok.eos_id,), max_new_tokens=args.new_tokens,
                              max_prompt_tokens=args.max_prompt_tokens, rows=args.rows, steps=args.steps,
                              refill_min=args.refill_min)
    kw = dict(fraction=args.sampled_fraction, temp=args.sample_temperature)
    res = {"prompts": len(prompts), "new_tokens": args.new_tokens, "taps": taps, "cpus": os.cpu_count()}

    def show(name, r):
        res[name] = r
        print(f"[{time.strftime('%T')}, load {os.getloadavg()[0]:.1f}] {name}: {json.dumps(r)}", flush=True)

    if not args.sweep_only:
        show("new", new_path(target, prompts, settings, **kw))
    if not (args.no_old or args.sweep_only):
        show("old", old_path(target, prompts, taps, new_tokens=args.new_tokens, max_prompt=args.max_prompt_tokens,
                             eos=tok.eos_id, **kw))
    for rows in args.sweep_rows:
        for steps in args.sweep_steps:
            show(f"sweep_rows{rows}_K{steps}", steady_rate(target, prompts, settings.replace(rows=rows, steps=steps),
                                                           seconds=args.sweep_seconds, window=args.window, **kw))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
