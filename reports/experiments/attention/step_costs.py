import sys, json, dflash_jax as dj
from dflash_jax.bench.step_costs import step_costs
target, drafter, tok = dj.load_default()
out = {}
for ctx in (256, 1024):
    for D in (1, 3, 7):
        c = step_costs(target, drafter, context_len=ctx, draft_length=D, reps=15)
        out[f"{ctx}/{D}"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in c.items()}
print(sys.argv[1], json.dumps(out))
