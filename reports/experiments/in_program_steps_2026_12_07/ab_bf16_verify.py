import sys, jax
from dflash_jax.io.shipped import load_default
from dflash_jax.bench import step_costs as sc
from dflash_jax.quant.linear import bf16_products_scope
target, drafter, _ = load_default()
steps = {}
for mode in ("f32", "bf16"):
    with bf16_products_scope(mode == "bf16"):
        for D in (3, 7):
            fns = sc.step_functions(target, drafter, context_len=256, draft_length=D, repeat=16)
            fns.pop("_meta")
            if D == 3: steps[(mode, "decode")] = fns["decode_ms"]
            steps[(mode, f"verify{D+1}")] = fns["verify_ms"]
def scoped(mode, step):
    def run(state):
        with bf16_products_scope(mode == "bf16"):
            return step(state)
    return run
steps = {k: (scoped(k[0], s), st) for k, (s, st) in steps.items()}
ms = sc.interleaved_ms(steps, int(sys.argv[1]) if len(sys.argv) > 1 else 15)
print("  ".join(f"{k[0]}/{k[1]} {v/16:.2f}" for k, v in ms.items()), flush=True)
