"""Speculative vs autoregressive decoding end to end, measured in one run, medians over prompts.

`compare`: for each prompt (batch 1) the autoregressive and the DFlash tokens/s of the decode loop (prefill excluded,
as z-lab's TPOT), tau and acceptance; medians over the prompt set. The tables built on it: tau per draft length
(`tau_table`), the pair grid (`pair_table`), step costs against measured speedup (`step_table`, with `step_costs`),
and greedy exactness in bfloat16 (`bf16_exactness`). Timings are never asserted anywhere: these machines are noisy,
so read the medians.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.step_costs import step_costs
from dflash_jax.decode.draft_length import running_cpu_kernel, target_signature
from dflash_jax.decode.programs import generate, generate_autoregressive
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.step_table import StepRow, StepTable

# Benchmarks run with the persistent compilation cache on (cli.py), which never stores a program with a host
# callback: prefill is timed by a prefill-only rerun of the same compiled program instead of a callback stamp.
PREFILL_TIMING = "rerun"


def compare(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
            draft_length: int | None = None, eos_ids=(), warmup: bool = True, drafters: dict | None = None,
            temperature: float = 0.0, seed: int = 0, tree_budget: int | None = None,
            context_lookup: int | None = None, top_p: float = 1.0, top_k: int = 0) -> dict:
    """Per prompt (batch 1): AR and DFlash decode tokens/s, tau, acceptance. Medians over prompts.

    `drafters` may name extra drafters (e.g. {"nvfp4": q}) measured on the same prompts in the same run.
    tree_budget: every drafter drafts trees of that many nodes (draft_length then stays None); context_lookup: the
    steps' (`GenerationOptions.context_lookup`; None: generate's default); top_p / top_k: the sampling filters at
    temperature > 0 (both runs).
    """
    drafters = {"dflash": drafter, **(drafters or {})}
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature, seed=seed,
              top_p=top_p, top_k=top_k, prefill_timing=PREFILL_TIMING)
    # neither a draft length nor a tree budget: the step table's best row, speculating even where the table predicts
    # no gain (generate would then decode plainly, and there would be no drafts to measure)
    spec = (dict(draft_length=draft_length) if tree_budget is None else dict(tree_budget=tree_budget))
    spec.update(context_lookup=context_lookup, plain_when_slower=False)
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
            r["context_lookup"] = res.context_lookup
            r["layout"] = (res.draft_length, res.tree_budget)  # as given, or generate's own choice
            r["tps"].append(res.decode_tokens_per_second)
            acc = res.acceptance_lengths[res.acceptance_lengths > 0]
            r["tau_steps"].extend(acc.tolist())
            r["acc"].append(res.acceptance_rate)
            r.setdefault("exact", []).append(bool(np.array_equal(res.tokens[0], ar.tokens[0])))
            r.setdefault("position", []).append(res.position_acceptance)
    D, tree_budget = rows["dflash"]["layout"]  # as the first drafter ran: a tree's D is its depth
    out = {"max_new_tokens": max_new_tokens, "draft_length": D, "prompts": len(prompts), "temperature": temperature,
           "top_p": top_p, "top_k": top_k, "ar_tokens_per_s": statistics.median(ar_tps), "tree_budget": tree_budget}
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
            "context_lookup": r.get("context_lookup", 0),
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


def compare_batched(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, batch: int,
                    max_new_tokens: int, draft_length: int | None = None, eos_ids=(),
                    context_lookup: int | None = None, temperature: float = 0.0, seed: int = 0) -> dict:
    """`batch` prompts per call (groups of the prompt list, each call warmed up first): autoregressive and DFlash
    decode tokens/s summed over each call's rows, medians over calls; tau over every step of every row."""
    groups = [[list(p) for p in prompts[i:i + batch]] for i in range(0, len(prompts) - batch + 1, batch)]
    if not groups:
        raise ValueError(f"batch {batch} needs at least {batch} prompts, got {len(prompts)}")
    kw = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, prefill_timing=PREFILL_TIMING, temperature=temperature,
              seed=seed)
    generate_autoregressive(target, groups[0], **kw)
    generate(target, drafter, groups[0], draft_length=draft_length, context_lookup=context_lookup, **kw)
    ar_tps, sp_tps, steps, exact = [], [], [], 0
    for g in groups:
        ar = generate_autoregressive(target, g, **kw)
        sp = generate(target, drafter, g, draft_length=draft_length, context_lookup=context_lookup, **kw)
        ar_tps.append(ar.decode_tokens_per_second)
        sp_tps.append(sp.decode_tokens_per_second)
        steps.extend(sp.acceptance_lengths[sp.acceptance_lengths > 0].tolist())
        exact += sum(a == b for a, b in zip(ar.token_lists(), sp.token_lists()))
    n = len(groups) * batch
    return {"ar_tokens_per_s": statistics.median(ar_tps),
            "dflash": {"tokens_per_s": statistics.median(sp_tps), "tau": float(np.mean(steps)),
                       "speedup": statistics.median(sp_tps) / statistics.median(ar_tps), "exact_match": f"{exact}/{n}",
                       "context_lookup": sp.context_lookup}}


def step_table(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, draft_lengths=(1, 3, 7),
               draft_vocabs=None, batches=(1,), max_new_tokens: int = 128, context_len: int = 256,
               reps: int = 30, draft_passes=None, context_lookup: int | None = None, temperature: float = 0.0,
               seed: int = 0) -> list[dict]:
    """What a step costs and what it buys, per (draft length, draft vocabulary, draft pass, batch): r and c
    (interleaved step costs at `context_len`, with `batch` rows), tau, the speedup they predict (tau / (r + c)) and
    the speedup measured on the same prompts in the same run (medians, greedy, each against the autoregressive runs
    of its own `compare`). The draft vocabulary is the drafter config's `draft_vocab_size` (None: the whole
    vocabulary); draft_vocabs None measures the drafter's own only; sizes at or above the vocabulary are skipped.
    draft_passes: the `DrafterConfig.draft_pass` values to measure ("block", "drafted"; None: the drafter's own).
    context_lookup: the chain rows' (`GenerationOptions.context_lookup`; None: generate's default for a chain, off),
    recorded in each row: generate runs a chain row with it. temperature > 0: tau and the measured speedup from
    sampled runs (`seed`), the rows marked so (`StepRow.temperature`: generate ranks a sampled run's choices by
    them); r and c are the target's and drafter's passes, the same programs at every temperature."""
    variants = _variants(drafter, draft_vocabs, draft_passes)
    name = {k: " / ".join(_labels(k)) for k in variants}
    rows = []
    for b in batches:
        for D in draft_lengths:
            if b == 1:
                first, *rest = variants
                res = compare(target, variants[first], prompts, max_new_tokens=max_new_tokens, draft_length=D,
                              drafters={name[k]: variants[k] for k in rest}, context_lookup=context_lookup,
                              temperature=temperature, seed=seed)
                measured = {k: res["dflash" if k == first else name[k]] for k in variants}
            else:
                measured = {k: compare_batched(target, d, prompts, batch=b, max_new_tokens=max_new_tokens,
                                               draft_length=D, context_lookup=context_lookup,
                                               temperature=temperature, seed=seed)["dflash"]
                            for k, d in variants.items()}
            for k, d in variants.items():
                c, x = step_costs(target, d, context_len=context_len, draft_length=D, batch=b, reps=reps), measured[k]
                rows.append({"draft_length": D, "tree_budget": None, "draft_vocab": _labels(k)[0],
                             "draft_vocab_size": k[0], "draft_pass": k[1], "batch": b,
                             "r": c["r"], "c": c["c"], "decode_ms": c["decode_ms"], "verify_ms": c["verify_ms"],
                             "draft_ms": c["draft_ms"], "tau": x["tau"], "predicted": x["tau"] / (c["r"] + c["c"]),
                             "speedup": x["speedup"], "exact_match": x["exact_match"],
                             "context_lookup": x.get("context_lookup", 0), "max_new_tokens": max_new_tokens,
                             "temperature": temperature})
    return rows


def pool_verify_costs(rows: list[dict]) -> list[dict]:
    """Rows whose verify is the same program (same batch, draft length and tree budget: the target's pass does not
    depend on the drafter's vocabulary or draft pass) get one r, the mean of their measurements, and their prediction
    again: so rows that differ only in the draft differ only in c. Why: two timings of the same verify on a shared CPU
    differ by several percent (57.5 and 61.6 ms at D 1 in one run, r 1.22 and 1.31), more than a shorter draft pass
    saves (c 0.15 -> 0.11), and the ranking must not follow that noise."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.get("batch", 1), r["draft_length"], r.get("tree_budget")), []).append(r)
    out = []
    for r in rows:
        same = groups[(r.get("batch", 1), r["draft_length"], r.get("tree_budget"))]
        pooled = statistics.fmean(x["r"] for x in same)
        verify = statistics.fmean(x["verify_ms"] for x in same)
        out.append({**r, "r": pooled, "verify_ms": verify, "predicted": r["tau"] / (pooled + r["c"]),
                    "verify_timings": len(same)})
    return out


def _variants(drafter: Drafter, draft_vocabs, draft_passes) -> dict:
    """{(draft vocabulary, draft pass): the drafter set so} for a step table's rows."""
    V = drafter.config.model.vocab_size
    own = drafter.config.draft_vocab_size
    vocabs = (own,) if draft_vocabs is None else tuple(draft_vocabs)
    passes = (drafter.config.draft_pass or "block",) if draft_passes is None else tuple(draft_passes)
    return {(n, p): drafter.replace(config=drafter.config.replace(draft_vocab_size=n, draft_pass=p))
            for n in dict.fromkeys(vocabs) if n is None or n < V for p in dict.fromkeys(passes)}


def _labels(key) -> tuple[str, str]:
    n, p = key
    return ("full" if n is None else f"first {n}"), p


def as_step_table(rows: list[dict], target: Target, note: str = "") -> StepTable:
    """The measured rows as the table `generate` reads (`dflash_jax.step_table`) for this platform and target."""
    return StepTable(platform=jax.default_backend(), target=target_signature(target), note=note,
                     cpu_kernel=running_cpu_kernel() or "",
                     rows=tuple(StepRow(draft_length=r["draft_length"], draft_vocab=r["draft_vocab_size"],
                                        tau=round(float(r["tau"]), 4), r=round(float(r["r"]), 4),
                                        c=round(float(r["c"]), 4), batch=int(r["batch"]),
                                        tree_budget=r.get("tree_budget"), draft_pass=r.get("draft_pass", "block"),
                                        context_lookup=int(r.get("context_lookup", 0)),
                                        temperature=float(r.get("temperature", 0.0)))
                           for r in rows))


def format_step_table(rows: list[dict]) -> str:
    """One line per row: chain rows (tree "-") and draft-tree rows (`bench.tree.tree_rows`: tree = N nodes, D = the
    tree's depth, verify = root + N nodes, draft = the drafter pass + the tree's construction); pass = the block the
    draft pass read (`DrafterConfig.draft_pass`: "block" the whole block, "drafted" the drafted slots only)."""
    lines = [f"{'batch':>5} {'tree':>4} {'D':>3} {'pass':>7} {'draft vocab':>12} {'verify ms':>9} {'draft ms':>8} "
             f"{'r':>5} {'c':>5} {'r+c':>5} {'tau':>5} {'tau/(r+c)':>9} {'measured':>8} {'exact':>6}", "-" * 109]
    for r in rows:
        tree = "-" if r.get("tree_budget") is None else str(r["tree_budget"])
        lines.append(f"{r.get('batch', 1):>5} {tree:>4} {r['draft_length']:>3} {r.get('draft_pass', 'block'):>7} "
                     f"{r['draft_vocab']:>12} "
                     f"{r['verify_ms']:>9.2f} "
                     f"{r['draft_ms']:>8.2f} "
                     f"{r['r']:>5.2f} {r['c']:>5.2f} {r['r'] + r['c']:>5.2f} {r['tau']:>5.2f} "
                     f"{r['predicted']:>8.2f}x {r['speedup']:>7.2f}x "
                     f"{r['exact_match'] if not r.get('temperature') else '-':>6}")
    decode = statistics.median(r["decode_ms"] for r in rows if r.get("batch", 1) == rows[0].get("batch", 1))
    if any(r.get("verify_timings", 1) > 1 for r in rows):
        lines.append("r, verify ms: the mean over the rows that share a verify (same batch and D or tree; "
                     "`pool_verify_costs`)")
    lines.append(f"decode (1 token per row) median {decode:.2f} ms at batch {rows[0].get('batch', 1)}; r = verify / "
                 f"decode, c = draft / decode (interleaved medians); 'measured' = decode tokens/s speculative / "
                 f"autoregressive, medians over prompts")
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
                         "position_acceptance": res.position_acceptance,
                         "steps": int((res.acceptance_lengths > 0).sum())})
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
               draft_lengths=(7, 15), temperatures=(0.0, 0.7), seed: int = 0, tree_budgets=(), top_p: float = 1.0,
               top_k: int = 0) -> list[dict]:
    """The shipped pair's summary grid: for each temperature and setting (a chain of each draft length, then a draft
    tree of each budget), `compare` at every output length with all `drafters` (e.g. dense and NVFP4) on the same
    prompts; one autoregressive baseline per cell. top_p / top_k: the sampling filters of the sampled rows."""
    (first, d0), *rest = drafters.items()
    settings = [dict(draft_length=D) for D in draft_lengths] + [dict(tree_budget=b) for b in tree_budgets]
    settings = settings or [{}]  # neither: generate's own choice (the step table's best row)
    rows = []
    for temperature in temperatures:
        for spec in settings:
            for n in new_tokens:
                r = compare(target, d0, prompts, max_new_tokens=n, drafters=dict(rest), temperature=temperature,
                            seed=seed, top_p=top_p, top_k=top_k, **spec)
                r["default"] = not spec
                r[first] = r.pop("dflash")  # `compare` names its first drafter "dflash"
                rows.append(r)
    return rows


def setting_label(row: dict) -> str:
    """'D 7' for a chain of 7 drafts, 'tree 4' for a draft tree of 4 nodes; 'default: D 1' for generate's choice."""
    label = f"tree {row['tree_budget']}" if row.get("tree_budget") else f"D {row['draft_length']}"
    return f"default: {label}" if row.get("default") else label


def format_pair_table(rows: list[dict], names: Sequence[str]) -> str:
    def cell(r, n):
        x = r[n]
        exact = x["exact_match"] if r["temperature"] == 0 else "-"
        return f" | {x['tau']:>12.2f} {x['speedup']:>6.2f}x {exact:>6}"

    return _drafter_table(
        rows, names, f"{'T':>4} {'draft':>7} {'new tok':>8} {'AR tok/s':>9}",
        lambda r: (f"{r['temperature']:>4.1f} {setting_label(r):>7} {r['max_new_tokens']:>8} "
                   f"{r['ar_tokens_per_s']:>9.1f}"),
        lambda n: f" | {n + ' tau':>12} {'speedup':>7} {'exact':>6}", cell)


def format_pair_goals(rows: list[dict], name: str = "nvfp4") -> str:
    """The shipped pair's goal figures from one pair-table run, per setting (chain length or tree budget): tau at the
    longest / shortest output, greedy speedups, the T 0.7 speedup; and greedy exactness (same run, medians over
    prompts)."""
    def cell(T, label, n):
        return next((r for r in rows if r["temperature"] == T and setting_label(r) == label
                     and r["max_new_tokens"] == n), None)

    lines = [f"pair goals ({name} drafter, this run):"]
    lengths = sorted({r["max_new_tokens"] for r in rows})
    for label in dict.fromkeys(setting_label(r) for r in rows):
        lo, hi = cell(0.0, label, lengths[0]), cell(0.0, label, lengths[-1])
        if lo and hi and len(lengths) > 1:
            lines.append(f"  tau at {lengths[-1]} / tau at {lengths[0]} tokens, greedy, {label}: "
                         f"{hi[name]['tau'] / lo[name]['tau']:.2f} (goal >= 0.80)")
        greedy = [cell(0.0, label, n) for n in lengths]
        if all(greedy):
            lines.append(f"  speedup, greedy, {label}: " + " / ".join(f"{r[name]['speedup']:.2f}x" for r in greedy)
                         + f" at {' / '.join(map(str, lengths))} tokens (goal >= 1.3 each)")
        warm = [r for r in (cell(0.7, label, n) for n in lengths) if r]
        if warm:
            lines.append(f"  speedup at T 0.7, {label}: " + " / ".join(f"{r[name]['speedup']:.2f}x" for r in warm)
                         + f" at {' / '.join(str(r['max_new_tokens']) for r in warm)} tokens (goal >= 1.1)")
    same, runs = exact_counts([r for r in rows if r["temperature"] == 0])
    if runs:
        lines.append(f"  greedy output identical to autoregressive: {same}/{runs} runs (goal 100%)")
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


__all__ = ["compare", "pool_verify_costs", "format_compare_table", "format_dflash2_goals", "exact_counts", "step_table",
           "format_step_table", "tau_table", "format_tau_table", "pair_table", "format_pair_table", "format_pair_goals",
           "bf16_exactness", "format_bf16_exactness", "PREFILL_TIMING"]
