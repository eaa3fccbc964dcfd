# In one process, the Q4_1 x Q8 product's two chains alternated request by request (a switch of a measurement build in
# /work/wt-ab): AR, chain of 1 and chain of 3 under Q8 activations, greedy, 8 held-out requests x 128 tokens, rounds.
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, jax
import dflash_jax as dj
from dflash_jax.quant import cpu_kernel
from dflash_jax.train.drafter_data import chat_prompt_ids
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
target, drafter, tok = dj.load_default()
cpu_kernel.available()
setv = cpu_kernel._state["lib"].dflash_set_q8_variant
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=128, prefill_timing="rerun", q8_activations=True)
settings = {"AR": None, "D1": dict(draft_length=1), "D3": dict(draft_length=3)}
def run(s, p):
    if s is None:
        return dj.generate_autoregressive(target, [p], **base)
    return dj.generate(target, drafter, [p], context_lookup=2, draft_pass="drafted", **s, **base)
VARIANTS = (0, 2, 3)  # before; the quantizer in vectors; + groups of 8
for v in VARIANTS:
    setv(v)
    for s in settings.values(): run(s, ids[0])
tps = {(v, k): [] for v in VARIANTS for k in settings}; taus = {(v, k): [] for v in VARIANTS for k in settings}
for rnd in range(rounds):
    for i, p in enumerate(ids):
        for v in VARIANTS[::(1 if (i + rnd) % 2 == 0 else -1)]:
            setv(v)
            for k, s in settings.items():
                r = run(s, p); tps[v, k].append(r.decode_tokens_per_second); taus[v, k].append(float(r.tau))
for v, name in ((0, "before"), (2, "quantizer in vectors"), (3, "+ groups of 8")):
    ar = statistics.median(tps[v, "AR"])
    print(f"{name:24s}", " | ".join(f"{k} {statistics.median(tps[v, k]):.1f} tok/s ({statistics.median(tps[v, k]) / ar:.2f}x, tau {statistics.mean(taus[v, k]):.2f})" for k in settings), flush=True)
for v in VARIANTS[1:]:
    print(f"variant {v} / before, paired per request:", " ".join(
        f"{k} {statistics.median([a / b for a, b in zip(tps[v, k], tps[0, k])]):.3f}" for k in settings))
