# T 0.7: AR, generate's default (the step table's pick), chain of 1 and of 3 (drafted slots, lookup 2) and the tree of 2,
# on 8 held-out requests x 256 tokens, settings alternated request by request in one process; tok/s medians, tau means.
import os, statistics, sys
sys.path.insert(0, os.getcwd())
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
T = float(os.environ.get("T", "0.7"))
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 8, split="eval", seed=int(os.environ.get("PROMPT_SEED", "1")))
base = dict(max_new_tokens=256, prefill_timing="rerun", temperature=T)
settings = {"AR": None, "default": {}, "D1": dict(draft_length=1, context_lookup=2, draft_pass="drafted"),
            "D3": dict(draft_length=3, context_lookup=2, draft_pass="drafted"),
            "tree2": dict(tree_budget=2, context_lookup=2, draft_pass="drafted")}
def run(s, p, seed):
    if s is None:
        return dj.generate_autoregressive(target, [p], seed=seed, **base)
    return dj.generate(target, drafter, [p], seed=seed, **s, **base)
for s in settings.values(): run(s, ids[0], 0)
tps = {k: [] for k in settings}; taus = {k: [] for k in settings}
for rnd in range(rounds):
    for i, p in enumerate(ids):
        order = list(settings) if (i + rnd) % 2 == 0 else list(settings)[::-1]
        for k in order:
            r = run(settings[k], p, 10 + i + 100 * rnd); tps[k].append(r.decode_tokens_per_second); taus[k].append(float(r.tau))
ar = statistics.median(tps["AR"])
print(f"T {T}:", " | ".join(f"{k} {statistics.median(tps[k]):.1f} tok/s ({statistics.median(tps[k]) / ar:.2f}x, "
                            f"paired {statistics.median([a / b for a, b in zip(tps[k], tps['AR'])]):.2f}x, tau {statistics.mean(taus[k]):.2f})" for k in settings))
