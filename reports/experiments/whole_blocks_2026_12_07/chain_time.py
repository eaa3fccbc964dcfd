# The 30-layer Q4_1 chain (q/k/v, o, gate/up, down; random blocks) under jax.jit at 1 / 2 / 4 / 8 rows: ms medians of N
# calls and a hash of the outputs (the same across the trees compared). Run it in each tree with the same environment.
import os, sys, statistics, time, hashlib
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp, gguf
from dflash_jax.quant import ggml, cpu_kernel
from dflash_jax.quant.linear import linear, linear_many, cpu_kernel_scope
Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)
def blk(N, K):
    return ggml.from_blocks(gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, Q.Q4_1), "Q4_1", (N, K))
layers = [(blk(576, 576), blk(192, 576), blk(192, 576), blk(576, 576), blk(1536, 576), blk(1536, 576), blk(576, 1536)) for _ in range(30)]
def chain(x, layers):
    for q, k, v, o, g, u, d in layers:
        a, b, c = linear_many(x, (q, k, v))
        x = x + linear(a, o) * 0.01 + (b.sum() + c.sum()) * 1e-6
        a, b = linear_many(x, (g, u))
        x = x + linear(jax.nn.silu(a) * b, d) * 0.01
    return x
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
