"""Where a step of generate's loop spends its time, inside the one while loop: the loop program itself under the
profiler, per group, against the autoregressive loop's step on the same requests.

    python -m dflash_jax.bench.loop_profile [--prompts 2] [--new-tokens 128] [--tree-budget N | --draft-length D]
                                            [--context-lookup K] [--temperature T] [--top-p P] [--reps 3]
                                            [--q8-activations]

`bench.profile` times the step's pieces as separate programs (decode, verify, draft), as `bench.step_costs` does for
r and c; each such program pays its own launch (~0.3-0.6 ms on a 2-core CPU), which the loop does not. Here the
events are those of the loop program (prefill excluded), grouped as `bench.profile` groups them, with the drafter's
instructions as "draft: ..." and the loop's own bookkeeping (tree build, walk, commits, context lookup) apart.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from dflash_jax.bench.flags import add_product_flags
from dflash_jax.bench.profile import Instruction, group_of, profile_table, trace_program
from dflash_jax.decode.call import PROGRAM_PREFIX
from dflash_jax.decode.programs import autoregressive_call, speculative_call
from dflash_jax.io.shipped import load_default
from dflash_jax.quant.products import products_scope
from dflash_jax.train.drafter_data import chat_prompt_ids


# what emitted an instruction (a function anywhere in its Python stack) -> its group, first match wins: the
# drafter's work, the target's pass (grouped as `bench.profile` groups it), then the loop's own bookkeeping
DRAFT_FUNCTIONS = ("append_context", "draft_step", "draft_logits", "draft_proposal", "draft_block", "block_hidden",
                   "head_logits")
TARGET_FUNCTIONS = ("forward_with_cache", "forward_tree", "forward_hidden", "target_forward")
LOOP_GROUPS = (
    ("tree build", ("build", "draft_scores", "draft_top", "ancestor_mask", "chain_tree")),
    ("context lookup", ("prefer_context", "continuation", "_copied_drafts")),
    ("commits", ("commit_tree", "_commit", "commit_states", "write_rows")),
    ("walk, acceptance and sampling", ("walk", "verify_tokens", "accept_block", "_accept", "greedy_accept",
                                       "first_argmax", "processed_probs", "residual_probs", "sample_tokens",
                                       "_categorical", "_draw")),
)


def loop_group(instr: Instruction, hlo, computations, cfg) -> str:
    """"draft: " + `group_of` for what the drafter's functions emitted, `group_of` for the target's pass, else the
    loop's bookkeeping group (`LOOP_GROUPS`), else "loop: other"."""
    stack = set(instr.stack) | {instr.function}
    if stack & set(DRAFT_FUNCTIONS):
        return "draft: " + group_of(instr, hlo, computations, cfg)
    if stack & set(TARGET_FUNCTIONS):
        return group_of(instr, hlo, computations, cfg)
    for group, names in LOOP_GROUPS:
        if stack & set(names):
            return group
    return "loop: other"


def profile_loop(target, drafter, prompts, *, max_new_tokens: int = 128, reps: int = 3, temperature: float = 0.0,
                 top_p: float = 1.0, **options) -> dict:
    """generate's loop program itself (prefill excluded) under the profiler, per group: ms per loop step (thunk
    time, `loop_group`), for the speculative loop (`options`: generate's keywords; default: its own choice) and the
    autoregressive loop on the same prompts, per token; temperature / top_p: both loops'. Unlike `bench.step_costs`,
    whose pieces are separate programs (each paying a launch), this is what a step costs inside the one while
    loop."""
    out = {}
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    options = {"plain_when_slower": False, **options}  # the table's best row even where it predicts no gain
    for name, make in (("speculative", lambda p: speculative_call(target, drafter, [p], **kw, **options)),
                       ("autoregressive", lambda p: autoregressive_call(target, [p], **kw))):
        steps, sums, res = 0, {}, None
        for p in prompts:  # each request's own loop program (its shape bucket), its own instruction names
            call = make(p)
            with warnings.catch_warnings():  # lowering again here: JAX notes the loop's donated inputs once more
                warnings.simplefilter("ignore")
                text = call.lower()[1].compile().as_text()
            res = call.run()  # compiled and warm
            events = trace_program(call.run, reps, module=f"{PROGRAM_PREFIX}{name}")
            n = reps * res.num_steps
            for g, r in profile_table(events, text, n, target.config, group=loop_group).items():
                acc = sums.setdefault(g, dict.fromkeys(r, 0.0))
                for k in acc:
                    acc[k] += r[k] * n
            steps += n
        table = {g: {k: v / steps for k, v in r.items()} for g, r in sums.items()}
        out[name] = {"steps": steps, "tau": float(res.tau) if name == "speculative" else 1.0, "groups": table,
                     "layout": (f"tree of {res.tree_budget}" if name == "speculative" and res.tree_budget else
                                f"chain of {res.draft_length}" if name == "speculative" else "plain"),
                     "context_lookup": res.context_lookup}
    return out


def format_loop(prof: dict) -> str:
    """The loop profile's two tables, then a speculative step in autoregressive steps: the draft's share (c as the
    loop pays it), the rest (the target's pass and the bookkeeping: r and what it costs to run a tree or a chain)."""
    per = {k: sum(g["ms"] for g in p["groups"].values()) for k, p in prof.items()}
    lines = []
    for k, p in prof.items():
        lines.append(f"\n{k} loop ({p['layout']}, context lookup {p['context_lookup']}): {per[k]:.2f} ms per step in "
                     f"its thunks, {p['steps']} steps traced, tau {p['tau']:.2f}")
        lines += ["| group | ms per step | share |", "|---|---|---|"]
        lines += [f"| {g} | {r['ms']:.3f} | {100 * r['ms'] / per[k]:.0f}% |"
                  for g, r in sorted(p["groups"].items(), key=lambda kv: -kv[1]["ms"])]
    if {"speculative", "autoregressive"} <= set(prof):
        decode = per["autoregressive"]
        draft = sum(r["ms"] for g, r in prof["speculative"]["groups"].items() if g.startswith("draft: "))
        step = per["speculative"]
        tau = prof["speculative"]["tau"]
        lines.append(f"\na speculative step = {step / decode:.2f} autoregressive steps (draft {draft / decode:.2f}, "
                     f"the rest {(step - draft) / decode:.2f}); tau {tau:.2f} -> {tau * decode / step:.2f}x in thunk "
                     "time")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.loop_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a shipped model (default: the default model)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out requests, one at a time")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--tree-budget", type=int, default=None, help="a draft tree of N nodes (default: generate's)")
    ap.add_argument("--draft-length", type=int, default=None, help="a chain of D (default: generate's)")
    ap.add_argument("--context-lookup", type=int, default=None, help="generate's context_lookup (default: its own)")
    ap.add_argument("--temperature", type=float, default=0.0, help="both loops' (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="both loops' (default 1: off)")
    ap.add_argument("--reps", type=int, default=3, help="traced runs per request")
    ap.add_argument("--json", type=Path, default=None, help="also write the tables as JSON here")
    add_product_flags(ap)
    args = ap.parse_args(argv)
    with products_scope(args):
        target, drafter, tok = load_default(model=args.model)
        prompts = chat_prompt_ids(tok, args.prompts, split="eval", seed=1)
        kw = {k: v for k, v in (("tree_budget", args.tree_budget), ("draft_length", args.draft_length),
                                ("context_lookup", args.context_lookup)) if v is not None}
        prof = profile_loop(target, drafter, prompts, max_new_tokens=args.new_tokens, reps=args.reps,
                            temperature=args.temperature, top_p=args.top_p, **kw)
    print(format_loop(prof))
    if args.json:
        args.json.write_text(json.dumps(prof, indent=1))
    return prof


if __name__ == "__main__":
    main()
