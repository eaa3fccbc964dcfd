# T 0.7: drafts sampled from q (z-lab's rule, the default) against the point mass at q's argmax, generate's default
# setting otherwise; 8 held-out requests x 256 tokens, 2 alternated rounds; tau and tok/s against AR in one process.
import os, statistics, sys
sys.path.insert(0, os.getcwd())
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=256, prefill_timing="rerun", temperature=0.7)
kinds = ("sample", "greedy")
dj.generate_autoregressive(target, [ids[0]], **base)
for k in kinds: dj.generate(target, drafter, [ids[0]], draft_sampling=k, **base)
ar, tps, taus = [], {k: [] for k in kinds}, {k: [] for k in kinds}
for rnd in range(2):
    for i, p in enumerate(ids):
        ar.append(dj.generate_autoregressive(target, [p], seed=10 + i + 100 * rnd, **base).decode_tokens_per_second)
        for k in kinds[::(1 if (i + rnd) % 2 == 0 else -1)]:
            r = dj.generate(target, drafter, [p], seed=10 + i + 100 * rnd, draft_sampling=k, **base)
            tps[k].append(r.decode_tokens_per_second); taus[k].append(float(r.tau))
a = statistics.median(ar)
for k in kinds:
    print(f"draft_sampling={k}: tau {statistics.mean(taus[k]):.3f}, {statistics.median(tps[k]):.1f} tok/s, "
          f"{statistics.median(tps[k]) / a:.3f}x of AR ({a:.1f} tok/s)", flush=True)
