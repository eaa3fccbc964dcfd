# The 30 layers of SmolLM2-shaped products that m1_inproc.py and chain_time.py time: q / k / v, o, gate / up and down
# with random Q4_1 blocks (seed 0), and the chain that runs x through them. The importing script has put the tree it
# measures first on sys.path.
import jax
import numpy as np
import gguf
from dflash_jax.quant import ggml
from dflash_jax.quant.linear import linear, linear_many

Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(0)  # the scripts draw their x from it after the weights, as before
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
