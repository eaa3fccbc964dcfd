# In one process, the float path's whole-block loop (variant 1) against the general loop (variant 0), alternated request
# by request: AR and generate's default (no draft length: the step table's choice), plus chains of 1 and 3 with lookup,
# greedy, 8 held-out requests x 128 tokens; tok/s medians, paired ratios; tokens compared across variants.
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, jax
import dflash_jax as dj
from dflash_jax.quant import cpu_kernel
from dflash_jax.train.drafter_data import chat_prompt_ids
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
target, drafter, tok = dj.load_default()
cpu_kernel.available()
setv = cpu_kernel._state["lib"].dflash_set_variant
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=128, prefill_timing="rerun")
settings = {"AR": None, "default": {}, "D1": dict(draft_length=1, context_lookup=2, draft_pass="drafted"),
            "D3": dict(draft_length=3, context_lookup=2, draft_pass="drafted")}
def run(s, p):
    if s is None:
        return dj.generate_autoregressive(target, [p], **base)
    return dj.generate(target, drafter, [p], **s, **base)
VARIANTS = tuple(int(v) for v in os.environ.get("VARIANTS", "0 1").split())
for v in VARIANTS:
    setv(v)
    for s in settings.values(): run(s, ids[0])
tps = {(v, k): [] for v in VARIANTS for k in settings}; taus = {(v, k): [] for v in VARIANTS for k in settings}
toks = {}
for rnd in range(rounds):
    for i, p in enumerate(ids):
        for v in (VARIANTS if (i + rnd) % 2 == 0 else VARIANTS[::-1]):
            setv(v)
            for k, s in settings.items():
                r = run(s, p); tps[v, k].append(r.decode_tokens_per_second); taus[v, k].append(float(r.tau))
                toks[v, k, i] = np.asarray(r.tokens).tolist()
same = all(toks[v, k, i] == toks[VARIANTS[0], "AR", i] for v in VARIANTS for k in settings for i in range(len(ids)))
print("tokens identical across variants and equal to AR:", same)
for v in VARIANTS:
    name = f"variant {v}"
    ar = statistics.median(tps[v, "AR"])
    print(f"{name:14s}", " | ".join(f"{k} {statistics.median(tps[v, k]):.1f} tok/s ({statistics.median(tps[v, k]) / ar:.2f}x, tau {statistics.mean(taus[v, k]):.2f})" for k in settings), flush=True)
for v in VARIANTS[1:]:
    print(f"variant {v} / variant {VARIANTS[0]}, paired per request:", " ".join(
        f"{k} {statistics.median([a / b for a, b in zip(tps[v, k], tps[VARIANTS[0], k])]):.3f}" for k in settings))
