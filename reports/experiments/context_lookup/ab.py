# A/B on one machine: decode tokens/s of autoregressive decoding vs a tree of N with context lookup off / on, interleaved
# (usage: python ab.py NEW_TOKENS N [q8])
import sys, statistics, numpy as np, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
new, N = int(sys.argv[1]), int(sys.argv[2])
q8 = "q8" in sys.argv[3:]
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
kw = dict(max_new_tokens=new, eos_ids=(tok.eos_id,), prefill_timing="rerun", q8_activations=q8)
runs = {"ar": lambda p: dj.generate_autoregressive(target, [p], **kw),
        "off": lambda p: dj.generate(target, drafter, [p], tree_budget=N, context_lookup=0, **kw),
        "on": lambda p: dj.generate(target, drafter, [p], tree_budget=N, **kw)}
for f in runs.values(): f(ids[0])
tps = {k: [] for k in runs}; tau = {k: [] for k in runs}; same = []
for rep in range(2):
    for p in ids:
        res = {k: f(p) for k, f in runs.items()}
        for k, r in res.items():
            tps[k].append(r.decode_tokens_per_second); tau[k].extend(r.acceptance_lengths[r.acceptance_lengths > 0].tolist())
        same.append(res["on"].token_lists() == res["ar"].token_lists() == res["off"].token_lists())
ar = statistics.median(tps["ar"])
print(f"{new} tokens, tree {N}, q8 {q8}: AR {ar:.1f} tok/s; " + "; ".join(
    f"lookup {k}: tau {np.mean(tau[k]):.3f}, {statistics.median(tps[k]):.1f} tok/s = {statistics.median(tps[k]) / ar:.2f}x"
    for k in ("off", "on")) + f"; identical {sum(same)}/{len(same)}")
