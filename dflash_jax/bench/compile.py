"""Compile-time and context-scaling figures, measured in one run and printed (never asserted: machines are noisy).

    python -m dflash_jax.bench.compile                     # every section, on the shipped models
    python -m dflash_jax.bench.compile --sections attention,programs

Sections:
  attention  verify step (D+1 tokens) at 64 live tokens in caches of 256 and 16,384 slots: ms each and the ratio
             (on CPU attention visits only the live blocks, so the ratio should be ~1; on accelerators it reads the
             whole bucket, static trip counts), and decode / draft for reference.
  programs   compiled loop programs and prefill programs, counted apart, for 100 prompts with lengths spread over
             1..1000 tokens (a new prompt bucket compiles prefill only), for 4 temperatures x 3 EOS sets x 3 budgets
             on one prompt shape (traced sampling and budgets), and for batches of 1..8 rows (batch buckets).
  sampling   ms per loop step of the greedy program vs the sampling program run near-greedy (why greedy keeps a
             program of its own), and their compile times.
  cli        wall time of `dflash-jax generate "def f(x):"` run twice with a fresh persistent compilation cache.
  prefill_memory  compiled temp memory of prefill (compile only, `memory_analysis`): a small shape at 2k vs 8k
             prompt tokens (blocked attention: linear, not quadratic) and one Qwen3-8B-shaped layer at 32k tokens.
  scan       prototype: a 36-layer Qwen3-shaped target (hidden 256), an autoregressive decode loop with the layers
             unrolled vs `lax.scan` over stacked layers: compile seconds and ms per decode step.
The persistent compilation cache is on (as for every benchmark here) except where a section says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import step_costs
from dflash_jax.config import TargetConfig
from dflash_jax.decode import buckets
from dflash_jax.decode import programs as G
from dflash_jax.decode.prefill import prefill
from dflash_jax.decode.programs import generate
from dflash_jax.io.compile_cache import enable_compilation_cache
from dflash_jax.io.shipped import load_default
from dflash_jax.models.layers import decoder_layer, rms_norm, write_kv
from dflash_jax.models.cache import AttentionCache, KVCache
from dflash_jax.models.target import Target, init_target, lm_logits
from dflash_jax.params import abstract_target, is_spec

SECTIONS = ("attention", "programs", "sampling", "cli", "scan", "prefill_memory")

# One Qwen3-8B decoder layer (vocab cut: the embedding and LM head are not what prefill memory is about).
QWEN3_8B_LAYER = TargetConfig(vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_hidden_layers=1,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, param_dtype="bfloat16",
                             compute_dtype="bfloat16")
SMALL_PREFILL = TargetConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)


def prefill_temp_bytes(cfg: TargetConfig, tokens: int, batch: int = 1) -> int:
    """Temp bytes XLA allocates for `prefill` of `batch` prompts of `tokens` tokens into a cache of as many slots
    (compiled for this backend, never run: weights and prompts are abstract)."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, cfg.storage_dtype), abstract_target(cfg),
                          is_leaf=is_spec)
    target = Target(params=params, config=cfg)
    prompt = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = jax.jit(lambda t, p, n: prefill(t, p, n, tokens)[:3])
    return int(fn.lower(target, prompt, lens).compile().memory_analysis().temp_size_in_bytes)


def prefill_memory_section(*, small=(2048, 8192), big_tokens: int = 32768) -> dict:
    a, b = (prefill_temp_bytes(SMALL_PREFILL, n) for n in small)
    print(f"prefill temp memory, hidden {SMALL_PREFILL.hidden_size} x {SMALL_PREFILL.num_hidden_layers} layers: "
          f"{small[0]} tokens {a / 2**20:.1f} MiB, {small[1]} tokens {b / 2**20:.1f} MiB -> {b / a:.2f}x "
          f"(quadratic would be {(small[1] / small[0]) ** 2:.0f}x)", flush=True)
    big = prefill_temp_bytes(QWEN3_8B_LAYER, big_tokens)
    print(f"prefill temp memory, one Qwen3-8B-shaped layer (bf16), {big_tokens} tokens, batch 1: "
          f"{big / 2**30:.2f} GiB", flush=True)
    return {"small_tokens": list(small), "small_bytes": [a, b], "ratio": b / a, "qwen3_8b_layer_tokens": big_tokens,
            "qwen3_8b_layer_bytes": big}


def attention_section(target, drafter, *, live: int = 64, cache_lens=(256, 16384), reps: int = 20) -> dict:
    """Steps at `live` tokens in caches of each size, all timed in turns (one round = every step at every size)."""

    steps, metas = {}, {}
    for n in cache_lens:
        fns = step_costs.step_functions(target, drafter, context_len=live, cache_len=n)
        metas[n] = fns.pop("_meta")
        steps.update({(n, k): v for k, v in fns.items()})
    ms = step_costs.interleaved_ms(steps, reps)
    rows = {n: {k: ms[n, k] for k in ("verify_ms", "decode_ms", "draft_ms")} for n in cache_lens}
    for n, c in rows.items():
        print(f"cache {n:>6} slots, {live} live tokens: verify({metas[n]['draft_length'] + 1} tok) "
              f"{c['verify_ms']:.2f} ms | decode {c['decode_ms']:.2f} ms | draft {c['draft_ms']:.2f} ms", flush=True)
    lo, hi = rows[min(cache_lens)], rows[max(cache_lens)]
    out = {k: hi[k] / lo[k] for k in ("verify_ms", "decode_ms", "draft_ms")}
    print(f"ratio {max(cache_lens)} vs {min(cache_lens)} slots: verify {out['verify_ms']:.2f}x, decode "
          f"{out['decode_ms']:.2f}x, draft {out['draft_ms']:.2f}x (medians of {reps} interleaved rounds)")
    return {"rows": rows, "ratios": out}


def programs_section(target, drafter, *, n_prompts: int = 100, max_len: int = 1000, new_tokens: int = 8) -> dict:
    """Programs compiled (traced) for n_prompts lengths over 1..max_len and for a grid of settings, counted apart:
    prefill programs (one per prompt bucket) and loop programs (keyed on cache / batch / budget buckets and flags)."""
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    lens = np.linspace(1, max_len, n_prompts).astype(int)

    def counts():
        return G.TRACE_COUNTS["prefill"], G.TRACE_COUNTS["speculative"]

    (p0, l0), c0 = counts(), time.perf_counter()
    for n in lens:
        generate(target, drafter, [rng.integers(2, V, int(n)).tolist()], max_new_tokens=new_tokens, eos_ids=(),
                 prefill_timing="rerun")
    p1, l1 = counts()
    prompt_buckets = sorted({buckets.prompt_bucket(int(n)) for n in lens})
    print(f"{n_prompts} prompts, lengths {lens.min()}..{lens.max()}: {l1 - l0} loop program(s), {p1 - p0} prefill "
          f"programs ({len(prompt_buckets)} prompt buckets {prompt_buckets[0]}..{prompt_buckets[-1]}; cache bucket "
          f"rule: powers of two >= "
          f"{buckets.CACHE_BUCKET_MIN} up to {buckets.FINE_ABOVE} slots, then multiples of {buckets.FINE_STEP}; "
          f"attention over the cache: "
          f"{'live-length loop' if buckets.uses_live_length_loop() else 'static trip counts'}) "
          f"({time.perf_counter() - c0:.1f} s in all)", flush=True)
    prompt = [rng.integers(2, V, 20).tolist()]
    for temperature in (0.0, 0.5, 0.8, 1.0):
        for eos in ((), (0,), (0, 5, 9)):
            for budget in (40, 50, 60):
                generate(target, drafter, prompt, max_new_tokens=budget, temperature=temperature, eos_ids=eos,
                         prefill_timing="rerun")
    p2, l2 = counts()
    print(f"4 temperatures x 3 EOS sets x 3 budgets, one prompt shape: {l2 - l1} loop program(s), {p2 - p1} prefill "
          "program(s)")
    batches = (1, 2, 3, 4, 5, 7, 8)
    for b in batches:
        generate(target, drafter, [prompt[0]] * b, max_new_tokens=8, eos_ids=(), prefill_timing="rerun")
    p3, l3 = counts()
    rows = sorted({buckets.batch_bucket(b) for b in batches})
    print(f"batches of {', '.join(map(str, batches))} rows: {l3 - l2} loop program(s), {p3 - p2} prefill program(s) "
          f"(batch buckets {rows}; inert padding rows)")
    return {"length_programs": l1 - l0, "length_prefill_programs": p1 - p0, "prompt_buckets": len(prompt_buckets),
            "grid_programs": l2 - l1, "grid_prefill_programs": p2 - p1, "batch_programs": l3 - l2,
            "batch_prefill_programs": p3 - p2, "batch_buckets": len(rows)}


def sampling_section(target, drafter, *, new_tokens: int = 300, prompt_len: int = 40, reps: int = 3) -> dict:
    """Greedy vs sampling program. Defaults pick a budget bucket (512) the other sections do not compile, so both
    compile times are measured (unless a persistent cache already holds them)."""

    prompt = [list(np.random.default_rng(1).integers(2, target.config.vocab_size, prompt_len))]
    out = {}
    for name, kw in (("greedy", dict(temperature=0.0)), ("sampling (T=1e-4)", dict(temperature=1e-4))):
        first = generate(target, drafter, prompt, max_new_tokens=new_tokens, prefill_timing="rerun", **kw)
        per_step = []
        for _ in range(reps):
            r = generate(target, drafter, prompt, max_new_tokens=new_tokens, prefill_timing="rerun", **kw)
            per_step.append(1e3 * r.timings["decode_s"] / max(r.num_steps, 1))
        out[name] = {"compile_s": first.timings["compile_s"], "ms_per_step": statistics.median(per_step),
                     "tau": r.tau}
        print(f"{name:>18}: compile {first.timings['compile_s']:.1f} s, {out[name]['ms_per_step']:.2f} ms/step, "
              f"tau {r.tau:.2f}", flush=True)
    g, s = out["greedy"], out["sampling (T=1e-4)"]
    ratio = f", {s['compile_s'] / g['compile_s']:.2f}x compile" if g["compile_s"] > 0 else ""
    print(f"sampling program / greedy program: {s['ms_per_step'] / g['ms_per_step']:.2f}x per step{ratio}")
    return out


def cli_section(prompt: str = "def f(x):") -> dict:
    with tempfile.TemporaryDirectory() as xdg:
        env = dict(os.environ, XDG_CACHE_HOME=xdg)
        env.pop("DFLASH_JAX_NO_COMPILE_CACHE", None)
        walls = []
        for _ in range(2):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dflash_jax.cli", "generate", prompt], env=env, check=True,
                           capture_output=True)
            walls.append(time.perf_counter() - t0)
    print(f"dflash-jax generate {prompt!r}, fresh compilation cache: first run {walls[0]:.1f} s, second run "
          f"{walls[1]:.1f} s -> {walls[1] / walls[0]:.2f}x")
    return {"first_s": walls[0], "second_s": walls[1], "ratio": walls[1] / walls[0]}


def scan_section(*, layers: int = 36, hidden: int = 256, steps: int = 64, reps: int = 3) -> dict:
    """Prototype only (not the package's forward): layers unrolled vs lax.scan over stacked layers."""

    cfg = TargetConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    target = init_target(cfg, jax.random.key(0))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *target.params.layers)
    B, S = 1, 256

    def step_unrolled(target, cache, tok):
        x = jnp.take(target.params.embed_tokens, tok, axis=0)
        pos = cache.lengths[:, None]
        entries = []
        for layer, entry in zip(target.params.layers, cache.layers):
            x, k, v = decoder_layer(layer, x, pos, cfg, cache_k=entry.k, cache_v=entry.v,
                                    cache_len=cache.lengths, causal=True)
            entries.append(AttentionCache(k=write_kv(entry.k, k, pos), v=write_kv(entry.v, v, pos)))
        logits = lm_logits(target, rms_norm(x, target.params.norm, cfg.rms_norm_eps))
        return jnp.argmax(logits[:, -1], -1), KVCache(tuple(entries), cache.lengths + 1)

    def step_scanned(target, cache, tok):
        x = jnp.take(target.params.embed_tokens, tok, axis=0)
        pos = cache.lengths[:, None]

        def layer_fn(x, xs):
            layer, ck, cv = xs
            x, k, v = decoder_layer(layer, x, pos, cfg, cache_k=ck, cache_v=cv, cache_len=cache.lengths,
                                    causal=True)
            return x, (write_kv(ck, k, pos), write_kv(cv, v, pos))

        x, (ks, vs) = jax.lax.scan(layer_fn, x, (stacked, cache.layers[0].k, cache.layers[0].v))
        logits = lm_logits(target, rms_norm(x, target.params.norm, cfg.rms_norm_eps))
        return jnp.argmax(logits[:, -1], -1), KVCache((AttentionCache(ks, vs),), cache.lengths + 1)

    def decode_loop(step):
        def run(target, cache, tok):
            def body(i, c):
                tok, cache = c
                nxt, cache = step(target, cache, tok[:, None])
                return nxt, cache
            return jax.lax.fori_loop(0, steps, body, (tok, cache))
        return jax.jit(run)

    out = {}
    empty = KVCache.empty(cfg, B, S)
    # the scanned form holds every layer's keys (values) in one stacked [L, B, nKV, S, hd] array
    stacked_cache = KVCache((AttentionCache(jnp.stack([e.k for e in empty.layers]),
                                            jnp.stack([e.v for e in empty.layers])),), empty.lengths)
    for name, step, cache in (("unrolled", step_unrolled, empty), ("scan", step_scanned, stacked_cache)):
        fn = decode_loop(step)
        tok = jnp.zeros((B,), jnp.int32)
        t0 = time.perf_counter()
        compiled = fn.lower(target, cache, tok).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(target, cache, tok))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(target, cache, tok))
            times.append(time.perf_counter() - t0)
        out[name] = {"compile_s": compile_s, "ms_per_step": 1e3 * statistics.median(times) / steps}
        print(f"{layers} layers, hidden {hidden}, {name:>8}: compile {compile_s:.1f} s, "
              f"{out[name]['ms_per_step']:.2f} ms per decode step", flush=True)
    u, s = out["unrolled"], out["scan"]
    print(f"scan / unrolled: compile {s['compile_s'] / u['compile_s']:.2f}x, decode "
          f"{s['ms_per_step'] / u['ms_per_step']:.2f}x")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per step measurement")
    ap.add_argument("--prompts", type=int, default=100, help="prompts of the program-count section")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        raise SystemExit(f"error: unknown sections {bad}; choose from {SECTIONS}")

    enable_compilation_cache()
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; one run, figures not asserted", flush=True)
    target, drafter = (None, None) if set(sections) <= {"prefill_memory", "scan", "cli"} else load_default()[:2]
    figures = {}
    for name in sections:
        print(f"\n== {name}", flush=True)
        if name == "attention":
            figures[name] = attention_section(target, drafter, reps=args.reps)
        elif name == "programs":
            figures[name] = programs_section(target, drafter, n_prompts=args.prompts)
        elif name == "sampling":
            figures[name] = sampling_section(target, drafter)
        elif name == "cli":
            figures[name] = cli_section()
        elif name == "scan":
            figures[name] = scan_section()
        elif name == "prefill_memory":
            figures[name] = prefill_memory_section()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, default=float)


if __name__ == "__main__":
    main()
