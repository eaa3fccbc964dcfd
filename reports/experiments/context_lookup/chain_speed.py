import statistics, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
settings = {"AR": None, "tree 2": dict(tree_budget=2), "chain D1": dict(draft_length=1),
            "chain D1 lookup": dict(draft_length=1, context_lookup=2), "chain D3": dict(draft_length=3),
            "chain D3 lookup": dict(draft_length=3, context_lookup=2)}
for label, kw in (("greedy", {}), ("T0.7", dict(temperature=0.7))):
    base = dict(max_new_tokens=256, prefill_timing="rerun", **kw)
    tps = {k: [] for k in settings}; taus = {k: [] for k in settings}
    for name, s in settings.items():  # compile
        (dj.generate_autoregressive(target, [ids[0]], **base) if s is None else
         dj.generate(target, drafter, [ids[0]], plain_when_slower=False, **s, **base))
    for rep in range(2):
        for i, p in enumerate(ids):
            for name, s in settings.items():
                r = (dj.generate_autoregressive(target, [p], seed=10 + i, **base) if s is None else
                     dj.generate(target, drafter, [p], plain_when_slower=False, seed=10 + i, **s, **base))
                tps[name].append(r.decode_tokens_per_second)
                if s is not None: taus[name].append(float(r.tau))
    ar = statistics.median(tps["AR"])
    for k in settings:
        m = statistics.median(tps[k])
        print(label, k, f"{m:.1f} tok/s", f"{m / ar:.2f}x", f"tau {statistics.mean(taus[k]):.3f}" if taus[k] else "")
