"""`dflash-jax bench`: each of its modes on the shipped models (the argument parser is `dflash_jax.cli`'s).

    (no mode)          speculative vs autoregressive at each --new-tokens, per-step costs, per-position acceptance
    --nvfp4            the same with NVFP4 drafters (with and without tensor scales) and DFlash2 rows when the model
                       has a DFlash2 drafter
    --tau-table        tau per draft length (+ NVFP4 variants with --nvfp4)
    --pair-table       dense and NVFP4 drafter: tau and speedup per draft length and temperature
    --step-table       r, c, tau and speedups per draft length, draft vocabulary and batch, and per draft-tree budget
    --gguf-roundtrip   NVFP4 drafters through GGUF files, intact and with attention scales set to 1
    --bf16-exactness   greedy speculative vs autoregressive in bfloat16 compute
    --random-tiny      per-step cost split on random tiny models
    --device-report    the prepared GPU run (`device_report`)

Every default follows the drafters loaded: a draft length D must fit a drafter's block (D <= block_size - 1), so the
tables' draft lengths are those of their preferred lengths (3/7/15, 7/15, 1/3/7) every drafter's block holds, and a
single-length mode defaults to the blocks' longest draft (at most 7 with --nvfp4, the original report's setting). An
explicit --draft-length that a block cannot hold is refused before anything runs.
"""

from __future__ import annotations

import datetime
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

from dflash_jax.bench import device_report, gguf_replay
from dflash_jax.bench import speculative as bench
from dflash_jax.bench import tree as tree_bench
from dflash_jax.bench.step_costs import draft_costs, format_draft_costs, format_step_costs, step_costs
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decode.draft_length import predicts_no_gain, running_cpu_kernel
from dflash_jax.decode.lookup import DEFAULT_MIN_MATCH
from dflash_jax.decode.prepare import check_context_lookup
from dflash_jax.decode.programs import generate, with_draft_pass
from dflash_jax.io.audit_file import audit_file
from dflash_jax.io.checkpoint import load_drafter
from dflash_jax.io.shipped import DRAFTER_FOLDERS, checkpoints_dir, default_model, load_default
from dflash_jax.io.step_table_file import write_step_table
from dflash_jax.models.calibrate import calibrate_drafter
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.target import init_target
from dflash_jax.params import param_bytes
from dflash_jax.quant.products import generation_products
from dflash_jax.quant.quantize import (ATTENTION_PROJECTIONS, DFLASH2_PROJECTIONS, drop_global_scales,
                                       quantize_nvfp4)
from dflash_jax.step_table import StepTable
from dflash_jax.train import corpus
from dflash_jax.train.drafter_data import chat_prompt_ids

TREE_BUDGETS = (4, 8, 16, 32)  # --step-table's draft-tree rows unless --tree-budgets names others


def draft_lengths(drafters, preferred: tuple[int, ...]) -> tuple[int, ...]:
    """The `preferred` draft lengths every drafter's block holds, or, when none fits, the longest all of them hold."""
    longest = min(d.config.block_size for d in drafters) - 1
    return tuple(D for D in preferred if 1 <= D <= longest) or (longest,)


def check_draft_length(draft_length: int | None, drafters) -> None:
    """An explicit --draft-length must fit every drafter's block: refused naming the block size otherwise."""
    if draft_length is None:
        return
    block = min(d.config.block_size for d in drafters)
    if not 1 <= draft_length <= block - 1:
        raise SystemExit(f"error: --draft-length {draft_length}: the drafter's block holds {block} tokens (the anchor "
                         f"and {block - 1} drafts), so 1..{block - 1}")


def run(args):
    """The bench the parsed `args` ask for (see the module docstring)."""
    if args.bf16_exactness:
        return bf16_exactness(args)
    args.prompts = 8 if args.prompts is None else args.prompts
    args.new_tokens = [128, 512, 1024] if args.new_tokens is None else args.new_tokens
    if args.device_report:
        return device_report.main((["--smoke"] if args.smoke else []) + (["--out", args.out] if args.out else []))
    if args.random_tiny:
        return random_tiny(args)
    target, drafter, tok = load_default(model=args.model)
    prompts = heldout_prompts(tok, args.prompts, args.seed)
    if args.draft_vocab is not None:
        drafter = with_draft_vocab(drafter, args.draft_vocab)
    check_draft_length(args.draft_length, [drafter])
    if args.step_table:
        return step_table(args, target, drafter, prompts)
    if args.tau_table:
        return tau_table(args, target, drafter, tok, prompts)
    if args.pair_table:
        return pair_table(args, target, drafter, prompts)
    if args.gguf_roundtrip:
        return gguf_roundtrip(args, target, drafter, prompts)
    return speculative_vs_autoregressive(args, target, drafter, prompts)


def step_table(args, target, drafter, prompts):
    lengths = (args.draft_length,) if args.draft_length else draft_lengths([drafter], (1, 3, 7))
    vocabs = None if args.draft_vocabs is None else [None if n == 0 else n for n in args.draft_vocabs]
    bad = [b for b in args.batches if not 1 <= b <= len(prompts)]
    if bad:
        raise SystemExit(f"--batches {bad}: each batch must be in 1..--prompts ({len(prompts)})")
    passes = None if args.draft_passes is None else tuple(dict.fromkeys(args.draft_passes))
    if passes and "drafted" in passes and drafter.config.is_dflash2:
        raise SystemExit("--draft-passes drafted: a DFlash2 drafter drafts over its whole block (its convolution runs "
                         "along it); measure it with --draft-passes block")
    own = 0 if drafter.config.is_dflash2 else DEFAULT_MIN_MATCH  # the chain rows' lookup, unless told
    lookup = check_context_lookup(own if getattr(args, "chain_lookup", None) is None else args.chain_lookup, None,
                                  drafter.config.is_dflash2)
    T = args.temperature or 0.0  # > 0: tau and the measured speedups from sampled runs, the rows marked so
    if T and (args.top_p != 1.0 or args.top_k):
        raise SystemExit("--step-table --temperature: rows are measured with temperature alone (generate ranks every "
                         "sampled run's choices by them); drop --top-p / --top-k")
    rows = bench.step_table(target, drafter, prompts, draft_lengths=lengths, draft_vocabs=vocabs,
                            batches=tuple(args.batches), max_new_tokens=args.new_tokens[0], reps=args.reps,
                            draft_passes=passes, context_lookup=lookup, temperature=T, seed=args.seed)
    budgets = tuple(TREE_BUDGETS if args.tree_budgets is None else args.tree_budgets)
    budgets = budgets if not drafter.config.is_dflash2 else ()
    for p in passes or (drafter.config.draft_pass,):
        d = drafter if p is None else with_draft_pass(drafter, p)
        rows += tree_bench.tree_rows(target, d, prompts, budgets=budgets, max_new_tokens=args.new_tokens[0],
                                     reps=args.reps, temperature=T, seed=args.seed)
    rows = bench.pool_verify_costs(rows)
    how = f"T {T:g} (seed {args.seed})" if T else "greedy"
    print(f"{len(prompts)} held-out prompts, {args.new_tokens[0]} new tokens, {how}, batches {args.batches} (draft "
          f"trees: batch 1), one run{_products()}")
    print(bench.format_step_table(rows))
    if budgets and not T:  # the tree goals are greedy figures
        own = [r for r in rows if r["draft_vocab_size"] == drafter.config.draft_vocab_size and r["batch"] == 1]
        print(tree_bench.format_tree_goals(own))
    if args.save_table is not None:
        folder = Path(args.save_table) if args.save_table else checkpoints_dir() / (
            "smollm2" if (args.model or default_model()) == "smollm2" else "") / DRAFTER_FOLDERS["dflash"]
        note = (f"dflash-jax bench --step-table: {len(prompts)} held-out prompts x {args.new_tokens[0]} tokens, "
                f"{how}, reps {args.reps}, {datetime.date.today().isoformat()}")
        path = write_step_table(folder, bench.as_step_table(rows, target, note=note))
        table = StepTable.from_dict(json.loads(path.read_text()))  # as written: other temperatures' rows kept
        best = table.best(drafter.config.draft_vocab_size, draft_pass=drafter.config.draft_pass, sampled=T > 0)
        choice = best and ((f"a draft tree of {best.tree_budget} nodes" if best.tree_budget else
                            f"draft length {best.draft_length}")
                           + (", drafting over the drafted slots only" if best.draft_pass == "drafted" else ""))
        if best is None:
            print(f"wrote {path} (no row for the drafter's draft vocabulary)")
        elif predicts_no_gain(best):  # generate's plain_when_slower: no gain beyond the table's noise margin
            # three decimals: a prediction just below 1 must not print as "1.00x"
            print(f"wrote {path}: generate decodes plainly for this pair on {table.platform}"
                  f"{' when sampling' if T else ''} at batch 1 (its best row, {choice}, predicts "
                  f"{best.predicted_speedup:.3f}x: within the table's noise margin of plain decoding)")
        else:
            print(f"wrote {path}: generate's default for this pair on {table.platform}{' when sampling' if T else ''} "
                  f"is now {choice} (predicted {best.predicted_speedup:.2f}x)")
    return rows


def random_tiny(args):
    """Random tiny models: the loop's ms per step split into draft, verify and bookkeeping, and r, c."""
    cfg = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    dcfg = DrafterConfig(model=cfg.replace(num_hidden_layers=2), block_size=16, mask_token_id=511,
                         target_layer_ids=(1, 2, 3), num_target_layers=6)
    target, drafter = init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))
    print(f"random tiny models: target {cfg.num_hidden_layers} layers H={cfg.hidden_size} V={cfg.vocab_size}; "
          f"drafter {dcfg.model.num_hidden_layers} layers, block {dcfg.block_size}")
    check_draft_length(args.draft_length, [drafter])
    prompt = [list(np.random.default_rng(0).integers(0, 511, 64))]
    for D in (args.draft_length or 7, 15):
        kw = dict(max_new_tokens=256, draft_length=D, prefill_timing="rerun")
        res = generate(target, drafter, prompt, **kw)
        res = generate(target, drafter, prompt, **kw)
        step_ms = 1e3 * res.timings["decode_s"] / max(res.num_steps, 1)
        costs = step_costs(target, drafter, context_len=64 + 128, draft_length=D)
        print(format_step_costs(costs, tau=res.tau, measured_step_ms=step_ms))
        print()


def speculative_vs_autoregressive(args, target, drafter, prompts):
    """The default table (and --nvfp4's rows), then step costs and per-position acceptance."""
    extra, names, names2 = {}, ["dflash"], []
    dflash2 = None
    if args.nvfp4:
        q = quantize_nvfp4(drafter)
        extra = {"nvfp4 no-scale": drop_global_scales(q), "nvfp4": q}
        names += list(extra)
        dflash2 = dflash2_drafter(args)
        if dflash2 is not None:
            q2 = quantize_nvfp4(dflash2)
            # "no-scale": the report's bug (attention scales dropped); "no conv/sel scale": only DFlash2's own
            # projections without their tensor scales (llama.cpp still runs those unscaled: its PR #28000 scaled
            # only the attention projections)
            rows2 = {"dflash2": dflash2, "dflash2 nvfp4": q2,
                     "dflash2 nvfp4 no-scale": drop_global_scales(q2, ATTENTION_PROJECTIONS),
                     "dflash2 nvfp4 no conv/sel scale": drop_global_scales(q2, DFLASH2_PROJECTIONS)}
            extra.update(rows2)
            names2 = list(rows2)
    every = [drafter] + ([dflash2] if dflash2 is not None else [])
    check_draft_length(args.draft_length, every)
    D = args.draft_length or draft_lengths(every, (7,) if args.nvfp4 else (drafter.config.block_size - 1,))[0]
    print(f"embedded models, {len(prompts)} held-out stdlib prompts, batch 1, greedy, draft length {D} (block "
          f"{drafter.config.block_size}); decode tokens/s exclude prefill and compile; medians over prompts; one run")
    if args.temperature:
        print(f"temperature {args.temperature}{_filters(args)}: rejection sampling; 'exact' compares with one AR "
              "sample (not expected to match)")
    results = []
    for n in args.new_tokens:
        results.append(bench.compare(target, drafter, prompts, max_new_tokens=n, draft_length=D, drafters=extra,
                                     temperature=args.temperature, seed=args.seed, top_p=args.top_p,
                                     top_k=args.top_k))
    print(bench.format_compare_table(results, names))
    if names2:
        print()
        print("DFlash2 drafter (same prompts, same run):")
        print(bench.format_compare_table(results, names2))
    costs = step_costs(target, drafter, context_len=256, draft_length=D)
    print()
    print(format_step_costs(costs, tau=results[0]["dflash"]["tau"]))
    print("acceptance rate per block position (first table row): "
          + " ".join(f"{x:.2f}" for x in results[0]["dflash"]["position_acceptance"]))
    if names2:
        print("DFlash2 acceptance rate per block position (first table row): "
              + " ".join(f"{x:.2f}" for x in results[0]["dflash2"]["position_acceptance"]))
        dc = draft_costs(target, {"dflash": drafter, "dflash2": dflash2}, context_len=256, draft_length=D,
                         clock="cpu")
        print(format_draft_costs(dc))
        print(bench.format_dflash2_goals(results, dc))


def heldout_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Held-out prompts for the benches: requests through the chat template for an instruct model (never trained
    on: the held-out split of `train.instructions`), held-out code otherwise."""
    if getattr(tok, "chat_template", None):
        return chat_prompt_ids(tok, n, split="eval", seed=seed)
    return [tok.encode(t) for t in corpus.held_out_prompts(n, seed=seed)]


def bf16_exactness(args):
    target, drafter, tok = load_default(model=args.model, compute_dtype="bfloat16")
    n = 32 if args.prompts is None else args.prompts
    new = 256 if args.new_tokens is None else args.new_tokens[0]
    prompts = heldout_prompts(tok, n, args.seed)
    d = bench.bf16_exactness(target, drafter, prompts, max_new_tokens=new, draft_length=args.draft_length)
    print(bench.format_bf16_exactness(d) + f" ({d['wall_s']:.0f} s)")
    return d


def _filters(args) -> str:
    """The sampling filters of a sampled run, as the header names them (empty when off)."""
    parts = ([f"top-p {args.top_p}"] if args.top_p < 1 else []) + ([f"top-k {args.top_k}"] if args.top_k else [])
    return f" with {', '.join(parts)}" if parts else ""


def _products() -> str:
    """The products a GGUF target's generation takes here, as the headers name them (empty off the CPU kernel)."""
    build = running_cpu_kernel()
    return f"; {generation_products()} products (CPU kernel: {build})" if build else ""


def pair_table(args, target, drafter, prompts):
    # a setting named (a draft length, tree budgets) or, with neither, generate's own choice (its step table's best)
    lengths = (args.draft_length,) if args.draft_length else ()
    temps = (args.temperature,) if args.temperature is not None else (0.0, 0.7)
    print(f"embedded pair, {len(prompts)} held-out prompts, batch 1, dense and NVFP4 (RTN) DFlash drafter; decode "
          f"tokens/s exclude prefill and compile; speedup = median drafter tok/s / median AR tok/s, same run; at T > 0 "
          f"rejection sampling{_filters(args)} (output not expected to equal the AR sample){_products()}")
    budgets = () if args.tree_budgets is None or drafter.config.is_dflash2 else tuple(args.tree_budgets)
    rows = bench.pair_table(target, {"dense": drafter, "nvfp4": quantize_nvfp4(drafter)}, prompts,
                            new_tokens=args.new_tokens, draft_lengths=lengths, temperatures=temps, seed=args.seed,
                            tree_budgets=budgets, top_p=args.top_p, top_k=args.top_k)
    print(bench.format_pair_table(rows, ("dense", "nvfp4")))
    print(bench.format_pair_goals(rows))


def dflash2_drafter(args):
    """The DFlash2 drafter for the bench: --dflash2 PATH, else the one shipped for the bench's model (code-5m:
    checkpoints/drafter2, smollm2: checkpoints/smollm2/drafter2), else None (with a note). Never another model's:
    a drafter reads its own target's hidden states."""
    model = getattr(args, "model", None) or default_model()
    root = checkpoints_dir() / "smollm2" if model == "smollm2" else checkpoints_dir()
    path = args.dflash2 or root / "drafter2"
    try:
        d = load_drafter(path)
    except FileNotFoundError:
        print(f"(no DFlash2 drafter at {path}: DFlash2 rows skipped; train one with "
              "`dflash-jax train-drafter --kind dflash2` or pass --dflash2 PATH)")
        return None
    if d.config.kind != "dflash2":
        raise SystemExit(f"error: {path} holds a {d.config.kind} drafter, not a DFlash2 one")
    return d


def with_draft_vocab(drafter, n: int):
    """The drafter drafting over the first n token ids (0: the whole vocabulary), a clear error otherwise."""
    V = drafter.config.model.vocab_size
    if not 0 <= n <= V:
        raise SystemExit(f"--draft-vocab {n}: must be 0 (the whole vocabulary) or 1..{V}")
    return drafter.replace(config=drafter.config.replace(draft_vocab_size=n or None))


def tau_table(args, target, drafter, tok, prompts):
    drafters = {"dense": drafter}
    if args.nvfp4:
        train_text = corpus.read_texts(corpus.split_files(corpus.stdlib_files())[0][:64])
        stream = corpus.token_stream(tok, train_text, tok.eos_id)
        rng = np.random.default_rng(args.seed)
        # 16 calibration windows for the documented 8 prompts; fewer for a smaller run (the tests' tiny one)
        windows = [stream[s:s + 96] for s in rng.integers(0, len(stream) - 96, min(16, 2 * len(prompts)))]
        cal = calibrate_drafter(target, drafter, windows, anchors_per_window=args.calibration_anchors)
        rtn = quantize_nvfp4(drafter)
        drafters.update({"nvfp4 rtn": rtn, "nvfp4 calibrated": quantize_nvfp4(drafter, method="calibrated",
                                                                              calibration=cal),
                         "nvfp4 w4a4": quantize_nvfp4(drafter, activations="w4a4", calibration=cal),
                         "nvfp4 no-scale": drop_global_scales(rtn)})
        dense_bf16 = sum(int(np.prod(x.shape)) * 2 for x in jax.tree.leaves(drafter.params))
        print(f"drafter weight bytes: bf16 {dense_bf16:,}; NVFP4 {param_bytes(rtn.params):,} "
              f"({param_bytes(rtn.params) / dense_bf16:.3f} of bf16; norms stay dense)")
    dflash2 = dflash2_drafter(args)
    if dflash2 is not None:  # the same prompts and draft lengths, dense and NVFP4 (RTN, every projection)
        drafters.update({"dflash2": dflash2, "dflash2 nvfp4": quantize_nvfp4(dflash2)} if args.nvfp4
                        else {"dflash2": dflash2})
    check_draft_length(args.draft_length, drafters.values())
    lengths = (args.draft_length,) if args.draft_length else draft_lengths(drafters.values(), (3, 7, 15))
    rows = bench.tau_table(target, drafters, prompts, draft_lengths=lengths,
                           max_new_tokens=args.new_tokens[0], temperature=args.temperature)
    print(f"{len(prompts)} held-out prompts, {args.new_tokens[0]} new tokens, temperature {args.temperature}")
    print(bench.format_tau_table(rows))


def gguf_roundtrip(args, target, drafter, prompts):
    drafters, pairs, audits = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, model in (("", drafter), ("dflash2 ", dflash2_drafter(args))):
            if model is None:
                continue
            q = quantize_nvfp4(model)
            loaded, bug = gguf_replay.gguf_roundtrip(q, tmp, name=kind.strip() or "dflash")
            drafters.update({f"{kind}nvfp4": q, f"{kind}nvfp4 gguf": loaded, f"{kind}nvfp4 gguf attn scale=1": bug})
            pairs.append((f"{kind}nvfp4", q, loaded))
            for label, f in (("intact", "gguf"), ("attention .scale = 1", "attn_scale_1.gguf")):
                name = kind.strip() or "dflash"
                path = f"{tmp}/{name}.gguf" if f == "gguf" else f"{tmp}/{name}_{f}"
                report = audit_file(path, graph=False)
                audits.append(f"  {name} nvfp4 GGUF, {label}: {len(report.rows)} per-tensor scales, flagged "
                              f"{len(report.flagged)}: {', '.join(report.flagged_names) or '-'}")
    models = [d for name, d in drafters.items() if name.endswith("nvfp4")]
    check_draft_length(args.draft_length, models)
    D = args.draft_length or draft_lengths(models, (drafter.config.block_size - 1,))[0]
    print(f"embedded pair {args.model or default_model()}, {len(prompts)} held-out prompts (seed {args.seed}), batch "
          f"1, greedy, draft length {D}: NVFP4 drafters (RTN, the ModelOpt recipe) in memory, written with save_gguf "
          "and read back, and the same file with every attention .scale set to 1.0 (what the engine's graph did)")
    (first, d0), *rest = drafters.items()
    results = [bench.compare(target, d0, prompts, max_new_tokens=n, draft_length=D, drafters=dict(rest),
                             temperature=0.0, seed=args.seed) for n in args.new_tokens]
    for r in results:  # compare() names its first drafter "dflash"
        r[first] = r.pop("dflash")
    print(bench.format_compare_table(results, list(drafters)))
    same = {}
    for name, q, loaded in pairs:  # the output itself, token for token (one batched greedy run each)
        kw = dict(max_new_tokens=args.new_tokens[0], draft_length=D)
        rows = [list(p) for p in prompts]
        a, b = generate(target, q, rows, **kw), generate(target, loaded, rows, **kw)
        same[f"{name} -> GGUF -> {name}"] = bool(np.array_equal(a.tokens, b.tokens))
    print(gguf_replay.format_gguf_goals(results, same))
    for kind in ("", "dflash2 "):  # why the acceptance moves as much as it does: the proposals themselves
        if f"{kind}nvfp4 gguf" in drafters:
            d = gguf_replay.proposal_agreement(target, drafters[f"{kind}nvfp4 gguf"],
                                               drafters[f"{kind}nvfp4 gguf attn scale=1"], prompts,
                                               new_tokens=min(64, args.new_tokens[0]))
            print(f"  {kind or 'dflash '}nvfp4 GGUF, intact vs attention .scale = 1: "
                  f"{gguf_replay.format_proposal_agreement(d)}")
    print("dflash-jax audit on the written files (scale table):")
    print("\n".join(audits))


__all__ = ["run", "heldout_prompts", "dflash2_drafter", "with_draft_vocab", "draft_lengths", "check_draft_length"]
