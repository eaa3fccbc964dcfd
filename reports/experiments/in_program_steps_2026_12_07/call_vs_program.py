import sys, jax
from dflash_jax.io.shipped import load_default
from dflash_jax.bench.step_costs import step_costs
from dflash_jax.bench.tree import tree_step_costs
target, drafter, _ = load_default()
d = drafter.replace(config=drafter.config.replace(draft_pass="drafted"))
for rep in (1, 16, 1, 16):
    for D in (1, 3):
        c = step_costs(target, d, context_len=256, draft_length=D, reps=10, repeat=rep)
        print(f"repeat {rep:2d} D{D}: decode {c['decode_ms']:.2f} verify {c['verify_ms']:.2f} draft {c['draft_ms']:.2f} r {c['r']:.3f} c {c['c']:.3f} r+c {c['r']+c['c']:.3f}", flush=True)
    c = tree_step_costs(target, d, tree_budget=2, context_len=256, reps=10, repeat=rep)
    print(f"repeat {rep:2d} tree2: decode {c['decode_ms']:.2f} verify {c['verify_ms']:.2f} draft {c['draft_ms']:.2f} r {c['r']:.3f} c {c['c']:.3f} r+c {c['r']+c['c']:.3f}", flush=True)
