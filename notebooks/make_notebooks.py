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
    """md:## DFlash vs DFlash2, dense vs NVFP4, at the report's draft length 7
DFlash2 (z-lab `DFlash2DraftModel`) wraps every attention and MLP sublayer in a grouped dynamic causal convolution
inside the block and re-ranks the top-k draft logits with a pairwise candidate selector, walking the block left to
right. NVFP4 covers its new projections too (`*_conv.kernel_projection`, `candidate_selector.hidden_projection`).
The shipped DFlash2 drafter is used when `checkpoints/drafter2` exists (`dflash-jax train-drafter --kind dflash2`).
Until then this section runs a DFlash2 drafter lifted from the DFlash one (identity convolution, zero selector:
exactly DFlash, so the DFlash and DFlash2 columns agree): it shows the pipeline, not DFlash2's gain.""",
    """
from dflash_jax.defaults import checkpoints_dir
if (checkpoints_dir() / "drafter2").exists():
    drafter2 = dj.load_drafter(checkpoints_dir() / "drafter2")
    print("shipped DFlash2 drafter:", drafter2.config.model.num_hidden_layers, "layers, selector top-k",
          drafter2.config.selector_top_k)
else:
    from dflash_jax.train.drafter2 import warm_start
    cfg2 = drafter.config.replace(kind="dflash2", is_causal=False, conv_kernel_size=2, conv_group_size=16,
                                  selector_rank=64, selector_top_k=16)
    drafter2 = dj.Drafter(params=warm_start(cfg2, dj.init_drafter(cfg2, jax.random.key(0)).params, drafter),
                          config=cfg2)
    print("no shipped DFlash2 drafter yet: a DFlash2 drafter lifted from the DFlash one (identity conv, zero selector)")
q2 = dj.quantize_nvfp4(drafter2)
audit2 = dj.audit_scales(lambda p, f, b: dj.draft_logits(q2.replace(params=p), target, f, b), q2.params, features,
                         block)
print(f"NVFP4 DFlash2: {len(audit2.checked)} NVFP4 projections, DFlash2's own:",
      [n for n in audit2.checked if "conv" in n or "selector" in n])
side = {"DFlash": drafter, "DFlash NVFP4": qd, "DFlash2": drafter2, "DFlash2 NVFP4": q2}
runs2 = {name: dj.generate(target, d, prompts[:4], max_new_tokens=64, draft_length=7, eos_ids=(tok.eos_id,))
         for name, d in side.items()}
for name, r in runs2.items():
    same = r.token_lists() == runs2["DFlash"].token_lists()
    print(f"{name:>14}: tau {r.tau:.2f}, acceptance {100 * r.acceptance_rate:.1f}%, output == DFlash's: {same}")
print(f"DFlash2/DFlash tau, NVFP4 both: {runs2['DFlash2 NVFP4'].tau / runs2['DFlash NVFP4'].tau:.3f}; "
      f"NVFP4/dense DFlash2 tau: {runs2['DFlash2 NVFP4'].tau / runs2['DFlash2'].tau:.3f}")
fig, ax = plt.subplots(figsize=(8, 3))
for i, (name, r) in enumerate(runs2.items()):
    ax.bar(np.arange(1, 8) + 0.2 * (i - 1.5), r.position_acceptance, width=0.2, label=name)
ax.set_xlabel("draft position"); ax.set_ylabel("P(accepted)"); ax.legend(); plt.show()
""",
])
