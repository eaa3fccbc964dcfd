# T 0.7 spec vs AR on 8 held-out requests x 256 tokens, generate's default setting, one process (the tree it runs in)
import os, statistics, sys
sys.path.insert(0, os.getcwd())  # the tree this runs in, not the editable install
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=256, prefill_timing="rerun", temperature=0.7)
dj.generate_autoregressive(target, [ids[0]], **base); dj.generate(target, drafter, [ids[0]], **base)
ar, sp, taus = [], [], []
for rep in range(rounds):
    for i, p in enumerate(ids):
        ar.append(dj.generate_autoregressive(target, [p], seed=10 + i, **base).decode_tokens_per_second)
        r = dj.generate(target, drafter, [p], seed=10 + i, **base)
        sp.append(r.decode_tokens_per_second); taus.append(float(r.tau))
a, s = statistics.median(ar), statistics.median(sp)
print(f"{dj.__file__.split('/')[2]}: AR {a:.1f} tok/s, DFlash {s:.1f} tok/s -> {s / a:.3f}x, tau {statistics.mean(taus):.3f}",
      f"(D {r.draft_length}, lookup {r.context_lookup})", flush=True)
