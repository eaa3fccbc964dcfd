# The 30-layer Q4_1 chain (q/k/v, o, gate/up, down; random blocks) under jax.jit at 1 / 2 / 4 / 8 rows: ms medians of N
# calls and a hash of the outputs (the same across the trees compared). Run it in each tree with the same environment.
import os, sys, statistics, time, hashlib
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import cpu_kernel_scope
from layers30 import rng, layers, chain  # this folder's module
with cpu_kernel_scope(True):
    f = jax.jit(chain)
    out = []
    for M in (1, 2, 4, 8):
        x = jnp.asarray(rng.standard_normal((M, 576)).astype(np.float32))
        y = np.asarray(f(x, layers)); out.append(y)
        t = []
        for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
            t0 = time.perf_counter(); f(x, layers).block_until_ready(); t.append(time.perf_counter() - t0)
        print(f"M{M} {1e3*statistics.median(t):.2f}", end=" ")
print("| isa", cpu_kernel.isa(), "| outputs", hashlib.sha1(b"".join(o.tobytes() for o in out)).hexdigest()[:12])
