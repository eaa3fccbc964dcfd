import statistics, time, numpy as np, jax, jax.numpy as jnp
for n in (8192, 16384, 24576, 32768, 49152, 98304):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, n)), jnp.float32)
    g = jax.jit(lambda x: jnp.max(x, axis=-1)); jax.block_until_ready(g(x)); t = []
    for _ in range(400):
        t0 = time.perf_counter(); jax.block_until_ready(g(x)); t.append(time.perf_counter() - t0)
    txt = g.lower(x).compile().as_text()
    print(f"n {n:6d}: {1e6*statistics.median(t):6.1f} us", "ynn" if "__ynn_fusion" in txt else "")
