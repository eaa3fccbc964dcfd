import json, sys, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
out = {}
for label, kw in (("greedy", {}), ("T0.7", dict(temperature=0.7, seed=11)), ("T0.7 top-p 0.9", dict(temperature=0.7, top_p=0.9, seed=11))):
    ar = dj.generate_autoregressive(target, ids, max_new_tokens=256, **kw)
    for D in (1, 3, 7):
        for k in (0, 2):
            r = dj.generate(target, drafter, ids, max_new_tokens=256, draft_length=D, context_lookup=k, **kw)
            out[f"{label} chain D{D} lookup {k}"] = (round(float(r.tau), 3), r.token_lists() == ar.token_lists() if label == "greedy" else None)
    r = dj.generate(target, drafter, ids, max_new_tokens=256, tree_budget=2, **kw)
    out[f"{label} tree 2 lookup 2"] = (round(float(r.tau), 3), r.token_lists() == ar.token_lists() if label == "greedy" else None)
for k, v in out.items(): print(k, v)
