"""Writes the notebooks from their cell sources (run: python notebooks/make_notebooks.py). Outputs are not stored:
the test suite executes every notebook, so they never rot."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent


def write(name, cells):
    nb = new_notebook(cells=[new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c.strip())
                             for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, HERE / name)


write("quickstart.ipynb", [
    """md:# dflash-jax quickstart
Load the embedded target + DFlash drafter (trained on the Python standard library, shipped in `checkpoints/`),
generate from a prompt, and look at the acceptance: tau (tokens committed per draft+verify step, bonus included)
and the acceptance rate per block position. Then DFlash vs autoregressive tokens/s, measured in this run.""",
    """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import dflash_jax as dj

target, drafter, tok = dj.load_default()
print(target.config)
print(drafter.config.block_size, drafter.config.target_layer_ids, drafter.config.mask_token_id)
""",
    """
prompt = "def fibonacci(n):\\n"
res = dj.generate(target, drafter, [tok.encode(prompt)], max_new_tokens=128, eos_ids=(tok.eos_id,))
print(prompt + tok.decode(res.token_lists()[0]))
print(f"tau = {res.tau:.2f} over {res.num_steps} steps; acceptance rate {100 * res.acceptance_rate:.1f}%")
""",
    """md:Greedy speculative decoding is lossless: the output equals plain greedy decoding token for token.""",
    """
ar = dj.generate_autoregressive(target, [tok.encode(prompt)], max_new_tokens=128, eos_ids=(tok.eos_id,))
assert ar.token_lists() == res.token_lists()
print("identical to autoregressive:", ar.token_lists() == res.token_lists())
""",
    """md:## Acceptance per block position over a few held-out prompts""",
    """
from dflash_jax.train import corpus
prompts = [tok.encode(t) for t in corpus.held_out_prompts(6, seed=0)]
batch = dj.generate(target, drafter, prompts, max_new_tokens=128, eos_ids=(tok.eos_id,))
print(f"tau {batch.tau:.2f}; steps by tau: {batch.tau_histogram.tolist()}")
fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(np.arange(1, batch.draft_length + 1), batch.position_acceptance)
ax.set_xlabel("draft position k"); ax.set_ylabel("P(accepted)"); ax.set_title("acceptance per block position")
plt.show()
""",
    """md:## DFlash vs autoregressive tokens/s (decode loop, prefill and compile excluded; medians over prompts)""",
    """
from dflash_jax import bench
r = bench.compare(target, drafter, prompts[:4], max_new_tokens=128, eos_ids=(tok.eos_id,))
print(bench.format_compare_table([r]))
""",
])

write("nvfp4_drafter.ipynb", [
    """md:# NVFP4 drafters
The format (E2M1 values, E4M3 block scales, FP32 tensor scale), quantizing the shipped drafter, acceptance per block
position bf16 vs NVFP4, and the missing-tensor-scale collapse (llama.cpp PR #28000) reproduced on purpose and caught
by `audit_scales`. Only public calls.""",
    """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import jax, jax.numpy as jnp
import dflash_jax as dj
from dflash_jax import nvfp4
print("E2M1 values by code:", nvfp4.e2m1_values())
""",
    """md:## The value grid and one weight's block scales""",
    """
target, drafter, tok = dj.load_default()
w = drafter.params.layers[0].self_attn.v_proj
q = nvfp4.quantize(w)
print("logical shape", q.shape, "| packed", q.packed.shape, q.packed.dtype, "| block scales", q.block_scale.shape,
      q.block_scale.dtype, "| tensor scale", float(q.global_scale))
print(f"bytes: NVFP4 {q.nbytes} vs bf16 {w.size * 2} ({q.nbytes / (w.size * 2):.3f}x)")
err = np.asarray(nvfp4.dequantize(q) - w)
fig, axs = plt.subplots(1, 2, figsize=(10, 3))
axs[0].hist(np.asarray(q.block_scale.astype(jnp.float32)).ravel(), bins=50); axs[0].set_title("E4M3 block scales")
axs[1].hist(err.ravel(), bins=100); axs[1].set_title("dequantization error")
plt.show()
print("relative error (Frobenius):", float(np.linalg.norm(err) / np.linalg.norm(np.asarray(w))))
""",
    """md:## Quantize the whole drafter and compare acceptance""",
    """
from dflash_jax.train import corpus
prompts = [tok.encode(t) for t in corpus.held_out_prompts(6, seed=0)]
qd = dj.quantize_nvfp4(drafter)                         # ModelOpt recipe (rtn), every linear
broken = dj.drop_global_scales(qd)                      # the engine bug: q/k/v/o tensor scales dropped
runs = {name: dj.generate(target, d, prompts, max_new_tokens=96, draft_length=15, eos_ids=(tok.eos_id,))
        for name, d in [("bf16", drafter), ("nvfp4", qd), ("nvfp4, no q/k/v/o scales", broken)]}
for name, r in runs.items():
    print(f"{name:>26}: tau {r.tau:.2f}, acceptance {100 * r.acceptance_rate:.1f}%")
fig, ax = plt.subplots(figsize=(8, 3))
for i, (name, r) in enumerate(runs.items()):
    ax.bar(np.arange(1, 16) + 0.28 * (i - 1), r.position_acceptance, width=0.28, label=name)
ax.set_xlabel("draft position"); ax.set_ylabel("P(accepted)"); ax.legend(); plt.show()
""",
    """md:## The collapse is caught: `audit_scales` names exactly the projections whose tensor scale never reaches the output""",
    """
features = dj.target_forward(target, np.asarray([prompts[0][:32]]), qd.config.target_layer_ids)[1]
block = np.full((1, qd.config.block_size), qd.config.mask_token_id); block[0, 0] = prompts[0][32]

def forward(params, features, block):
    return dj.draft_logits(qd.replace(params=params), target, features, block)

print(dj.audit_scales(forward, qd.params, features, block))

def forward_like_the_buggy_engine(params, features, block):
    return forward(dj.drop_global_scales(qd.replace(params=params)).params, features, block)

audit = dj.audit_scales(forward_like_the_buggy_engine, qd.params, features, block)
print("missing:", *audit.missing, sep="\\n  ")
""",
])
