import sys, json, statistics, dflash_jax as dj
from dflash_jax.io.checkpoint import load_drafter
from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.bench.step_costs import step_costs
target, d32, tok = dj.load_default()
d16 = load_drafter(checkpoints_dir() / "smollm2" / "drafter", param_dtype="bfloat16", compute_dtype="float32")
import jax
print({str(l.dtype) for l in jax.tree.leaves(d32.params)}, {str(l.dtype) for l in jax.tree.leaves(d16.params)})
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
kw = dict(max_new_tokens=128, prefill_timing="rerun")
res = {}
for rep in range(2):
    for name, d in (("f32", d32), ("bf16", d16)):
        rs = [dj.generate(target, d, [p], tree_budget=2, plain_when_slower=False, **kw) for p in ids]
        res.setdefault(name, []).append(([r.token_lists() for r in rs], [round(float(r.tau), 3) for r in rs], [round(r.decode_tokens_per_second, 1) for r in rs]))
print("same tokens", res["f32"][0][0] == res["bf16"][0][0], "tau", res["f32"][0][1], res["bf16"][0][1])
for k, v in res.items(): print(k, [x[2] for x in v])
for name, d in (("f32", d32), ("bf16", d16), ("f32", d32), ("bf16", d16)):
    c = step_costs(target, d, context_len=256, draft_length=3, reps=15)
    print(name, "draft ms", round(c["draft_ms"], 2), "decode", round(c["decode_ms"], 2), "c", round(c["c"], 3))
