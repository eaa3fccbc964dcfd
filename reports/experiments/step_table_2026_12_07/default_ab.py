# The step table's tied rows, timed in turns on held-out requests: generate's default (its table's choice) against
# the tree of 2 and the chain of 3, all over the drafted slots with context lookup, and plain decoding.
# python reports/experiments/step_table_2026_12_07/default_ab.py [N_REQUESTS] [ROUNDS]
import statistics, sys
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
n, rounds = (int(sys.argv[1]) if len(sys.argv) > 1 else 8), (int(sys.argv[2]) if len(sys.argv) > 2 else 2)
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, n, split="eval", seed=1)
settings = {"AR": None, "default (table)": {},
            "chain D1": dict(draft_length=1, context_lookup=2, draft_pass="drafted"),
            "tree 2": dict(tree_budget=2, draft_pass="drafted"),
            "chain D3": dict(draft_length=3, context_lookup=2, draft_pass="drafted")}
for label, kw in (("greedy", {}), ("T0.7", dict(temperature=0.7))):
    base = dict(max_new_tokens=256, prefill_timing="rerun", **kw)
    tps = {k: [] for k in settings}; taus = {k: [] for k in settings}; layout = {}
    for name, s in settings.items():  # compile
        r = (dj.generate_autoregressive(target, [ids[0]], **base) if s is None else
             dj.generate(target, drafter, [ids[0]], **s, **base))
        layout[name] = ("" if s is None else
                        f"D {r.draft_length} tree {r.tree_budget} lookup {r.context_lookup} {r.draft_pass}")
    for rep in range(rounds):
        for i, p in enumerate(ids):
            for name, s in settings.items():
                r = (dj.generate_autoregressive(target, [p], seed=10 + i, **base) if s is None else
                     dj.generate(target, drafter, [p], seed=10 + i, **s, **base))
                tps[name].append(r.decode_tokens_per_second)
                if s is not None: taus[name].append(float(r.tau))
    ar = statistics.median(tps["AR"])
    for k in settings:
        m = statistics.median(tps[k])
        print(label, f"{k:16s}", f"{m:6.1f} tok/s", f"{m / ar:.2f}x",
              f"tau {statistics.mean(taus[k]):.3f}" if taus[k] else "", layout[k], flush=True)
