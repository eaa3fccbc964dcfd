"""Benchmarks: speculative vs autoregressive decoding, measured in one run, medians over prompts.

Two views:
- `step_costs`: ms of one decode step (1 token), one verify (D+1 tokens) and one drafter call, timed in turns on
  donated caches, giving r = verify/decode and c = draft/decode; next to the loop's measured ms per step, the rest
  being bookkeeping (acceptance, commits, rollback). Predicted speedup = tau / (r + c).
- `compare`: for each prompt (batch 1) the autoregressive and the DFlash tokens/s of the decode loop (prefill
  excluded, as z-lab's TPOT), tau and acceptance; medians over the prompt set.
Timings are never asserted anywhere: these machines are noisy, so read the medians.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io.gguf_drafter import load_drafter_gguf, patch_scales, save_gguf
from dflash_jax.decode.draft_step import draft_step
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.models.drafter import Drafter, append_context, draft_tokens, empty_draft_cache
from dflash_jax.decode.buckets import uses_live_length_loop
from dflash_jax.decode.prefill import prefill
from dflash_jax.decode.programs import generate, generate_autoregressive
from dflash_jax.models.attention import live_length_loop
from dflash_jax.models.target import KVCache, Target, commit_states, forward_with_cache, target_forward
from dflash_jax.quant.linear import backend_scope, cpu_kernel_scope, program_backend

# Benchmarks run with the persistent compilation cache on (cli.py), which never stores a program with a host
# callback: prefill is timed by a prefill-only rerun of the same compiled program instead of a callback stamp.
PREFILL_TIMING = "rerun"


def interleaved_ms(steps: dict, reps: int) -> dict:
    """{name: (step, state)} -> {name: median ms of state = step(state)}, the steps taking turns in each round, so a
    change of machine load during the run hits all of them alike (state threaded: steps may donate buffers)."""
    states = {k: jax.block_until_ready(step(state)) for k, (step, state) in steps.items()}  # compile + warm up
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, (step, _) in steps.items():
            t0 = time.perf_counter()
            states[k] = jax.block_until_ready(step(states[k]))
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


@dataclasses.dataclass(frozen=True)
class Step:
    """One step program on its state: `step(state)` -> the next state (the state, a cache, is donated);
    `compiled_text(state)` -> its optimized HLO (what `bench.profile` reads)."""

    program: object  # a jitted function: program(*before, state, *after) -> (result, next state)
    before: tuple
    after: tuple

    def __call__(self, state):
        return self.program(*self.before, state, *self.after)[1]

    def compiled_text(self, state) -> str:
        return self.program.lower(*self.before, state, *self.after).compile().as_text()


def step_functions(target: Target, drafter: Drafter, *, context_len: int = 64, draft_length: int | None = None,
                   batch: int = 1, seed: int = 0, cache_len: int | None = None) -> dict:
    """{"decode_ms" | "verify_ms" | "draft_ms": (step, state)}: one decode step (1 token), one verify (D+1 tokens)
    and one drafter call on caches holding `context_len` live tokens in `cache_len` slots (default: just enough).
    Each step runs on donated caches and rolls its lengths back, as a rejected step does, so every repetition sees
    the same context."""
    dcfg = drafter.config
    D = dcfg.block_size - 1 if draft_length is None else draft_length
    tcfg = target.config
    cache_len = context_len + dcfg.block_size + 64 if cache_len is None else cache_len
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, tcfg.vocab_size, (batch, context_len)), jnp.int32)
    lens = jnp.full((batch,), context_len, jnp.int32)
    layer_ids = dcfg.target_layer_ids
    fill = jax.jit(prefill, static_argnums=(3,))

    _, feats, tcache, dcache = fill(target, prompt, lens, cache_len, drafter=drafter)
    pending = feats[:, :D + 1]

    tok = prompt[:, -1:]
    toks = prompt[:, -(D + 1):]
    block = jnp.full((batch, dcfg.block_size), dcfg.mask_token_id, jnp.int32).at[:, 0].set(prompt[:, -1])
    _, _, tcache2, _ = fill(target, prompt, lens, cache_len, drafter=drafter)  # decode and verify donate theirs
    tb, db = program_backend(target), program_backend(drafter, target)
    return {"decode_ms": (Step(_decode_rolled_back, (target,), (tok, tb)), tcache),
            "verify_ms": (Step(_verify_rolled_back, (target,), (toks, layer_ids, tb)), tcache2),
            "draft_ms": (Step(_draft_rolled_back, (drafter, target), (pending, block, D, db)), dcache),
            "_meta": dict(context_len=context_len, draft_length=D, batch=batch, cache_len=cache_len,
                          state_bytes_per_row=tcache.state_bytes_per_row())}  # a hybrid target's DeltaNet states


def step_costs(target: Target, drafter: Drafter, *, context_len: int = 64, draft_length: int | None = None,
               batch: int = 1, reps: int = 30, seed: int = 0, cache_len: int | None = None) -> dict:
    """ms per decode step, verify and draft at a given context length (see `step_functions`), and r, c."""
    fns = step_functions(target, drafter, context_len=context_len, draft_length=draft_length, batch=batch, seed=seed,
                         cache_len=cache_len)
    meta = fns.pop("_meta")
    out = interleaved_ms(fns, reps)
    out["r"] = out["verify_ms"] / out["decode_ms"]
    out["c"] = out["draft_ms"] / out["decode_ms"]
    out.update(meta)
    return out


def greedy_draft(drafter: Drafter, target: Target, dcache: KVCache, pending: jax.Array, block: jax.Array, D: int):
    """One greedy draft call as generate's loop makes it: append the D+1 pending context features [B, D+1, K*H],
    then the loop's own `draft_step` (one block pass; DFlash: argmax of the logits, DFlash2: the selector walk).
    -> (drafts [B, D] int32, the draft cache after the append). Callers return only the drafts, so XLA drops what
    the loop would also build for verification (the DFlash2 selector's q on the vocabulary)."""
    B = block.shape[0]
    dc = append_context(drafter, pending, jnp.full((B,), D + 1, jnp.int32), dcache)
    keys = jnp.zeros((B, 2), jnp.uint32)  # greedy: no draw is made
    drafts, _, _, _ = draft_step(drafter, target, block, dc, D, keys, SamplingParams())
    return drafts, dc


@contextlib.contextmanager
def _as_in_the_loop(backend):
    """What generate's loop program is traced under on this platform: the NVFP4 backend, and the attention rule
    (the live-length loop on CPU, static trip counts on accelerators), so a step costs here what it costs there."""
    cpu = uses_live_length_loop()
    with backend_scope(backend), live_length_loop(cpu), cpu_kernel_scope(cpu):
        yield


# The step programs are module-level, so every `step_functions` / `draft_costs` call with the same shapes shares them
# (the target's decode and verify across drafters, e.g.); the NVFP4 backend is a static argument, as in generate.


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(1,))
def _decode_rolled_back(target, tcache, tok, backend):
    """One decode step (1 token) on a donated cache whose lengths are rolled back, as a rejected step does."""
    with _as_in_the_loop(backend):
        logits, _, c = forward_with_cache(target, tok, tcache)
    return jnp.argmax(logits, -1), c.replace(lengths=tcache.lengths)


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(1,))
def _verify_rolled_back(target, tcache, toks, layer_ids, backend):
    """One verify (D+1 tokens, tapped features) on a donated cache whose lengths are rolled back. A hybrid target's
    DeltaNet states are deferred and committed as the loop does (here keeping one token: a rejection at slot 1)."""
    with _as_in_the_loop(backend):
        hybrid = target.config.is_hybrid
        logits, feats, c = forward_with_cache(target, toks, tcache, layer_ids, defer_states=hybrid)
        if hybrid:
            c = commit_states(c, jnp.ones(toks.shape[:1], jnp.int32), target.config)
    return (jnp.argmax(logits, -1), feats), c.replace(lengths=tcache.lengths)


@functools.partial(jax.jit, static_argnums=(5, 6), donate_argnums=(2,))
def _draft_rolled_back(drafter, target, dcache, pending, block, D, backend):
    """`greedy_draft` on a donated draft cache whose lengths are rolled back."""
    with _as_in_the_loop(backend):
        tokens, dc = greedy_draft(drafter, target, dcache, pending, block, D)
    return tokens, dc.replace(lengths=dcache.lengths)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _draft_only(drafter, target, dcache, pending, block, D, backend):
    """`greedy_draft`'s drafts alone (the cache is not donated: `draft_costs` reuses it every repetition)."""
    with _as_in_the_loop(backend):
        return greedy_draft(drafter, target, dcache, pending, block, D)[0]


def draft_costs(target: Target, drafters: dict, *, context_len: int = 64, draft_length: int = 7, batch: int = 1,
                reps: int = 30, seed: int = 0, clock: str = "wall") -> dict:
    """ms of one drafter call for each drafter and of one target decode step, timed interleaved (A, B, A, B, ...)
    so that load changes hit every drafter alike; c = draft / decode per drafter. Drafters may differ in kind,
    block size and layers, but must share the target's taps (the first drafter's are used for the context).
    clock="cpu" times this process's CPU seconds instead of wall seconds (steadier on a shared machine)."""
    now = {"wall": time.perf_counter, "cpu": time.process_time}[clock]
    first = next(iter(drafters.values()))
    tcfg, D = target.config, draft_length
    cache_len = context_len + max(d.config.block_size for d in drafters.values()) + 64
    prompt = jnp.asarray(np.random.default_rng(seed).integers(0, tcfg.vocab_size, (batch, context_len)), jnp.int32)
    taps = first.config.target_layer_ids
    if any(d.config.target_layer_ids != taps for d in drafters.values()):
        raise ValueError("draft_costs: all drafters must tap the same target layers")
    _, feats, tcache = jax.jit(lambda t, p: forward_with_cache(t, p, KVCache.empty(tcfg, batch, cache_len), taps))(
        target, prompt)

    @jax.jit
    def decode(target, tcache, tok):
        with _as_in_the_loop(program_backend(target)):
            logits, _, c = forward_with_cache(target, tok, tcache)
        return jnp.argmax(logits, -1), c.lengths

    calls = {"decode": (decode, (target, tcache, prompt[:, -1:]))}
    for name, d in drafters.items():
        dcache = jax.jit(lambda d, f: append_context(d, f, jnp.full((batch,), context_len, jnp.int32),
                                                     empty_draft_cache(d.config, batch, cache_len)))(d, feats)
        block = jnp.full((batch, d.config.block_size), d.config.mask_token_id, jnp.int32).at[:, 0].set(prompt[:, -1])
        calls[name] = (_draft_only, (d, target, dcache, feats[:, :D + 1], block, D, program_backend(d, target)))
    for fn, args in calls.values():  # compile + warm up
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, (fn, args) in calls.items():
            t0 = now()
            jax.block_until_ready(fn(*args))
            times[name].append(now() - t0)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    out = {"decode_ms": ms.pop("decode"), "context_len": context_len, "draft_length": D, "batch": batch,
           "clock": clock}
    out["draft_ms"] = ms
    out["c"] = {name: v / out["decode_ms"] for name, v in ms.items()}
    return out


def compare(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
            draft_length: int | None = None, eos_ids=(), warmup: bool = True, drafters: dict | None = None,
            temperature: float = 0.0, seed: int = 0, tree_budget: int | None = None) -> dict:
    """Per prompt (batch 1): AR and DFlash decode tokens/s, tau, acceptance. Medians over prompts.

    `drafters` may name extra drafters (e.g. {"nvfp4": q}) measured on the same prompts in the same run.
    tree_budget: every drafter drafts trees of that many nodes (draft_length then stays None).
    """
    drafters = {"dflash": drafter, **(drafters or {})}
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature, seed=seed,
              prefill_timing=PREFILL_TIMING)
    spec = dict(draft_length=draft_length) if tree_budget is None else dict(tree_budget=tree_budget)
    if warmup:  # compile every program shape before timing
        generate_autoregressive(target, [list(prompts[0])], **kw)
        for d in drafters.values():
            generate(target, d, [list(prompts[0])], **spec, **kw)
    ar_tps, rows = [], {name: {"tps": [], "acc": [], "tau_steps": [], "steps": 0} for name in drafters}
    ar_tokens = []
    for p in prompts:
        ar = generate_autoregressive(target, [list(p)], **kw)
        ar_tps.append(ar.decode_tokens_per_second)
        ar_tokens.append(ar.tokens[0])
        for name, d in drafters.items():
            res = generate(target, d, [list(p)], **spec, **kw)
            r = rows[name]
            r["tps"].append(res.decode_tokens_per_second)
            acc = res.acceptance_lengths[res.acceptance_lengths > 0]
            r["tau_steps"].extend(acc.tolist())
            r["acc"].append(res.acceptance_rate)
            r.setdefault("exact", []).append(bool(np.array_equal(res.tokens[0], ar.tokens[0])))
            r.setdefault("position", []).append(res.position_acceptance)
    D = drafter.config.block_size - 1 if draft_length is None else draft_length
    if tree_budget is not None:
        D = min(tree_budget, drafter.config.block_size - 1)  # the tree's depth
    out = {"max_new_tokens": max_new_tokens, "draft_length": D, "prompts": len(prompts), "temperature": temperature,
           "ar_tokens_per_s": statistics.median(ar_tps), "tree_budget": tree_budget}
    for name, r in rows.items():
        steps = np.asarray(r["tau_steps"])
        out[name] = {
            "tokens_per_s": statistics.median(r["tps"]),
            "tau": float(steps.mean()),
            "acceptance_rate": float((steps - 1).sum() / (len(steps) * D)),
            "accepted": int((steps - 1).sum()), "drafted": int(len(steps) * D),  # the rate's two counts
            "speedup": statistics.median(r["tps"]) / statistics.median(ar_tps),
            "exact_match": f"{sum(r['exact'])}/{len(r['exact'])}",
            "position_acceptance": np.mean(np.stack(r["position"]), axis=0),
        }
    return out


def _drafter_table(rows: list[dict], names: Sequence[str], head: str, left: Callable[[dict], str],
                   head_of: Callable[[str], str], cell: Callable[[dict, str], str]) -> str:
    """One line per result row: the row's own columns, then one group of columns per drafter name."""
    head += "".join(head_of(n) for n in names)
    return "\n".join([head, "-" * len(head)] + [left(r) + "".join(cell(r, n) for n in names) for r in rows])


def format_compare_table(results: list[dict], names: Sequence[str] = ("dflash",)) -> str:
    def cell(r, n):
        x = r[n]
        return (f" | {x['tokens_per_s']:>14.1f} {100 * x['acceptance_rate']:>6.1f}% {x['tau']:>5.2f} "
                f"{x['speedup']:>6.2f}x {x['exact_match']:>6}")

    return _drafter_table(
        results, names, f"{'new tok':>8} {'AR tok/s':>9}",
        lambda r: f"{r['max_new_tokens']:>8} {r['ar_tokens_per_s']:>9.1f}",
        lambda n: f" | {n + ' tok/s':>14} {'accept':>7} {'tau':>5} {'speedup':>7} {'exact':>6}", cell)


def format_step_costs(c: dict, tau: float | None = None, measured_step_ms: float | None = None) -> str:
    s = (f"context {c['context_len']}, batch {c['batch']}, draft length {c['draft_length']}: "
         f"decode(1 tok) {c['decode_ms']:.2f} ms | verify({c['draft_length'] + 1} tok) {c['verify_ms']:.2f} ms | "
         f"draft {c['draft_ms']:.2f} ms | r = {c['r']:.2f}, c = {c['c']:.2f}")
    if measured_step_ms is not None:
        book = measured_step_ms - c["verify_ms"] - c["draft_ms"]
        s += f"\nloop: {measured_step_ms:.2f} ms/step = draft + verify + bookkeeping {book:.2f} ms"
    if tau is not None:
        s += f"\ntau {tau:.2f}: predicted speedup tau/(r+c) = {tau / (c['r'] + c['c']):.2f}x"
    return s


def format_draft_costs(c: dict) -> str:
    names = list(c["draft_ms"])
    s = (f"draft cost at context {c['context_len']}, draft length {c['draft_length']}, batch {c['batch']} "
         f"(decode(1 tok) {c['decode_ms']:.2f} ms; interleaved medians of {c.get('clock', 'wall')} time): "
         + ", ".join(f"{n} {c['draft_ms'][n]:.2f} ms (c = {c['c'][n]:.3f})" for n in names))
    if len(names) == 2:
        a, b = names
        s += f"\n{b} / {a} draft cost c ratio: {c['c'][b] / c['c'][a]:.3f}"
    return s


def format_dflash2_goals(results: list[dict], draft_costs: dict | None = None) -> str:
    """The DFlash2 goal figures from one bench run: tau ratios per table row (NVFP4 both / NVFP4 vs dense DFlash2),
    the draft cost ratio (same run, interleaved) and greedy exactness over every row of both kinds."""
    lines = ["DFlash2 goals (this run; tau ratios per row, D = draft length):"]
    for r in results:
        t = {n: r[n]["tau"] for n in ("dflash", "nvfp4", "dflash2", "dflash2 nvfp4")}
        lines.append(f"  {r['max_new_tokens']:>5} new tok, D {r['draft_length']}: DFlash2/DFlash tau, NVFP4 both "
                     f"{t['dflash2 nvfp4'] / t['nvfp4']:.3f} (goal >= 1.10); NVFP4/dense DFlash2 tau "
                     f"{t['dflash2 nvfp4'] / t['dflash2']:.3f} (goal >= 0.97)")
    if draft_costs is not None and {"dflash", "dflash2"} <= set(draft_costs["c"]):
        c = draft_costs["c"]
        lines.append(f"  draft cost c DFlash2/DFlash {c['dflash2'] / c['dflash']:.3f} (goal <= 1.15)")
    if results[0]["temperature"] > 0:  # sampled runs differ from autoregressive by design
        return "\n".join(lines)
    names = [n for n in results[0] if isinstance(results[0][n], dict) and "exact_match" in results[0][n]]
    same, runs = exact_counts(results)
    lines.append(f"  greedy output identical to autoregressive: {same}/{runs} runs over {len(names)} drafters "
                 f"(goal 100%)")
    return "\n".join(lines)


def exact_counts(results: list[dict]) -> tuple[int, int]:
    """(runs whose output equalled autoregressive, runs) summed over every drafter of every `compare` result."""
    pairs = [tuple(map(int, x["exact_match"].split("/"))) for r in results for x in r.values()
             if isinstance(x, dict) and "exact_match" in x]
    return sum(a for a, _ in pairs), sum(b for _, b in pairs)


def step_table(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, draft_lengths=(1, 3, 7),
               draft_vocabs=(None, 8192, 4096), max_new_tokens: int = 128, context_len: int = 256,
               reps: int = 30) -> list[dict]:
    """What a step costs and what it buys, per (draft length, draft vocabulary): r and c (interleaved step costs at
    `context_len`), tau, the speedup they predict (tau / (r + c)) and the speedup measured on the same prompts in the
    same run (medians, greedy, each against the autoregressive runs of its own `compare`). The draft vocabulary is
    the drafter config's `draft_vocab_size` (None: the whole vocabulary); sizes at or above it are skipped."""
    V = drafter.config.model.vocab_size
    variants = {("full" if n is None else f"first {n}"): drafter.replace(config=drafter.config.replace(
        draft_vocab_size=n)) for n in draft_vocabs if n is None or n < V}
    rows = []
    for D in draft_lengths:
        first, *rest = variants
        res = compare(target, variants[first], prompts, max_new_tokens=max_new_tokens, draft_length=D,
                      drafters={n: variants[n] for n in rest})
        costs = {n: step_costs(target, d, context_len=context_len, draft_length=D, reps=reps)
                 for n, d in variants.items()}
        for n in variants:
            x, c = res["dflash" if n == first else n], costs[n]
            rows.append({"draft_length": D, "tree_budget": None, "draft_vocab": n, "r": c["r"], "c": c["c"],
                         "decode_ms": c["decode_ms"],
                         "verify_ms": c["verify_ms"], "draft_ms": c["draft_ms"], "tau": x["tau"],
                         "predicted": x["tau"] / (c["r"] + c["c"]), "speedup": x["speedup"],
                         "exact_match": x["exact_match"], "max_new_tokens": max_new_tokens})
    return rows


def format_step_table(rows: list[dict]) -> str:
    """One line per row: chain rows (tree "-") and draft-tree rows (`bench.tree.tree_rows`: tree = N nodes, D = the
    tree's depth, verify = root + N nodes, draft = the drafter pass + the tree's construction)."""
    lines = [f"{'tree':>4} {'D':>3} {'draft vocab':>12} {'verify ms':>9} {'draft ms':>8} {'r':>5} {'c':>5} {'r+c':>5} "
             f"{'tau':>5} {'tau/(r+c)':>9} {'measured':>8} {'exact':>6}", "-" * 95]
    for r in rows:
        tree = "-" if r.get("tree_budget") is None else str(r["tree_budget"])
        lines.append(f"{tree:>4} {r['draft_length']:>3} {r['draft_vocab']:>12} {r['verify_ms']:>9.2f} "
                     f"{r['draft_ms']:>8.2f} "
                     f"{r['r']:>5.2f} {r['c']:>5.2f} {r['r'] + r['c']:>5.2f} {r['tau']:>5.2f} "
                     f"{r['predicted']:>8.2f}x {r['speedup']:>7.2f}x {r['exact_match']:>6}")
    decode = statistics.median(r["decode_ms"] for r in rows)
    lines.append(f"decode (1 token) median {decode:.2f} ms; r = verify / decode, c = draft / decode (interleaved "
                 f"medians); 'measured' = decode tokens/s speculative / autoregressive, medians over prompts")
    return "\n".join(lines)


def tau_table(target: Target, drafters: dict, prompts: Sequence[Sequence[int]], *, draft_lengths=(3, 7, 15),
              max_new_tokens: int = 128, eos_ids=(), temperature: float = 0.0) -> list[dict]:
    """tau, acceptance rate and per-position acceptance for each drafter and draft length (one batched call each)."""
    rows = []
    for name, d in drafters.items():
        for D in draft_lengths:
            res = generate(target, d, [list(p) for p in prompts], max_new_tokens=max_new_tokens, draft_length=D,
                           eos_ids=eos_ids, temperature=temperature, prefill_timing=PREFILL_TIMING)
            rows.append({"drafter": name, "draft_length": D, "tau": res.tau, "acceptance_rate": res.acceptance_rate,
                         "position_acceptance": res.position_acceptance, "steps": int((res.acceptance_lengths > 0).sum())})
    return rows


def format_tau_table(rows: list[dict]) -> str:
    lines = [f"{'drafter':>16} {'D':>3} {'tau':>6} {'accept':>7} {'steps':>6}  per-position acceptance (k = 1..D)",
             "-" * 100]
    for r in rows:
        pos = " ".join(f"{x:.2f}" for x in r["position_acceptance"])
        lines.append(f"{r['drafter']:>16} {r['draft_length']:>3} {r['tau']:>6.2f} {100 * r['acceptance_rate']:>6.1f}% "
                     f"{r['steps']:>6}  {pos}")
    return "\n".join(lines)


def pair_table(target: Target, drafters: dict, prompts: Sequence[Sequence[int]], *, new_tokens=(128, 512, 1024),
               draft_lengths=(7, 15), temperatures=(0.0, 0.7), seed: int = 0) -> list[dict]:
    """The shipped pair's summary grid: for each temperature and draft length, `compare` at every output length
    with all `drafters` (e.g. dense and NVFP4) on the same prompts; one autoregressive baseline per cell."""
    (first, d0), *rest = drafters.items()
    rows = []
    for temperature in temperatures:
        for D in draft_lengths:
            for n in new_tokens:
                r = compare(target, d0, prompts, max_new_tokens=n, draft_length=D, drafters=dict(rest),
                            temperature=temperature, seed=seed)
                r[first] = r.pop("dflash")  # `compare` names its first drafter "dflash"
                rows.append(r)
    return rows


def format_pair_table(rows: list[dict], names: Sequence[str]) -> str:
    def cell(r, n):
        x = r[n]
        exact = x["exact_match"] if r["temperature"] == 0 else "-"
        return f" | {x['tau']:>12.2f} {x['speedup']:>6.2f}x {exact:>6}"

    return _drafter_table(
        rows, names, f"{'T':>4} {'D':>3} {'new tok':>8} {'AR tok/s':>9}",
        lambda r: (f"{r['temperature']:>4.1f} {r['draft_length']:>3} {r['max_new_tokens']:>8} "
                   f"{r['ar_tokens_per_s']:>9.1f}"),
        lambda n: f" | {n + ' tau':>12} {'speedup':>7} {'exact':>6}", cell)


def format_pair_goals(rows: list[dict], name: str = "nvfp4") -> str:
    """The shipped pair's goal figures from one pair-table run (tau at the longest / shortest output, greedy speedups,
    the T 0.7 speedup and greedy exactness; same run, medians over prompts)."""
    def cell(T, D, n):
        return next((r for r in rows if r["temperature"] == T and r["draft_length"] == D
                     and r["max_new_tokens"] == n), None)

    lines = [f"pair goals ({name} drafter, this run):"]
    lengths = sorted({r["max_new_tokens"] for r in rows})
    lo, hi = cell(0.0, 7, lengths[0]), cell(0.0, 7, lengths[-1])
    if lo and hi:
        lines.append(f"  tau at {lengths[-1]} / tau at {lengths[0]} tokens, greedy, D 7: "
                     f"{hi[name]['tau'] / lo[name]['tau']:.2f} (goal >= 0.80)")
    greedy7 = [cell(0.0, 7, n) for n in lengths]
    if all(greedy7):
        lines.append("  speedup, greedy, D 7: " + " / ".join(f"{r[name]['speedup']:.2f}x" for r in greedy7)
                     + f" at {' / '.join(map(str, lengths))} tokens (goal >= 1.3 each)")
    warm = cell(0.7, 7, lengths[0])
    if warm:
        lines.append(f"  speedup at T 0.7, D 7, {lengths[0]} tokens: {warm[name]['speedup']:.2f}x (goal > 1.0)")
    same, runs = exact_counts([r for r in rows if r["temperature"] == 0])
    if runs:
        lines.append(f"  greedy output identical to autoregressive: {same}/{runs} runs (goal 100%)")
    return "\n".join(lines)


ATTENTION_GGUF = ("attn_q", "attn_k", "attn_v", "attn_output")


def gguf_roundtrip(drafter: Drafter, folder, name: str = "drafter") -> tuple[Drafter, Drafter]:
    """(drafter -> save_gguf -> load, the same file with its attention `.scale` tensors overwritten with 1.0 -> load):
    the second is llama.cpp PR #28000's bug replayed through the file (the graph multiplied those weights by 1)."""
    folder = Path(folder)
    kw = dict(param_dtype=drafter.config.model.param_dtype, compute_dtype=drafter.config.model.compute_dtype)
    path = save_gguf(folder / f"{name}.gguf", drafter)
    bug = folder / f"{name}_attn_scale_1.gguf"
    bug.write_bytes(path.read_bytes())
    patch_scales(bug, lambda t: t.endswith(".scale") and t.split(".")[-2] in ATTENTION_GGUF, 1.0)
    return load_drafter_gguf(path, **kw), load_drafter_gguf(bug, **kw)


def replay_figures(result: dict, intact: str, broken: str) -> dict:
    """The bug report's figures from one `compare` result: tau and acceptance rate (accepted drafts / drafted
    tokens, the figure the report quotes: 25-36% -> 0.1-0.4%) of the intact and the broken drafter, and their ratios.

    tau counts the bonus token, so tau >= 1 and the tau ratio cannot fall below 1 / tau_intact (`tau_floor`): for a
    drafter with tau 1.24 even a drafter that never gets a token accepted scores 0.81x. The acceptance rate has no
    such floor; it is the figure that can show a collapse for every drafter, weak ones included."""
    a, b = result[intact], result[broken]
    acc_a, acc_b = a["acceptance_rate"], b["acceptance_rate"]
    return {"tau": (a["tau"], b["tau"]), "tau_ratio": b["tau"] / a["tau"], "tau_floor": 1.0 / a["tau"],
            "acceptance": (acc_a, acc_b), "counts": ((a.get("accepted"), a.get("drafted")),
                                                     (b.get("accepted"), b.get("drafted"))),
            "acceptance_ratio": acc_b / acc_a if acc_a > 0 else float("nan")}


def proposal_agreement(target: Target, intact: Drafter, broken: Drafter, prompts: Sequence[Sequence[int]], *,
                       new_tokens: int = 64, stride: int = 8) -> dict:
    """How far apart two drafters' proposals are, whatever their acceptance: on each prompt's greedy autoregressive
    answer (`new_tokens`), every `stride`-th answer position is an anchor; both drafters propose the block after it
    from the same target features (`draft_tokens`, no cache), and their greedy proposals are compared slot by slot
    with each other and with the answer's own next tokens. A broken drafter that still proposes what the intact one
    does cannot lose acceptance, however wrong its weights are."""
    cfg = intact.config
    bs = cfg.block_size
    n = agree = hit_a = hit_b = 0
    for p in prompts:
        ar = generate_autoregressive(target, [list(p)], max_new_tokens=new_tokens)
        seq = [int(t) for t in p] + [int(t) for t in ar.token_lists()[0]]
        _, feats = target_forward(target, jnp.asarray([seq], jnp.int32), cfg.target_layer_ids)  # [1, T, K*H]
        for c in range(len(p), len(seq) - bs + 1, stride):  # block at positions c..c+bs-1, anchor seq[c]
            block = np.full((1, bs), cfg.mask_token_id, np.int32)
            block[0, 0] = seq[c]
            a = np.asarray(draft_tokens(target, intact, feats[:, :c], jnp.asarray(block)))[0]  # [bs-1]
            b = np.asarray(draft_tokens(target, broken, feats[:, :c], jnp.asarray(block)))[0]
            truth = np.asarray(seq[c + 1:c + bs])
            n, agree = n + truth.size, agree + int((a == b).sum())
            hit_a, hit_b = hit_a + int((a == truth).sum()), hit_b + int((b == truth).sum())
    return {"slots": n, "agree": agree / max(n, 1), "intact_hits": hit_a / max(n, 1), "broken_hits": hit_b / max(n, 1),
            "new_tokens": new_tokens, "stride": stride}


def format_proposal_agreement(d: dict) -> str:
    if not d["slots"]:
        return f"no block fits in {d['new_tokens']}-token answers (nothing compared)"
    return (f"greedy proposals agree on {100 * d['agree']:.1f}% of {d['slots']} block slots (anchors every "
            f"{d['stride']} tokens of the {d['new_tokens']}-token greedy answers); proposal == the answer's token: "
            f"intact {100 * d['intact_hits']:.1f}%, broken {100 * d['broken_hits']:.1f}%")


REPLAY_GOAL = 0.3  # dropped attention scales must cut the intact file's figure to at most 0.3x (a visible failure)


def format_replay(fig: dict) -> str:
    """One replay line: acceptance rate and tau, intact -> broken, ratios against the 0.3x goal (acceptance rate:
    the figure with no floor; tau: shown with its floor 1 / tau_intact)."""
    def counts(c):
        return f" ({c[0]}/{c[1]})" if c[0] is not None else ""
    (acc_a, acc_b), (tau_a, tau_b), (ca, cb) = fig["acceptance"], fig["tau"], fig["counts"]
    ok = fig["acceptance_ratio"] <= REPLAY_GOAL
    return (f"acceptance rate {100 * acc_a:.2f}%{counts(ca)} -> {100 * acc_b:.2f}%{counts(cb)} = "
            f"{fig['acceptance_ratio']:.2f}x (goal <= {REPLAY_GOAL}x: {'met' if ok else 'NOT met'}); tau {tau_a:.3f} "
            f"-> {tau_b:.3f} = {fig['tau_ratio']:.2f}x (floor 1/tau {fig['tau_floor']:.2f}x)")


def format_gguf_goals(results: list[dict], same_tokens: dict) -> str:
    """The GGUF bench's goals: the round trip keeps tau and output; the attention scales set to 1 collapse the
    acceptance rate (and tau, down to its floor of 1 token per step)."""
    lines = ["GGUF goals (this run):"]
    for r in results:
        for kind in ("", "dflash2 "):
            if f"{kind}nvfp4" not in r:
                continue
            t = {n: r[n]["tau"] for n in (f"{kind}nvfp4", f"{kind}nvfp4 gguf")}
            fig = replay_figures(r, f"{kind}nvfp4 gguf", f"{kind}nvfp4 gguf attn scale=1")
            lines.append(f"  {r['max_new_tokens']:>5} new tok, D {r['draft_length']}, {kind or 'dflash '}nvfp4: tau "
                         f"{t[f'{kind}nvfp4']:.3f} in memory vs {t[f'{kind}nvfp4 gguf']:.3f} read back from GGUF "
                         f"(goal: equal)")
            lines.append(f"      attention .scale = 1 vs intact GGUF: {format_replay(fig)}")
    for name, same in same_tokens.items():
        lines.append(f"  {name}: greedy tokens identical to the in-memory drafter's on every prompt: {same}")
    return "\n".join(lines)


def bf16_exactness(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   draft_length: int | None = None) -> dict:
    """Greedy speculative vs greedy autoregressive, one batched call each, whole budgets (no EOS).

    In float32 the two agree token for token (the tests hold it). In bfloat16 compute they may not: verify runs D+1
    tokens through one matmul where autoregressive decoding runs one, so the two see different roundings, and a
    near-tie of the target's top two logits can flip. Returns the fraction of rows that differ anywhere, the first
    divergence position of those rows (median, min), and the fraction of token positions that agree."""
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=(), prefill_timing=PREFILL_TIMING)
    rows = [list(p) for p in prompts]
    t0 = time.perf_counter()
    ar = generate_autoregressive(target, rows, **kw)
    sp = generate(target, drafter, rows, draft_length=draft_length, **kw)
    a, s = ar.tokens, sp.tokens  # [B, N] each, whole budgets
    differ = (a != s)
    first = [int(np.argmax(d)) for d in differ if d.any()]
    out = {"rows": len(rows), "max_new_tokens": max_new_tokens, "dtype": str(jnp.dtype(target.config.dtype)),
           "mismatch_rate": float(differ.any(axis=1).mean()), "rows_differing": len(first),
           "first_divergence_median": float(np.median(first)) if first else None,
           "first_divergence_min": int(min(first)) if first else None,
           "token_agreement": float((~differ).mean()), "tau": sp.tau, "wall_s": time.perf_counter() - t0}
    return out


def format_bf16_exactness(d: dict) -> str:
    div = (f"first divergence at token {d['first_divergence_median']:.0f} (median of the differing rows), "
           f"{d['first_divergence_min']} (min)" if d["rows_differing"] else "no divergence")
    return (f"greedy speculative vs autoregressive, {d['dtype']} compute, {d['rows']} rows x {d['max_new_tokens']} "
            f"tokens: mismatch rate {100 * d['mismatch_rate']:.1f}% of rows ({d['rows_differing']}/{d['rows']}); "
            f"{div}; {100 * d['token_agreement']:.1f}% of token positions agree; tau {d['tau']:.2f}")
