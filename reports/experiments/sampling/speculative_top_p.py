# AR vs speculative decode tokens/s at temperature 0.7 with top-p 0.9 (the README's example) and without, interleaved:
#   python reports/experiments/sampling/speculative_top_p.py [tree N | chain D]   (default: tree 2)
import sys, statistics, numpy as np, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
kind, size = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else ("tree", 2)
spec = dict(tree_budget=size) if kind == "tree" else dict(draft_length=size)
print(dj.__file__)  # run from a worktree of another commit with PYTHONPATH=that worktree
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
kw = dict(max_new_tokens=256, eos_ids=(tok.eos_id,), prefill_timing="rerun", temperature=0.7)
runs = {"ar": lambda p, s, e: dj.generate_autoregressive(target, [p], seed=s, **e, **kw),
        "spec": lambda p, s, e: dj.generate(target, drafter, [p], seed=s, **spec, **e, **kw)}
for extra in (dict(), dict(top_p=0.9)):
    for f in runs.values():
        f(ids[0], 0, extra)
    tps = {k: [] for k in runs}
    tau = {k: [] for k in runs}
    for rep in range(2):
        for i, p in enumerate(ids):
            for k, f in runs.items():
                r = f(p, 10 * rep + i, extra)
                tps[k].append(r.decode_tokens_per_second)
                tau[k].extend(r.acceptance_lengths[r.acceptance_lengths > 0].tolist())
    ar, sp = statistics.median(tps["ar"]), statistics.median(tps["spec"])
    print(f"T0.7 {extra}: AR {ar:.1f} tok/s; {kind} {size} {sp:.1f} tok/s (tau {np.mean(tau['spec']):.3f}) "
          f"= {sp / ar:.2f}x")
