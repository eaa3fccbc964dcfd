"""The llama.cpp NVFP4 bug replayed through a file: a drafter written with `save_gguf` and read back, and the same
file with its attention `.scale` tensors set to 1.0 (the engine's graph multiplied those weights by 1, dropping their
per-tensor scales). The figures it is judged by (acceptance rate, tau and its floor) and a look at the proposals
themselves: a broken drafter that still proposes what the intact one does cannot lose acceptance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.programs import generate_autoregressive
from dflash_jax.io.gguf_drafter import load_drafter_gguf, patch_scales, save_gguf
from dflash_jax.models.drafter import Drafter, draft_tokens
from dflash_jax.models.target import Target, target_forward

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


# The goal a replay is held to: the broken file's acceptance rate at most 0.3x the intact file's (a drafter whose
# scales are dropped must be seen to collapse, or the scales are not doing their job).
REPLAY_GOAL = 0.3


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
    """The replay's goals: the GGUF round trip keeps tau and output; the attention scales set to 1 collapse the
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


__all__ = ["gguf_roundtrip", "replay_figures", "proposal_agreement", "format_proposal_agreement", "format_replay",
           "format_gguf_goals", "REPLAY_GOAL", "ATTENTION_GGUF"]
