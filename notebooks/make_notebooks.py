"""Writes the research notebooks from their cell sources, and with --execute runs them on the shipped models.

    python notebooks/make_notebooks.py --execute            all notebooks, executed, outputs and figures stored
    python notebooks/make_notebooks.py --execute quickstart one of them
    python notebooks/make_notebooks.py                      sources only (outputs cleared)

Each executed notebook is committed with its outputs (figures inline, PNG) and, beside it, `<name>.json`: the key
numbers its cells showed through `keep(...)` (tau, acceptance per position, the figures' data), the number of figures,
and a fingerprint of the models and logs it ran on. `tests/test_notebooks.py` checks the committed notebooks against
these files and re-executes them, failing when the committed numbers are stale.

The model notebooks switch on dflash-jax's persistent compilation cache (`dj.enable_compilation_cache()`) and run
programs without host callbacks (`prefill_timing="rerun"`), so executing them again on the same machine (the tests,
or after retraining a model whose shapes did not change) loads compiled programs instead of compiling them.

Kinds of key numbers, and how a fresh run is compared with the committed one:
- "numbers": greedy decoding and file contents are deterministic: integers and strings exact, floats to 1e-3
  (relative or absolute: reductions may round differently on another CPU).
- "sampled": temperature > 0 results; the same seed gives the same samples on the same platform, but a float
  rounding difference elsewhere may flip one draw, so floats are compared to 0.35 absolute (tau is tokens per step).
- "timings": tokens/s and speedups are machine- and load-dependent: stored and shown, never compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS_MIME = "application/vnd.dflash-jax.keys+json"
QUICK_ENV = "DFLASH_JAX_NOTEBOOK_QUICK"  # set: acceptance_vs_length and draft_trees run a subset (the tests' size)
TOLERANCE = {"numbers": (1e-3, 1e-3), "sampled": (0.0, 0.35)}  # (relative, absolute)
KINDS = ("numbers", "sampled", "timings")

# The first code cell of every notebook: inline figures (captured as image/png by Jupyter and nbclient alike) and
# `keep`, which shows key numbers and tags them so that this script can store them beside the notebook.
SETUP = '''
%matplotlib inline
import json
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

plt.rcParams.update({"figure.dpi": 72, "savefig.dpi": 72, "axes.grid": True, "grid.alpha": 0.3})


def keep(kind="numbers", **values):
    """Show key numbers; make_notebooks.py stores them beside the notebook and tests/test_notebooks.py re-checks them."""
    values = json.loads(json.dumps(values, default=lambda x: np.asarray(x).tolist()))
    fmt = lambda v: (f"{v:.4g}" if isinstance(v, float) else
                     "[" + " ".join(map(fmt, v)) + "]" if isinstance(v, list) else str(v))
    display({"''' + KEYS_MIME + '''": {kind: values},
             "text/plain": "\\n".join(f"{kind}: {k} = {fmt(v)}" for k, v in values.items())}, raw=True)
'''


# -- the notebooks --------------------------------------------------------------------------------------------------

QUICKSTART = [
    """md:# dflash-jax quickstart
Load the embedded target + DFlash drafter (trained on Python source, shipped in `checkpoints/`), generate from a
prompt, and look at the acceptance: **tau** (tokens committed per draft+verify step, bonus included) and the
acceptance rate per block position. Then DFlash vs autoregressive tokens/s, measured in this run on this machine.""",
    SETUP + """
import dflash_jax as dj
from dflash_jax.train import corpus

dj.enable_compilation_cache()  # compiled programs kept on disk: running the notebook again skips compiling
CACHEABLE = dict(prefill_timing="rerun")  # no host callback in the program, so it can be cached (prefill timed apart)
target, drafter, tok = dj.load_default(model="code-5m")  # the 5.8M trained pair (SmolLM2: model="smollm2")
c = target.config
print(f"target: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}")
print(f"drafter: {drafter.config.model.num_hidden_layers} layer(s), block {drafter.config.block_size}, "
      f"reads target layers {drafter.config.target_layer_ids}")
""",
    """md:## Generate""",
    """
prompt = "def fibonacci(n):\\n"
res = dj.generate(target, drafter, [tok.encode(prompt)], max_new_tokens=128, eos_ids=(tok.eos_id,), **CACHEABLE)
print(prompt + tok.decode(res.token_lists()[0]))
print(f"tau = {res.tau:.2f} over {res.num_steps} steps; acceptance rate {100 * res.acceptance_rate:.1f}%")
keep(prompt_tokens=int(res.num_tokens[0]), prompt_steps=res.num_steps, prompt_tau=res.tau,
     prompt_acceptance_lengths=res.acceptance_lengths[0])
""",
    """md:Greedy speculative decoding is lossless: the output equals plain greedy decoding token for token.""",
    """
ar = dj.generate_autoregressive(target, [tok.encode(prompt)], max_new_tokens=128, eos_ids=(tok.eos_id,),
                                **CACHEABLE)
assert ar.token_lists() == res.token_lists()
print("identical to autoregressive:", ar.token_lists() == res.token_lists())
""",
    """md:## Acceptance per block position over held-out prompts (one batched call)
Position k is accepted when the drafter's k-th token and all before it equal the target's greedy choice.""",
    """
prompts = [tok.encode(t) for t in corpus.held_out_prompts(4, seed=0)]
batch = dj.generate(target, drafter, prompts, max_new_tokens=128, eos_ids=(tok.eos_id,), **CACHEABLE)
print(f"tau {batch.tau:.2f}; acceptance rate {100 * batch.acceptance_rate:.1f}%; steps by tokens committed: "
      f"{batch.tau_histogram[1:].tolist()}")
keep(batch_tau=batch.tau, batch_acceptance_rate=batch.acceptance_rate, batch_tokens=batch.num_tokens,
     position_acceptance=batch.position_acceptance, tau_histogram=batch.tau_histogram)
fig, axs = plt.subplots(1, 2, figsize=(10, 3))
axs[0].bar(np.arange(1, batch.draft_length + 1), batch.position_acceptance)
axs[0].set(xlabel="draft position k", ylabel="P(accepted)", title="acceptance per block position", ylim=(0, 1))
axs[1].bar(np.arange(1, batch.draft_length + 2), batch.tau_histogram[1:])
axs[1].set(xlabel="tokens committed in a step", ylabel="steps", title=f"steps by tokens committed (tau {batch.tau:.2f})")
plt.show()
""",
    """md:## DFlash vs autoregressive tokens/s
Batch 1, each prompt in turn; decode loop only (prefill and compilation excluded), medians over the prompts. These are
this machine's numbers at the time of the run: on a shared CPU they move from run to run.""",
    """
from dflash_jax.bench import speculative as bench

r = bench.compare(target, drafter, prompts[:2], max_new_tokens=128, eos_ids=(tok.eos_id,))
print(bench.format_compare_table([r]))
keep(compare_tau=r["dflash"]["tau"], compare_exact=r["dflash"]["exact_match"])
keep("timings", ar_tokens_per_s=r["ar_tokens_per_s"], dflash_tokens_per_s=r["dflash"]["tokens_per_s"],
     speedup=r["dflash"]["speedup"])
fig, ax = plt.subplots(figsize=(5, 3))
bars = ax.bar(["autoregressive", "DFlash"], [r["ar_tokens_per_s"], r["dflash"]["tokens_per_s"]], color=["C7", "C0"])
ax.bar_label(bars, fmt="%.0f tok/s")
ax.set(ylabel="decode tokens/s", title=f"{r['dflash']['speedup']:.2f}x at tau {r['dflash']['tau']:.2f} (this run)")
plt.show()
""",
]

NVFP4 = [
    """md:# NVFP4 drafters
The format (E2M1 values, E4M3 block scales of 16 values, one FP32 tensor scale), its block-scale and error
histograms on a drafter weight, the acceptance of the dense, NVFP4 and scales-dropped drafters, and the
missing-tensor-scale collapse (llama.cpp PR #28000) reproduced on purpose and named by `audit_scales`.""",
    SETUP + """
import jax.numpy as jnp
import dflash_jax as dj
from dflash_jax.quant import nvfp4
from dflash_jax.train import corpus

dj.enable_compilation_cache()  # compiled programs kept on disk: running the notebook again skips compiling
CACHEABLE = dict(prefill_timing="rerun")  # no host callback in the program, so it can be cached (prefill timed apart)
target, drafter, tok = dj.load_default(model="code-5m")  # the 5.8M trained pair (SmolLM2: model="smollm2")
print("E2M1 values by code:", nvfp4.e2m1_values())
""",
    """md:## One weight: packed codes, block scales, error
A value is `e2m1 * block_scale(e4m3) * tensor_scale(fp32)`; the tensor scale puts the largest block scale near the
top of E4M3's range (448).""",
    """
w = drafter.params.layers[0].self_attn.v_proj
q = nvfp4.quantize(w)
scales = np.asarray(q.block_scale.astype(jnp.float32)).ravel()
err = np.asarray(nvfp4.dequantize(q) - w)
rel = float(np.linalg.norm(err) / np.linalg.norm(np.asarray(w)))
print("logical shape", q.shape, "| packed", q.packed.shape, q.packed.dtype, "| block scales", q.block_scale.shape,
      q.block_scale.dtype, "| tensor scale", float(q.global_scale))
print(f"bytes: NVFP4 {q.nbytes} vs bf16 {w.size * 2} ({q.nbytes / (w.size * 2):.3f}x); relative error {rel:.4f}")
keep(v_proj_shape=list(q.shape), nvfp4_bytes=q.nbytes, bf16_bytes=int(w.size * 2), tensor_scale=float(q.global_scale),
     block_scale_min=scales.min(), block_scale_median=float(np.median(scales)), block_scale_max=scales.max(),
     relative_error=rel, abs_error_p99=float(np.quantile(np.abs(err), 0.99)))
fig, axs = plt.subplots(1, 3, figsize=(12, 3))
axs[0].stem(nvfp4.e2m1_values()); axs[0].set(title="E2M1 value of each 4-bit code", xlabel="code")
axs[1].hist(scales, bins=50); axs[1].set(title="E4M3 block scales (v_proj, layer 0)", xlabel="scale")
axs[2].hist(err.ravel(), bins=100); axs[2].set(title=f"dequantization error (relative {rel:.3f})", xlabel="error")
plt.show()
""",
    """md:## The whole drafter, and an audit that every scale reaches the output
`quantize_nvfp4` converts every linear (ModelOpt recipe, round to nearest). `audit_scales` makes each scale a
differentiation variable: a scale that never reaches the output has an identically zero gradient.""",
    """
qd = dj.quantize_nvfp4(drafter)
broken = dj.drop_global_scales(qd)  # what the buggy engine did: q/k/v/o tensor scales never applied
prompts = [tok.encode(t) for t in corpus.held_out_prompts(4, seed=0)]
features = dj.target_forward(target, np.asarray([prompts[0][:32]]), qd.config.target_layer_ids)[1]
block = np.full((1, qd.config.block_size), qd.config.mask_token_id); block[0, 0] = prompts[0][32]


def forward(params, features, block):
    return dj.draft_logits(target, qd.replace(params=params), features, block)


def forward_like_the_buggy_engine(params, features, block):
    return forward(dj.drop_global_scales(qd.replace(params=params)).params, features, block)


good = dj.audit_scales(forward, qd.params, features, block)
# localize=False: the same `missing` (reachability); it skips naming the leaves whose forward differs, one op-by-op
# forward per leaf (the slow part, and every attention leaf differs here by construction)
bad = dj.audit_scales(forward_like_the_buggy_engine, qd.params, features, block, localize=False)
print(good)
print("buggy engine, scales that never reach the output:", *bad.missing, sep="\\n  ")
keep(audit_checked=len(good.checked), audit_ok=good.ok, audit_missing_buggy=list(bad.missing))
""",
    """md:One subtlety: `fc` feeds `hidden_norm`, an RMSNorm, which divides out any uniform scale of its input, so `fc`'s
tensor scale reaches the output only through the norm's epsilon; on some inputs its gradient rounds to exactly zero
and the audit flags it (truly, and harmlessly: dropping that scale changes nothing). The attention scales the buggy
engine drops are another matter, as the acceptance shows.""",
    """md:## Acceptance: dense vs NVFP4 vs scales dropped
Same prompts, batch of 4, greedy, 15 drafted tokens per step.""",
    """
labels = {"dense": "dense (f32)", "nvfp4": "NVFP4", "dropped": "NVFP4, q/k/v/o tensor scales dropped"}
runs = {name: dj.generate(target, d, prompts, max_new_tokens=96, eos_ids=(tok.eos_id,), **CACHEABLE)
        for name, d in [("dense", drafter), ("nvfp4", qd), ("dropped", broken)]}
for name, r in runs.items():
    print(f"{labels[name]:>36}: tau {r.tau:.2f}, acceptance {100 * r.acceptance_rate:.1f}%")
    keep(**{f"{name}_tau": r.tau, f"{name}_acceptance_rate": r.acceptance_rate,
            f"{name}_position_acceptance": r.position_acceptance})
fig, ax = plt.subplots(figsize=(10, 3))
D = runs["dense"].draft_length
for i, (name, r) in enumerate(runs.items()):
    ax.bar(np.arange(1, D + 1) + 0.28 * (i - 1), r.position_acceptance, width=0.28,
           label=f"{labels[name]} (tau {r.tau:.2f})")
ax.set(xlabel="draft position k", ylabel="P(accepted)", ylim=(0, 1), title="acceptance per block position")
ax.legend()
plt.show()
""",
    """md:## DFlash vs DFlash2, dense vs NVFP4, at the report's draft length 7
DFlash2 (z-lab `DFlash2DraftModel`) wraps every attention and MLP sublayer in a grouped dynamic causal convolution
inside the block and re-ranks the top-k draft logits with a pairwise candidate selector, walking the block left to
right. NVFP4 covers its new projections too (`*_conv.kernel_projection`, `candidate_selector.hidden_projection`).
The shipped DFlash2 drafter is used when `checkpoints/drafter2` exists (`dflash-jax train-drafter --kind dflash2`).
Until then this section runs a DFlash2 drafter lifted from the DFlash one (identity convolution, zero selector:
exactly DFlash, so the DFlash and DFlash2 columns agree): it shows the pipeline, not DFlash2's gain.""",
    """
import jax

from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.params import named_leaves
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
# (its scales are audited like the DFlash drafter's above: tests/test_shipped.py, on the shipped DFlash2 drafter)
projections = [n for n, x in named_leaves(q2.params).items() if isinstance(x, dj.NVFP4Array)]
print(f"NVFP4 DFlash2: {len(projections)} NVFP4 projections, DFlash2's own:",
      [n for n in projections if "conv" in n or "selector" in n])
side = {"DFlash": drafter, "DFlash NVFP4": qd, "DFlash2": drafter2, "DFlash2 NVFP4": q2}
runs2 = {name: dj.generate(target, d, prompts[:4], max_new_tokens=64, draft_length=7, eos_ids=(tok.eos_id,),
                           **CACHEABLE)
         for name, d in side.items()}
for name, r in runs2.items():
    same = r.token_lists() == runs2["DFlash"].token_lists()
    print(f"{name:>14}: tau {r.tau:.2f}, acceptance {100 * r.acceptance_rate:.1f}%, output == DFlash's: {same}")
    keep(**{f"side_{name.replace(' ', '_')}_tau": r.tau, f"side_{name.replace(' ', '_')}_same_output": same})
print(f"DFlash2/DFlash tau, NVFP4 both: {runs2['DFlash2 NVFP4'].tau / runs2['DFlash NVFP4'].tau:.3f}; "
      f"NVFP4/dense DFlash2 tau: {runs2['DFlash2 NVFP4'].tau / runs2['DFlash2'].tau:.3f}")
fig, ax = plt.subplots(figsize=(8, 3))
for i, (name, r) in enumerate(runs2.items()):
    ax.bar(np.arange(1, 8) + 0.2 * (i - 1.5), r.position_acceptance, width=0.2, label=name)
ax.set_xlabel("draft position"); ax.set_ylabel("P(accepted)"); ax.legend(); plt.show()
""",
]

ACCEPTANCE_VS_LENGTH = [
    """md:# Acceptance and speedup vs output length and temperature
tau and DFlash-over-autoregressive speedup for outputs of 128 to 1024 tokens at temperature 0, 0.7 and 1.0, with
the dense and the NVFP4 drafter. Two held-out prompts in one batch; every row runs to the full length (no EOS stop),
so the x axis is the output length. Speedup = decode tokens/s of DFlash / of autoregressive decoding at the same
length and temperature, measured on the same run that gives tau (prefill and compilation excluded, so each point
costs one compile and one run). Timings are this machine's at the time of the run; tau is the model's.""",
    SETUP + """
import os
import dflash_jax as dj
from dflash_jax.train import corpus

dj.enable_compilation_cache()  # compiled programs kept on disk: running the notebook again skips compiling
CACHEABLE = dict(prefill_timing="rerun")  # no host callback in the program, so it can be cached (prefill timed apart)
target, drafter, tok = dj.load_default(model="code-5m")  # the 5.8M trained pair (SmolLM2: model="smollm2")
drafters = {"dense": drafter, "nvfp4": dj.quantize_nvfp4(drafter)}
prompts = [tok.encode(t) for t in corpus.held_out_prompts(2, seed=0)]
LENGTHS, TEMPERATURES = (128, 256, 512, 1024), (0.0, 0.7, 1.0)
if os.environ.get("{QUICK_ENV}"):  # the test suite's smaller run (a subset of the same grid: the exact, greedy one)
    LENGTHS, TEMPERATURES = (128,), (0.0,)
print("prompt lengths", [len(p) for p in prompts], "| lengths", LENGTHS, "| temperatures", TEMPERATURES)
""".replace("{QUICK_ENV}", QUICK_ENV),
    """
rows = []
for T in TEMPERATURES:
    for L in LENGTHS:
        kw = dict(max_new_tokens=L, temperature=T, seed=0, **CACHEABLE)
        ar = dj.generate_autoregressive(target, prompts, **kw)
        for name, d in drafters.items():
            r = dj.generate(target, d, prompts, **kw)
            rows.append(dict(drafter=name, temperature=T, length=L, tau=r.tau, acceptance_rate=r.acceptance_rate,
                             speedup=r.decode_tokens_per_second / ar.decode_tokens_per_second,
                             tokens_per_s=r.decode_tokens_per_second, ar_tokens_per_s=ar.decode_tokens_per_second))
            print(f"T={T:<4} L={L:<5} {name:>6}: tau {r.tau:5.2f}  acceptance {100 * r.acceptance_rate:5.1f}%  "
                  f"{r.decode_tokens_per_second:7.1f} vs AR {ar.decode_tokens_per_second:7.1f} tok/s "
                  f"-> {rows[-1]['speedup']:.2f}x")
""",
    """md:## The figure""",
    """
tag = lambda r: f"{r['drafter']}_T{r['temperature']}_L{r['length']}"
keep(**{f"tau_{tag(r)}": r["tau"] for r in rows if r["temperature"] == 0})
keep("sampled", **{f"tau_{tag(r)}": r["tau"] for r in rows if r["temperature"] > 0})
keep("timings", **{f"speedup_{tag(r)}": r["speedup"] for r in rows})
fig, axs = plt.subplots(1, 2, figsize=(12, 3.5))
for i, T in enumerate(TEMPERATURES):
    for name, style in [("dense", "-o"), ("nvfp4", "--s")]:
        sel = [r for r in rows if r["drafter"] == name and r["temperature"] == T]
        for ax, key in zip(axs, ("tau", "speedup")):
            ax.plot([r["length"] for r in sel], [r[key] for r in sel], style, color=f"C{i}",
                    label=f"{name}, T={T}")
for ax, key in zip(axs, ("tau (tokens per step)", "speedup vs autoregressive (this run)")):
    ax.set(xscale="log", xlabel="output length (tokens)", ylabel=key)
    ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
axs[1].axhline(1.0, color="k", lw=0.8)
axs[0].legend(fontsize=8, ncol=2)
plt.show()
""",
]

DRAFT_TREES = [
    """md:# Draft trees: tau and speedup against the tree's budget
Each step drafts one block with the DFlash drafter, builds a tree of the N most probable draft prefixes from its
per-position distributions, verifies the root and the N nodes in one target pass (each node sees the committed text,
its ancestors and itself, at position = committed length + depth) and keeps the path the target's own tokens follow,
plus its bonus token: `generate(..., tree_budget=N)`. The default pair (SmolLM2-135M-Instruct and its DFlash
drafter), two held-out requests in one batch, greedy, no EOS stop; the chain of 7 drafts (the same verify width as 7
nodes) is the reference line. tau counts the bonus; speedup = decode tokens/s over autoregressive decoding in the
same run (second runs, compilation excluded). Timings are this machine's at the time of the run; tau is the
models'. On CPU the matmul kernel reads the weights once per 8 rows of a product, so a verify of 1 + N nodes costs
about ceil((1 + N) / 8) weight reads. Each tree runs twice: with context lookup (the default: a row whose output ends
in a repeat of 2+ tokens verifies what followed its last occurrence instead of the drafter's tree that step, the same
number of nodes) and without it (`context_lookup=0`: the drafter's trees alone). Both decoders take float32
products (`bf16_products=False`): generation's default takes bfloat16 ones on a CPU with AVX512-BF16, another function
of the prompt, and this notebook's tau is to be the same on every machine.""",
    SETUP + """
import os
import dflash_jax as dj
from dflash_jax.train.drafter import chat_prompt_ids

dj.enable_compilation_cache()  # compiled programs kept on disk: running the notebook again skips compiling
CACHEABLE = dict(prefill_timing="rerun")  # no host callback in the program, so it can be cached (prefill timed apart)
target, drafter, tok = dj.load_default(model="smollm2")  # the default pair
prompts = chat_prompt_ids(tok, 2, split="eval", seed=0)  # held-out requests through the chat template
BUDGETS, CHAIN, NEW = (4, 8, 16, 32), 7, 64
if os.environ.get("{QUICK_ENV}"):  # the test suite's smaller run (a subset of the same grid)
    BUDGETS, CHAIN = (8,), None
print("prompt lengths", [len(p) for p in prompts], "| budgets", BUDGETS, "| block", drafter.config.block_size,
      "| draft vocabulary", drafter.config.draft_vocab_size)
""".replace("{QUICK_ENV}", QUICK_ENV),
    """
kw = dict(max_new_tokens=NEW, eos_ids=(), bf16_products=False, **CACHEABLE)  # float32 products on every CPU


def second_run(fn, *args, **more):
    fn(*args, **kw, **more)  # the first run compiles and warms up
    return fn(*args, **kw, **more)


ar = second_run(dj.generate_autoregressive, target, prompts)
runs = {f"tree_N{N}": second_run(dj.generate, target, drafter, prompts, tree_budget=N) for N in BUDGETS}
runs.update({f"tree_N{N}_no_lookup": second_run(dj.generate, target, drafter, prompts, tree_budget=N,
                                                context_lookup=0) for N in BUDGETS})
if CHAIN:
    runs[f"chain_D{CHAIN}"] = second_run(dj.generate, target, drafter, prompts, draft_length=CHAIN)
for name, r in runs.items():
    speedup = r.decode_tokens_per_second / ar.decode_tokens_per_second
    print(f"{name:>9}: tau {r.tau:5.3f}  steps by committed tokens {r.tau_histogram[1:].tolist()}  "
          f"identical to autoregressive: {r.token_lists() == ar.token_lists()}  "
          f"{r.decode_tokens_per_second:6.1f} vs {ar.decode_tokens_per_second:6.1f} tok/s -> {speedup:.2f}x")
keep(**{f"tau_{k}": r.tau for k, r in runs.items()},
     **{f"identical_{k}": r.token_lists() == ar.token_lists() for k, r in runs.items()})
keep("timings", **{f"speedup_{k}": r.decode_tokens_per_second / ar.decode_tokens_per_second for k, r in runs.items()})
""",
    """md:## The figure""",
    """
fig, axs = plt.subplots(1, 2, figsize=(11, 3.5))
for ax, value, label in [(axs[0], lambda r: r.tau, "tau (tokens per step)"),
                         (axs[1], lambda r: r.decode_tokens_per_second / ar.decode_tokens_per_second,
                          "speedup vs autoregressive (this run)")]:
    ax.plot(BUDGETS, [value(runs[f"tree_N{N}"]) for N in BUDGETS], "-o", label="draft tree, context lookup")
    ax.plot(BUDGETS, [value(runs[f"tree_N{N}_no_lookup"]) for N in BUDGETS], "-s", label="draft tree alone")
    if CHAIN:
        ax.axhline(value(runs[f"chain_D{CHAIN}"]), color="C1", ls="--", label=f"chain, D {CHAIN}")
    ax.set(xscale="log", xlabel="tree budget N (nodes besides the root)", ylabel=label)
    ax.set_xticks(BUDGETS, [str(n) for n in BUDGETS])
    ax.legend(fontsize=8)
axs[1].axhline(1.0, color="k", lw=0.8)
plt.show()
""",
]

TRAINING = [
    """md:# Training: loss curves, held-out loss, and what more tokens would buy
Read from the shipped checkpoints: `checkpoints/{target,drafter}/train_report.json` (always there) and
`train_log.jsonl` (the training loop's log, one record every 10 steps, held-out evaluations included) when it is
shipped too; without a log only the final numbers of the report are shown.""",
    SETUP + """
from dflash_jax.io.shipped import checkpoints_dir

root = checkpoints_dir()


def read_log(path):
    \"\"\"Records by step; a resumed run appends the steps it redoes again, and the last write wins.\"\"\"
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


runs = {}
for kind in ("target", "drafter"):
    report = json.loads((root / kind / "train_report.json").read_text())
    runs[kind] = dict(report=report, log=read_log(root / kind / "train_log.jsonl"))
    print(f"{kind}: {report['steps']} steps, {report['params']:,} parameters, log records: {len(runs[kind]['log'])}")
t = runs["target"]["report"]


def tokens_after(steps):
    \"\"\"Target tokens seen after `steps` updates: short windows, then (from long_from_step) the long-context phase.\"\"\"
    steps = np.asarray(steps, float)
    if "long_from_step" not in t:  # a report without the curriculum fields: tokens spread evenly over the steps
        return steps * t["tokens_seen"] / t["steps"]
    short = np.minimum(steps, t["long_from_step"])
    return short * t["batch"] * t["seq_len"] + (steps - short) * t["long_batch"] * t["long_seq_len"]


print(f"target: {t['tokens_seen']:,} tokens seen; from the report's fields: {tokens_after(t['steps']):,.0f}")
""",
    """md:## Loss curves""",
    """
tgt, dft = runs["target"], runs["drafter"]
held = [r for r in tgt["log"] if "heldout_loss" in r]
fig, axs = plt.subplots(1, 2, figsize=(12, 3.5))
if tgt["log"]:
    axs[0].plot(tokens_after([r["step"] + 1 for r in tgt["log"]]), [r["loss"] for r in tgt["log"]], lw=0.8,
                alpha=0.6, label="train loss (batch)")
    for key, mark in [("heldout_loss", "o-"), ("heldout_loss_packages", "s--"), ("heldout_loss_1024", "^:")]:
        pts = [r for r in tgt["log"] if key in r]
        if pts:
            axs[0].plot(tokens_after([r["step"] + 1 for r in pts]), [r[key] for r in pts], mark, label=key)
else:
    axs[0].plot([t["tokens_seen"]], [t["train_loss"]], "o", label="train loss (final)")
    axs[0].plot([t["tokens_seen"]], [t["heldout_loss"]], "s", label="heldout_loss (final)")
axs[0].set(xlabel="tokens seen", ylabel="cross-entropy (nats/token)", title="target")
axs[0].legend(fontsize=8)
d = dft["report"]
if dft["log"]:
    axs[1].plot([r["step"] for r in dft["log"]], [r["loss"] for r in dft["log"]], lw=0.8, label="train loss")
    taus = [r for r in dft["log"] if "tau" in r]
    if taus:
        ax2 = axs[1].twinx()
        ax2.plot([r["step"] for r in taus], [r["tau"] for r in taus], "o-", color="C3", label="tau (held-out)")
        ax2.set_ylabel("tau (held-out prompts)", color="C3")
else:
    axs[1].plot([d["steps"]], [d["train_loss"]], "o", label="train loss (final)")
axs[1].set(xlabel="step", ylabel="drafter loss (decay-weighted CE)", title="drafter")
axs[1].legend(fontsize=8, loc="upper center")
plt.show()
final = {k: v for k, v in t.items() if k.startswith("heldout_loss") or k == "train_loss"}
keep(target_final=final, target_log_records=len(tgt["log"]), drafter_log_records=len(dft["log"]),
     drafter_train_loss=d.get("train_loss"),
     drafter_tau_report=d.get("tau_eval_8_prompts_256_tokens_D7", d.get("tau_eval_8_prompts")),
     heldout_curve=[[r["step"], r["heldout_loss"]] for r in held],
     drafter_tau_curve=[[r["step"], r["tau"]] for r in dft["log"] if "tau" in r])
""",
    """md:## What more tokens would buy
A saturating power law `L(D) = E + A (D / 1e6)^(-alpha)` fitted to the target's held-out loss against tokens seen
(least squares; E and alpha on a grid, A in closed form). A within-run fit is rough: the learning rate decays on a
cosine to the end of the run, which lowers the last points faster than a longer run would, so read the extrapolation
as a trend, not a promise.""",
    """
import math


def fit_power_law(D, L):
    D, L = np.asarray(D, float) / 1e6, np.asarray(L, float)
    best = None
    for E in np.linspace(0.0, L.min() - 1e-3, 200):
        for alpha in np.linspace(0.02, 2.0, 199):
            x = D ** -alpha
            A = float(x @ (L - E) / (x @ x))
            sse = float(((E + A * x - L) ** 2).sum())
            if A > 0 and (best is None or sse < best[0]):
                best = (sse, E, A, alpha)
    return dict(E=best[1], A=best[2], alpha=best[3], rmse=math.sqrt(best[0] / len(L)))


fig, ax = plt.subplots(figsize=(7, 3.5))
if len(held) >= 4:
    D = tokens_after([r["step"] + 1 for r in held])  # the record at step s follows s+1 updates
    L = np.array([r["heldout_loss"] for r in held])
    fit = fit_power_law(D, L)
    law = lambda x: fit["E"] + fit["A"] * (np.asarray(x, float) / 1e6) ** -fit["alpha"]
    D_now = D[-1]
    more = {f"x{m}": float(law(m * D_now)) for m in (2, 4, 10)}
    print(f"fit: L = {fit['E']:.3f} + {fit['A']:.3f} (D/1e6)^-{fit['alpha']:.3f}  (rmse {fit['rmse']:.4f})")
    print(f"held-out loss now {L[-1]:.3f} at {D_now:,.0f} tokens; predicted with "
          + ", ".join(f"{k[1:]}x the tokens: {v:.3f}" for k, v in more.items()))
    xs = np.geomspace(D.min(), 10 * D_now, 200)
    ax.plot(D, L, "o", label="held-out loss")
    ax.plot(xs, law(xs), "-", label=f"fit: E={fit['E']:.2f}, alpha={fit['alpha']:.2f}")
    ax.plot([m * D_now for m in (2, 4, 10)], list(more.values()), "x", ms=9, color="C3", label="2x / 4x / 10x tokens")
    ax.axhline(fit["E"], color="k", lw=0.8, ls=":")
    keep(fit=fit, predicted_heldout_loss=more)
else:
    ax.plot([t["tokens_seen"]], [t["heldout_loss"]], "o", label="held-out loss (final, from train_report.json)")
    ax.text(0.5, 0.5, "a fit needs the training log (train_log.jsonl)\\nwith >= 4 held-out evaluations",
            transform=ax.transAxes, ha="center", va="center")
    print(f"{len(held)} held-out evaluations in the log: no fit (need >= 4)")
    keep(fit=None, predicted_heldout_loss=None)
ax.set(xscale="log", xlabel="tokens seen", ylabel="held-out loss (nats/token)", title="target: loss vs tokens")
ax.legend(fontsize=8)
plt.show()
""",
    """md:## The SmolLM2 drafter: held-out tau per CPU-hour
`checkpoints/smollm2/drafter_curve.json` (`python -m dflash_jax.train.tau_curve collect`): held-out tau at draft
lengths 3 and 7 (8 eval-split requests, greedy, 256 new tokens) against the training CPU time and the answer tokens
read, for the variants compared at equal small budgets (points) and the long run on the growing data set (line),
which started from the drafter shipped before it (the dashed level); squares: runs that branch off the long run with
another recipe (e.g. the drafter grown to 2 layers) beside its last leg.""",
    """
curve_file = root / "smollm2" / "drafter_curve.json"
fig, axs = plt.subplots(1, 2, figsize=(12, 3.8))
if curve_file.exists():
    curve = json.loads(curve_file.read_text())
    long, branches = curve["long"], curve.get("branches", [])
    base = curve.get("baseline") or {}
    for ax, xkey, scale, label in ((axs[0], "cpu_s", 3600, "training CPU-hours"),
                                   (axs[1], "answer_tokens_seen", 1e6, "answer tokens read (millions)")):
        for d, color in ((7, "C0"), (3, "C1")):
            if long:
                ax.plot([r[xkey] / scale for r in long], [r[f"tau_D{d}"] for r in long], "o-", color=color,
                        label=f"long run, D {d}")
            if base.get(f"tau_D{d}"):
                ax.axhline(base[f"tau_D{d}"], color=color, ls="--", lw=0.8, label=f"shipped before, D {d}")
            for name in dict.fromkeys(b["branch"] for b in branches):
                pts = [b for b in branches if b["branch"] == name]
                ax.plot([b[xkey] / scale for b in pts], [b[f"tau_D{d}"] for b in pts], "s", color=color, mfc="none",
                        label=f"{name} (after leg {pts[0]['after_leg']}), D {d}")
            for v in curve["variants"]:
                ax.plot([v[xkey] / scale], [v[f"tau_D{d}"]], "x" if d == 7 else "+", color=color, ms=8)
                if d == 7:
                    ax.annotate(v["name"], (v[xkey] / scale, v["tau_D7"]), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        ax.set(xlabel=label, ylabel="held-out tau")
    axs[0].legend(fontsize=7)
    keep(curve_variants={v["name"]: [v["tau_D3"], v["tau_D7"]] for v in curve["variants"]},
         curve_long=[[r["step"], r["tau_D3"], r["tau_D7"]] for r in long],
         curve_branches={b["name"]: [b["tau_D3"], b["tau_D7"]] for b in branches})
else:
    for ax in axs:
        ax.text(0.5, 0.5, "no checkpoints/smollm2/drafter_curve.json", transform=ax.transAxes, ha="center")
    keep(curve_variants=None, curve_long=None, curve_branches=None)
plt.show()
""",
]

SHARDING = [
    """md:# Several devices: the shipped pair on a data 2 x model 4 mesh
`make_mesh(data=2, model=4)` and `shard(model, mesh)` place every weight by the rules in `dflash_jax/parallel/sharding.py`
(tensor parallel over heads, MLP and vocabulary; data parallel over the batch); `generate` runs unchanged, as one
program. On this CPU the 8 devices are virtual (`--xla_force_host_platform_device_count=8`, set before jax starts),
so this shows placement and exactness, not speed.""",
    """
import os
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
""" + SETUP + """
import jax
import dflash_jax as dj
from dflash_jax.parallel.sharding import shard_fraction
from dflash_jax.train import corpus

CACHEABLE = dict(prefill_timing="rerun")  # no host callback in the program (a callback on a mesh rematerialises)

target, drafter, tok = dj.load_default(model="code-5m")  # the 5.8M trained pair (SmolLM2: model="smollm2")
prompts = [tok.encode(t) for t in corpus.held_out_prompts(8, seed=0)]
mesh = dj.make_mesh(data=2, model=4)
print(jax.device_count(), "devices; mesh", dict(mesh.shape))
st, sd = dj.shard(target, mesh), dj.shard(drafter, mesh)
one = dj.generate(target, drafter, prompts, max_new_tokens=32, eos_ids=(tok.eos_id,), **CACHEABLE)
eight = dj.generate(st, sd, prompts, max_new_tokens=32, eos_ids=(tok.eos_id,), **CACHEABLE)
same = bool(np.array_equal(one.tokens, eight.tokens))
print(f"greedy tokens on 8 devices == 1 device: {same}; tau {eight.tau:.2f} vs {one.tau:.2f}")
keep(devices=jax.device_count(), same_tokens=same, tau_1_device=one.tau, tau_8_devices=eight.tau)
""",
    """
leaves = {"embed_tokens": st.params.embed_tokens, "q_proj": st.params.layers[0].self_attn.q_proj,
          "k_proj": st.params.layers[0].self_attn.k_proj, "o_proj": st.params.layers[0].self_attn.o_proj,
          "gate_proj": st.params.layers[0].mlp.gate_proj, "down_proj": st.params.layers[0].mlp.down_proj,
          "input_layernorm": st.params.layers[0].input_layernorm}
fractions = {name: shard_fraction(x) for name, x in leaves.items()}
keep(shard_fraction=fractions)
fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(list(fractions), list(fractions.values()))
ax.set(ylabel="fraction held by one device", title="target layer 0 on a data 2 x model 4 mesh (1 = replicated)")
ax.tick_params(axis="x", rotation=30)
plt.show()
""",
]

# models: the shipped models whose files a notebook's record fingerprints (`fingerprint`), so a notebook goes stale
# when, and only when, a model it shows changes.
NOTEBOOKS = {
    "quickstart": dict(cells=QUICKSTART, figures=2, models=("code-5m",)),
    "nvfp4_drafter": dict(cells=NVFP4, figures=3, models=("code-5m",)),
    "acceptance_vs_length": dict(cells=ACCEPTANCE_VS_LENGTH, figures=1, models=("code-5m",)),
    "draft_trees": dict(cells=DRAFT_TREES, figures=1, models=("code-5m", "smollm2")),
    "training": dict(cells=TRAINING, figures=3, models=("code-5m", "smollm2")),
    "sharding": dict(cells=SHARDING, figures=1, models=("code-5m",)),
}


# -- building, executing, key numbers --------------------------------------------------------------------------------

def build(name: str) -> nbformat.NotebookNode:
    spec = NOTEBOOKS[name]
    nb = new_notebook(cells=[new_markdown_cell(c[3:]) if c.startswith("md:") else new_code_cell(c.strip())
                             for c in spec["cells"]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["dflash_jax"] = {"figures": spec["figures"], "generated_by": "notebooks/make_notebooks.py"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name[:20]}-{i}"  # stable ids: regenerating does not churn the diff
    return nb


def kernel_env(extra: dict | None = None) -> dict:
    """The kernel imports this checkout's dflash_jax, whatever the working directory or installed copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def execute(nb: nbformat.NotebookNode, *, timeout: int = 4 * 3600, env: dict | None = None,
            progress: str | None = None) -> nbformat.NotebookNode:
    """Run every cell (per-cell `timeout` in seconds: generous, a shared CPU can be many times slower than an idle one);
    with `progress`, print each code cell's wall time as it finishes."""
    from nbclient import NotebookClient

    t0 = time.perf_counter()
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]

    def report(cell, cell_index, **_):
        if progress and cell.cell_type == "code":
            print(f"  {progress}: cell {code.index(cell_index) + 1}/{len(code)} done at {time.perf_counter() - t0:.0f}s",
                  flush=True)

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}},
                            on_cell_complete=report)
    client.execute(env=kernel_env(env))
    return nb


def outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def figure_count(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb))


def errors(nb) -> list:
    return [f"{o.get('ename')}: {o.get('evalue')}" for o in outputs(nb) if o.output_type == "error"]


def key_numbers(nb) -> dict:
    """{kind: {name: value}} from the outputs `keep` displayed, in cell order."""
    keys: dict = {}
    for o in outputs(nb):
        for kind, values in o.get("data", {}).get(KEYS_MIME, {}).items():
            keys.setdefault(kind, {}).update(values)
    return keys


def fingerprint(models=("code-5m",)) -> str:
    """sha256 over the notebook's inputs among the shipped files: code-5m = the tokenizer, target and drafter with
    their training logs and reports; smollm2 = its drafter folder (weights, report, step tables but those of Q8
    activations) and its tau curve (the SmolLM2 target itself is the packaged GGUF)."""
    from dflash_jax.io.shipped import checkpoints_dir

    root = checkpoints_dir()
    h = hashlib.sha256()
    files = []
    if "code-5m" in models:
        files += [root / "tokenizer.json"] + sorted(p for d in ("target", "drafter") for p in (root / d).rglob("*")
                                                    if p.is_file())
    if "smollm2" in models:
        # (step tables of Q8 activations excluded: no notebook runs with them, so none can change a number)
        files += sorted(p for p in (root / "smollm2" / "drafter").rglob("*")
                        if p.is_file() and not p.name.endswith("-q8.json"))
        files += [root / "smollm2" / "drafter_curve.json"]
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def differences(committed: dict, fresh: dict) -> list[str]:
    """Key numbers of a fresh run that differ from the committed ones beyond noise (see the module docstring).

    Only names present in both are compared (a quick run computes a subset); timings never are.
    """
    out = []

    def close(a, b, tol, path):
        if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or a is None or b is None:
            if a != b:
                out.append(f"{path}: committed {a!r}, fresh {b!r}")
        elif isinstance(a, int) and isinstance(b, int):
            if a != b:
                out.append(f"{path}: committed {a}, fresh {b}")
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if not (math.isclose(a, b, rel_tol=tol[0], abs_tol=tol[1]) or (math.isnan(a) and math.isnan(b))):
                out.append(f"{path}: committed {a:.6g}, fresh {b:.6g} (tolerance rel {tol[0]}, abs {tol[1]})")
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{path}: committed {len(a)} values, fresh {len(b)}")
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    close(x, y, tol, f"{path}[{i}]")
        elif isinstance(a, dict) and isinstance(b, dict):
            if set(a) != set(b):
                out.append(f"{path}: committed keys {sorted(a)}, fresh {sorted(b)}")
            for k in set(a) & set(b):
                close(a[k], b[k], tol, f"{path}.{k}")
        else:
            out.append(f"{path}: committed {a!r}, fresh {b!r}")

    for kind, tol in TOLERANCE.items():
        a, b = committed.get(kind, {}), fresh.get(kind, {})
        for name in sorted(set(a) & set(b)):
            close(a[name], b[name], tol, f"{kind}.{name}")
    return out


def dump_record(record: dict) -> str:
    """JSON with one key number per line (lists stay on their line): small, readable diffs."""
    items = []
    for k, v in record.items():
        if isinstance(v, dict) and v:
            inner = ",\n".join(f"  {json.dumps(kk)}: {json.dumps(vv)}" for kk, vv in v.items())
            items.append(f" {json.dumps(k)}: {{\n{inner}\n }}")
        else:
            items.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(items) + "\n}\n"


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes (the kernels): on a shared machine, wall time says little."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def make(name: str, *, run: bool) -> dict | None:
    nb = build(name)
    if not run:
        nbformat.write(nb, HERE / f"{name}.ipynb")
        return None
    if os.environ.get(QUICK_ENV):
        raise RuntimeError(f"unset {QUICK_ENV}: the committed notebooks are the full-size runs")
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    execute(nb, progress=name)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if errors(nb):
        raise RuntimeError(f"{name}: the notebook raised {errors(nb)}")
    want, got = nb.metadata["dflash_jax"]["figures"], figure_count(nb)
    if got != want:
        raise RuntimeError(f"{name}: {got} figures, the notebook promises {want}")
    keys = key_numbers(nb)
    record = {"notebook": f"{name}.ipynb", "figures": got, "models": fingerprint(NOTEBOOKS[name]["models"]),
              "executed_in_s": round(wall, 1), **keys}
    nbformat.write(nb, HERE / f"{name}.ipynb")
    (HERE / f"{name}.json").write_text(dump_record(record))
    size = (HERE / f"{name}.ipynb").stat().st_size
    print(f"{name}: executed in {wall:.0f}s (kernel CPU {cpu:.0f}s), {got} figures, {size / 1e3:.0f} kB", flush=True)
    return record


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"notebooks to write, of {', '.join(NOTEBOOKS)} (default: all)")
    ap.add_argument("--execute", action="store_true",
                    help="run them on the shipped models and store outputs, figures and key numbers")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in NOTEBOOKS]
    if unknown:
        ap.error(f"unknown notebook(s) {unknown}; choose from {list(NOTEBOOKS)}")
    t0, failed = time.perf_counter(), []
    for name in args.names or list(NOTEBOOKS):
        try:
            make(name, run=args.execute)
        except Exception as e:  # the others still run; nothing of a failed notebook is written
            print(f"{name}: FAILED: {e}", file=sys.stderr, flush=True)
            failed.append(name)
    if args.execute:
        print(f"total {time.perf_counter() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
