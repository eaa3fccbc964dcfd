# usage (from the repo root):
#   python reports/experiments/tree_score_depth_penalty.py SCALE PENALTY [BUDGETS...]   (one process per setting)
# held-out tau of draft trees (8 eval requests, 256 tokens, greedy, EOS) with the tree's scores re-tempered:
# logp = log_softmax(logits / TAU) - PEN * (depth - 1)   [argv: TAU PEN budgets...]
import sys, json, jax, jax.numpy as jnp
from dflash_jax.decode import tree
from dflash_jax.io.shipped import load_default
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.train.loop import load_training_tokenizer
from dflash_jax.io.shipped import smollm2_path
from dflash_jax import generate
TAU, PEN = float(sys.argv[1]), float(sys.argv[2])
budgets = [int(b) for b in sys.argv[3:]] or [2, 4, 8]
orig = tree.draft_scores
def patched(d_logits, sp):
    x = orig(d_logits.astype(jnp.float32) / TAU, sp)
    D = x.shape[1]
    return x - PEN * jnp.arange(D, dtype=jnp.float32)[None, :, None]
tree.draft_scores = patched
target, drafter, _ = load_default()
tok = load_training_tokenizer(smollm2_path())
ids = chat_prompt_ids(tok, 8, split="eval", seed=1)
out = {"tau_scale": TAU, "pen": PEN}
for N in budgets:
    res = generate(target, drafter, ids, max_new_tokens=256, tree_budget=N, eos_ids=(tok.eos_id,))
    out[f"N{N}"] = round(float(res.tau), 4)
print(json.dumps(out), flush=True)
