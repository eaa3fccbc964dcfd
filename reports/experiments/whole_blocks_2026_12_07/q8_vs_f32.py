# Autoregressive decoding with float32 activations vs Q8 activations, alternated request by request in one process;
# 8 held-out requests x 128 tokens, greedy; decode tok/s medians and paired ratio.
import os, statistics, sys
sys.path.insert(0, os.getcwd())
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=128, prefill_timing="rerun")
for q in (False, True): dj.generate_autoregressive(target, [ids[0]], q8_activations=q, **base)
t = {False: [], True: []}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    for i, p in enumerate(ids):
        for q in ((False, True) if (i + rnd) % 2 == 0 else (True, False)):
            t[q].append(dj.generate_autoregressive(target, [p], q8_activations=q, **base).decode_tokens_per_second)
print(f"float32 activations {statistics.median(t[False]):.1f} tok/s, Q8 {statistics.median(t[True]):.1f} tok/s, "
      f"Q8 / float32 paired {statistics.median([b / a for a, b in zip(t[False], t[True])]):.3f}")
