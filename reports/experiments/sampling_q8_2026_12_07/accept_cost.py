# accept_block alone, jitted, one row, V = 49,152, D = 1 (the default chain) and 3, T 0.7: before (q over the padded
# row, p processed whole) and now (PrefixQ over 8,192 ids, p read where needed). us per call, medians of 200.
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp
from dflash_jax.decode.sampling import SamplingParams, accept_block, processed_probs, PrefixQ
from dflash_jax.models.drafter import pad_vocabulary
V, n = 49152, 8192
sp = SamplingParams.make(temperature=0.7)
rng = np.random.default_rng(0)
keys = jnp.zeros((1, 2), jnp.uint32)
for D in (1, 3):
    dl = jnp.asarray(rng.standard_normal((1, D, n)) * 3, jnp.float32)
    vl = jnp.asarray(rng.standard_normal((1, D + 1, V)) * 3, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, n, (1, D)), jnp.int32)
    old = jax.jit(lambda dl, drafts, vl, keys: accept_block(pad_vocabulary(dl, V), drafts, vl, keys, sp))
    new = jax.jit(lambda dl, drafts, vl, keys: accept_block(pad_vocabulary(dl, V), drafts, vl, keys, sp,
                  draft_probs=PrefixQ(processed_probs(dl, sp), jnp.zeros((1, D), bool))))
    for f in (old, new): jax.block_until_ready(f(dl, drafts, vl, keys))
    t = {0: [], 1: []}
    for r in range(200):
        for k, f in ((0, old), (1, new)):
            t0 = time.perf_counter(); jax.block_until_ready(f(dl, drafts, vl, keys)); t[k].append(time.perf_counter() - t0)
    print(f"D {D}: before {1e6*statistics.median(t[0]):.0f} us, now {1e6*statistics.median(t[1]):.0f} us")
