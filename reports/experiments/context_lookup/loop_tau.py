# held-out tau (8 eval requests, 256 tokens, greedy) with draft trees of N nodes, context lookup off / on, one batch
import sys, json, numpy as np, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
ar = dj.generate_autoregressive(target, ids, max_new_tokens=256, eos_ids=(tok.eos_id,))
out = {}
for N in (1, 2, 4, 8):
    for cl in (0, 2):
        r = dj.generate(target, drafter, ids, max_new_tokens=256, tree_budget=N, context_lookup=cl, eos_ids=(tok.eos_id,))
        same = np.array_equal(r.tokens, ar.tokens)
        out[f"N{N}_lookup{cl}"] = round(r.tau, 4)
        print(f"tree {N} lookup {cl}: tau {r.tau:.3f} identical {same}", flush=True)
for D in (3, 7):
    r = dj.generate(target, drafter, ids, max_new_tokens=256, draft_length=D, eos_ids=(tok.eos_id,))
    out[f"chain{D}"] = round(r.tau, 4)
    print(f"chain {D}: tau {r.tau:.3f} identical {np.array_equal(r.tokens, ar.tokens)}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
