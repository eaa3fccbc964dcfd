"""Draft trees in the step table: what a tree step costs (r, c) and what it buys (tau, speedup), per budget N,
measured like the chain rows of `speculative.step_table` and printed with them.

A tree step's verify is one target pass over root + N nodes with the cache read-only, the target's token at every
node, the walk and the commit of the accepted path (`_tree_verify_rolled_back`); its draft is the chain's drafter
pass plus the tree's construction (`_tree_draft_rolled_back`). r = verify / decode and c = draft / decode, each piece
run 16 times in one program as the loop runs it (`step_costs.repeated`), timed in turns with a decode step
(`step_costs.interleaved_ms`); tau and the measured speedup come from `speculative.compare`
on the same prompts in the same run. On CPU the matmul kernel reads every weight once per 8 rows of a product
(`quant/cpu_matmul.cc`), so a verify of 1 + N nodes costs about ceil((1 + N) / 8) weight reads: N = 7 and 15 are
the budgets that fill their passes.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.speculative import compare
from dflash_jax.bench.step_costs import (STEPS_PER_PROGRAM, Step, _as_in_the_loop, _decode_rolled_back, interleaved_ms,
                                         repeated)
from dflash_jax.decode import tree
from dflash_jax.decode.draft_step import draft_tree
from dflash_jax.decode.prefill import prefill
from dflash_jax.decode.sampling import SamplingParams, sample_tokens
from dflash_jax.models.drafter import Drafter, append_context, draft_block
from dflash_jax.models.target import Target, TreeLayout, commit_tree, forward_tree
from dflash_jax.quant.linear import program_backend


def _layout(target: Target, tr: tree.DraftTree, start: jax.Array, depth: int) -> tuple[TreeLayout, jax.Array]:
    cfg = target.config
    kernel = cfg.linear_conv_kernel_dim if cfg.is_hybrid else 1
    anc = tree.ancestors(tr, max(depth, kernel - 1))
    return TreeLayout(positions=tree.positions(tr, start), mask=tree.ancestor_mask(anc[..., :depth + 1]),
                      conv_taps=tree.conv_taps(tr, anc, kernel) if cfg.is_hybrid else None), anc[..., :depth + 1]


def _draft_tree(drafter, target, dcache, pending, block, depth, budget):
    """The tree step's drafting, the loop's own (greedy): append the pending context, then `draft_tree` (one block
    pass, the draft vocabulary's logits of `depth` positions, the tree of `budget` nodes). -> (tree, the draft cache
    after the append)."""
    B = block.shape[0]
    dc = append_context(drafter, pending, jnp.full((B,), pending.shape[1], jnp.int32), dcache)
    return draft_tree(drafter, target, block, dc, depth, budget, SamplingParams()), dc


@functools.partial(jax.jit, static_argnums=(5, 6, 7, 8), donate_argnums=(2,))
def _tree_draft_rolled_back(drafter, target, dcache, pending, block, depth, budget, backend, repeat=1):
    def one(dc, pending, block):
        with _as_in_the_loop(backend):
            tr, dc2 = _draft_tree(drafter, target, dc, pending, block, depth, budget)
        return tr, dc2.replace(lengths=dc.lengths)

    return repeated(one, dcache, (pending, block), repeat)


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _tree_draft_only(drafter, target, dcache, pending, block, depth, budget, backend):
    with _as_in_the_loop(backend):
        return _draft_tree(drafter, target, dcache, pending, block, depth, budget)[0]


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6), donate_argnums=(1,))
def _tree_verify_rolled_back(target, tcache, tr, layer_ids, depth, backend, repeat=1):
    """One tree verify (greedy) on a donated cache: the pass over root + N nodes, the target's token per node, the
    walk, the commit of the accepted path; then the lengths rolled back, so every repetition sees the same context."""
    def one(c, tr):
        with _as_in_the_loop(backend):
            layout, anc = _layout(target, tr, c.lengths, depth)
            logits, feats, pending = forward_tree(target, tree.verify_tokens(tr), c, layer_ids, layout)
            own, _ = sample_tokens(logits, jnp.zeros((logits.shape[0], 2), jnp.uint32), SamplingParams())
            path, n_acc = tree.walk(tr, anc, own)
            c2 = commit_tree(c, pending, path, n_acc + 1, target.config)
        return (own, jnp.take_along_axis(feats, path[:, :, None], axis=1)), c2.replace(lengths=c.lengths)

    return repeated(one, tcache, (tr,), repeat)


def tree_step_costs(target: Target, drafter: Drafter, *, tree_budget: int, context_len: int = 64, batch: int = 1,
                    reps: int = 30, seed: int = 0, cache_len: int | None = None,
                    repeat: int = STEPS_PER_PROGRAM) -> dict:
    """ms of one decode step, one tree verify (root + N nodes) and one tree draft (drafter pass + construction) at
    `context_len` live tokens, each `repeat` times in one program (`step_costs.repeated`), timed in turns;
    r = verify / decode, c = draft / decode."""
    dcfg = drafter.config
    depth = tree.tree_depth(tree_budget, dcfg.block_size)
    cache_len = context_len + tree_budget + dcfg.block_size + 64 if cache_len is None else cache_len
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, target.config.vocab_size, (batch, context_len)), jnp.int32)
    lens = jnp.full((batch,), context_len, jnp.int32)
    fill = jax.jit(prefill, static_argnums=(3,))
    _, feats, tcache, dcache = fill(target, prompt, lens, cache_len, drafter=drafter)
    _, _, tcache2, dcache2 = fill(target, prompt, lens, cache_len, drafter=drafter)
    pending = feats[:, -(depth + 1):]
    block = draft_block(drafter, prompt[:, -1], depth)  # as generate's tree step drafts
    tb, db = program_backend(target), program_backend(drafter, target)
    tr = _tree_draft_only(drafter, target, dcache2, pending, block, depth, tree_budget, db)  # the tree verified
    steps = {"decode_ms": (Step(_decode_rolled_back, (target,), (prompt[:, -1:], tb), repeat), tcache),
             "verify_ms": (Step(_tree_verify_rolled_back, (target,), (tr, dcfg.target_layer_ids, depth, tb), repeat),
                           tcache2),
             "draft_ms": (Step(_tree_draft_rolled_back, (drafter, target), (pending, block, depth, tree_budget, db),
                               repeat), dcache)}
    out = interleaved_ms(steps, reps)
    out.update(r=out["verify_ms"] / out["decode_ms"], c=out["draft_ms"] / out["decode_ms"], context_len=context_len,
               tree_budget=tree_budget, draft_length=depth, batch=batch, cache_len=cache_len)
    return out


def tree_rows(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *, budgets=(4, 8, 16, 32),
              max_new_tokens: int = 128, context_len: int = 256, reps: int = 30, draft_vocab: str = "",
              temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """Step-table rows for draft trees of each budget: r, c, tau, predicted (tau / (r + c)) and measured speedup
    (greedy, or sampled at `temperature`; medians over prompts, each against the autoregressive runs of its own
    `compare`)."""
    n = drafter.config.draft_vocab_size
    vocab = draft_vocab or ("full" if n is None else f"first {n}")
    rows = []
    for N in budgets:
        res = compare(target, drafter, prompts, max_new_tokens=max_new_tokens, tree_budget=N, temperature=temperature,
                      seed=seed)
        c = tree_step_costs(target, drafter, tree_budget=N, context_len=context_len, reps=reps)
        x = res["dflash"]
        rows.append({"draft_length": c["draft_length"], "tree_budget": N, "draft_vocab": vocab,
                     "draft_vocab_size": n, "draft_pass": drafter.config.draft_pass or "block", "batch": 1, "r": c["r"],
                     "context_lookup": x["context_lookup"],
                     "c": c["c"], "decode_ms": c["decode_ms"], "verify_ms": c["verify_ms"], "draft_ms": c["draft_ms"],
                     "tau": x["tau"], "predicted": x["tau"] / (c["r"] + c["c"]), "speedup": x["speedup"],
                     "exact_match": x["exact_match"], "max_new_tokens": max_new_tokens,
                     "tokens_per_s": x["tokens_per_s"], "ar_tokens_per_s": res["ar_tokens_per_s"],
                     "temperature": temperature})
    return rows


def format_tree_goals(rows: list[dict]) -> str:
    """The tree's goal figures from one step-table run (chain and tree rows of the same drafter vocabulary)."""
    # of two draft passes' rows for one layout, the one that paid
    chains, trees = {}, {}
    for r in sorted(rows, key=lambda r: r["speedup"]):
        if r.get("tree_budget") is None:
            chains[r["draft_length"]] = r
        else:
            trees[r["tree_budget"]] = r
    lines = ["draft-tree goals (this run):"]
    for N, D in ((8, 7), (7, 7)):
        if N in trees and D in chains:
            lines.append(f"  tau, tree of {N} nodes (verify width {N + 1}) / chain D {D} (width {D + 1}): "
                         f"{trees[N]['tau']:.3f} / {chains[D]['tau']:.3f} = {trees[N]['tau'] / chains[D]['tau']:.2f}x "
                         f"(goal >= 1.25)")
    if trees and chains:
        bt = max(trees.values(), key=lambda r: r["speedup"])
        bc = max(chains.values(), key=lambda r: r["speedup"])
        lines.append(f"  best tree (N {bt['tree_budget']}) {bt['speedup']:.2f}x / best chain (D {bc['draft_length']}) "
                     f"{bc['speedup']:.2f}x = {bt['speedup'] / bc['speedup']:.2f}x (goal >= 1.15; medians over "
                     f"prompts, each against its own autoregressive runs)")
    same = [tuple(map(int, r["exact_match"].split("/"))) for r in trees.values()]
    if same:
        lines.append(f"  greedy output with a tree identical to autoregressive: {sum(a for a, _ in same)}/"
                     f"{sum(b for _, b in same)} runs (goal 100%)")
    return "\n".join(lines)


__all__ = ["format_tree_goals", "tree_rows", "tree_step_costs"]
