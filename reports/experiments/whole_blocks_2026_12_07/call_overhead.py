# Per-call cost of the kernel's custom call: 120 chained products with tiny Q4_1 weights (32 x 32) vs the same chain's
# XLA-only part, M = 1; ms per chain, medians. Threads: as the process sets DFLASH_JAX_KERNEL_THREADS.
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp, gguf
from dflash_jax.quant import ggml
from dflash_jax.quant.linear import linear, cpu_kernel_scope
Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)
N = int(os.environ.get("N", "32"))
ws = [ggml.from_blocks(gguf.quants.quantize(rng.standard_normal((N, N)).astype(np.float32) * 0.05, Q.Q4_1), "Q4_1", (N, N)) for _ in range(120)]
def chain(x, ws):
    for w in ws: x = x + linear(x, w) * 0.01
    return x
def plain(x, ws):
    for w in ws: x = x + jnp.sin(x) * 0.01
    return x
x = jnp.asarray(rng.standard_normal((1, N)).astype(np.float32))
with cpu_kernel_scope(True):
    f, g = jax.jit(chain), jax.jit(plain)
    f(x, ws).block_until_ready(); g(x, ws).block_until_ready()
    tf, tg = [], []
    for _ in range(200):
        t0 = time.perf_counter(); f(x, ws).block_until_ready(); tf.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); g(x, ws).block_until_ready(); tg.append(time.perf_counter() - t0)
print(f"120 kernel calls: {1e3*statistics.median(tf):.3f} ms; 120 XLA elementwise: {1e3*statistics.median(tg):.3f} ms; "
      f"per call {1e6*(statistics.median(tf)-statistics.median(tg))/120:.2f} us more")
