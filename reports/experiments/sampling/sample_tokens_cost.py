# sample_tokens alone: ms per call at temperature 0.7 with and without top-p / top-k, 1 / 3 / 9 rows of 49,152 ids
import time, jax, jax.numpy as jnp, numpy as np
from dflash_jax.decode import sampling as S
V = 49152


def median_ms(f, *a, n=50):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t0)
    return np.median(ts) * 1e3


f = jax.jit(S.sample_tokens)  # settings as traced arguments, as in the generation programs (closed-over constants
for R in (1, 3, 9):           # make XLA fold top-k into a sort)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(R, V)).astype(np.float32) * 3)
    keys = jnp.zeros((R, 2), jnp.uint32)
    cells = []
    for kw in (dict(), dict(top_p=0.9), dict(top_k=50), dict(top_k=50, top_p=0.9)):
        sp = S.SamplingParams.make(temperature=0.7, **kw).as_arrays()
        cells.append(f"{kw or 'T 0.7'} {median_ms(f, logits, keys, sp):.3f} ms")
    print(R, "rows:", "; ".join(cells))
