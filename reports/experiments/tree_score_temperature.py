"""Draft-tree tau against the temperature s of the tree's scores (log_softmax(drafter logits / s)), greedy, so the
output is the target's whatever s is; docs/usage.md ("Draft trees") has the figures, tree_score_temperature.log the
run (2026-12-05): for T in 1.0 0.5 2.0 0.7 1.4; do python reports/experiments/tree_score_temperature.py $T; done
Prints, per tree budget, tau over the 8 held-out requests (128 new tokens, batch 8), then one json line (at s = 1
the chains of 3 and 7 too)."""
import json, sys, time
import dflash_jax as dj
from dflash_jax.decode import tree
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.train.loop import load_training_tokenizer
from dflash_jax.io.shipped import smollm2_path

T = float(sys.argv[1])
orig = tree.draft_scores
tree.draft_scores = lambda d_logits, sp: orig(d_logits / T, sp)
target, drafter, _ = dj.load_default()
tok = load_training_tokenizer(smollm2_path())
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
out = {"T": T}
for n in (2, 3, 4, 8):
    t0 = time.time()
    res = dj.generate(target, drafter, ids, max_new_tokens=128, tree_budget=n, eos_ids=(tok.eos_id,))
    out[n] = round(res.tau, 4)
    print(n, out[n], round(time.time() - t0), flush=True)
if T == 1.0:
    for d in (3, 7):
        res = dj.generate(target, drafter, ids, max_new_tokens=128, draft_length=d, eos_ids=(tok.eos_id,))
        out[f"chain{d}"] = round(res.tau, 4)
print(json.dumps(out), flush=True)
