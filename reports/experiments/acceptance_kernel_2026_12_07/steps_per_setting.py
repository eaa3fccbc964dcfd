import numpy as np, dflash_jax as dj, statistics
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
base = dict(max_new_tokens=128, prefill_timing="rerun")
S = {"AR": None, "tree2": dict(tree_budget=2, context_lookup=2, draft_pass="drafted"),
     "D1": dict(draft_length=1, context_lookup=2, draft_pass="drafted"), "D3": dict(draft_length=3, context_lookup=2, draft_pass="drafted")}
def run(s, p): return dj.generate_autoregressive(target, [p], **base) if s is None else dj.generate(target, drafter, [p], **s, **base)
for s in S.values(): run(s, ids[0])
acc = {k: [0.0, 0, 0] for k in S}
for rnd in range(2):
    for p in ids:
        for k, s in S.items():
            r = run(s, p)
            acc[k][0] += r.timings["decode_s"]; acc[k][1] += int(r.num_steps); acc[k][2] += int(np.sum(r.num_tokens) - 1)
ar = acc["AR"][0] / acc["AR"][1]
for k, (t, n, tokens) in acc.items():
    print(f"{k}: {t/n*1e3:.2f} ms/step = {t/n/ar:.2f} AR steps, tau {tokens/n:.2f}, {tokens/t:.1f} tok/s, speedup {tokens/t/(acc['AR'][2]/acc['AR'][0]):.3f}")
