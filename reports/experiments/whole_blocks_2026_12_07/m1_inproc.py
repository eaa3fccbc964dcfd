# In one process: 30 layers of SmolLM2's q/k/v/o + MLP products (random Q4_1 blocks), float32 activations, M = 1;
# kernel variants alternated call by call (dflash_set_variant); ms medians and paired ratios; outputs compared bitwise.
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import cpu_kernel_scope, q8_activations_scope
from layers30 import rng, layers, chain  # this folder's module
VARIANTS = tuple(int(v) for v in os.environ.get("VARIANTS", "0 2 4").split())
Ms = tuple(int(v) for v in os.environ.get("MS", "1").split())
q8 = os.environ.get("Q8", "0") == "1"
cpu_kernel.available(); setv = cpu_kernel._state["lib"].dflash_set_variant
with cpu_kernel_scope(True), q8_activations_scope(q8):
    f = jax.jit(chain)
    xs = {M: jnp.asarray(rng.standard_normal((M, 576)).astype(np.float32)) for M in Ms}
    outs = {}
    for v in VARIANTS:
        setv(v)
        for M, x in xs.items(): outs[v, M] = np.asarray(f(x, layers))
    for v in VARIANTS:
        for M in xs: assert np.array_equal(outs[v, M], outs[VARIANTS[0], M]), (v, M)
    print("outputs bit-identical across variants")
    t = {(v, M): [] for v in VARIANTS for M in xs}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
        for M, x in xs.items():
            for v in VARIANTS[::(1 if r % 2 else -1)]:
                setv(v); t0 = time.perf_counter(); f(x, layers).block_until_ready(); t[v, M].append(time.perf_counter() - t0)
for v in VARIANTS:
    print(f"variant {v}:", " ".join(f"M{M} {1e3*statistics.median(t[v, M]):.2f}" for M in xs),
          f"| vs {VARIANTS[0]}, paired:", " ".join(f"M{M} {statistics.median([a / b for a, b in zip(t[v, M], t[VARIANTS[0], M])]):.3f}" for M in xs))
