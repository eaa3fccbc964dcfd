import statistics, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
kw = dict(max_new_tokens=256, prefill_timing="rerun")
runs = {"greedy": dict(), "t0.7": dict(temperature=0.7), "t0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
        "t0.7 top_k 50": dict(temperature=0.7, top_k=50)}
for e in runs.values(): dj.generate_autoregressive(target, [ids[0]], **e, **kw)
ms = {k: [] for k in runs}
for rep in range(2):
    for i, p in enumerate(ids):
        for k, e in runs.items():
            ms[k].append(1e3 / dj.generate_autoregressive(target, [p], seed=i, **e, **kw).decode_tokens_per_second)
print({k: round(statistics.median(v), 3) for k, v in ms.items()}, "ms per token, autoregressive")
