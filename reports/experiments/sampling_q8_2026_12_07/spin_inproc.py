# In one process (a measurement build with the kernel workers' spin settable): how long the workers spin after a job,
# 300 us (the shipped value) against shorter, for plain and speculative decoding (generate's default), greedy and
# T 0.7; 8 held-out requests x 128 tokens, variants alternated request by request; paired ratios.
import os, statistics, sys
sys.path.insert(0, os.getcwd())
import dflash_jax as dj
from dflash_jax.quant import cpu_kernel
from dflash_jax.train.drafter_data import chat_prompt_ids
SPINS = tuple(int(a) for a in sys.argv[1].split(",")) if len(sys.argv) > 1 else (300, 60)
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
target, drafter, tok = dj.load_default()
cpu_kernel.available(); setspin = cpu_kernel._state["lib"].dflash_set_spin_micros
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
settings = {"AR greedy": (None, 0.0), "spec greedy": ({}, 0.0), "AR T0.7": (None, 0.7), "spec T0.7": ({}, 0.7)}
def run(s, t, p, seed):
    kw = dict(max_new_tokens=128, prefill_timing="rerun", temperature=t, seed=seed)
    return dj.generate_autoregressive(target, [p], **kw) if s is None else dj.generate(target, drafter, [p], **kw)
for s, t in settings.values(): run(s, t, ids[0], 0)
tps = {(v, k): [] for v in SPINS for k in settings}
for rnd in range(rounds):
    for i, p in enumerate(ids):
        for v in SPINS[::(1 if (i + rnd) % 2 == 0 else -1)]:
            setspin(v)
            for k, (s, t) in settings.items():
                tps[v, k].append(run(s, t, p, 10 + i).decode_tokens_per_second)
for v in SPINS:
    print(f"spin {v:4d} us:", " | ".join(f"{k} {statistics.median(tps[v, k]):.1f}" for k in settings), flush=True)
for v in SPINS[1:]:
    print(f"spin {v} / {SPINS[0]}, paired:", " ".join(
        f"{k} {statistics.median([a / b for a, b in zip(tps[v, k], tps[SPINS[0], k])]):.3f}" for k in settings))
