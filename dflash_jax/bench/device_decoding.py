"""The device report's decoding sections: per-step costs (r, c) on a random Qwen3-8B-shaped target with dense and
NVFP4 drafters, a hybrid target at Qwen3.5-27B-like shapes, the decode core (loops lowered for CUDA, prefill memory,
long-cache attention, backend agreement in bf16), the embedded pair end to end, and the programs compiled for
prompt lengths with greedy exactness in bfloat16."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench import compile as compilebench
from dflash_jax.bench import speculative as bench
from dflash_jax.bench.device_linear import QWEN3_8B_SHAPES, SMOKE_SHAPES
from dflash_jax.bench.device_record import Report
from dflash_jax.bench.lowering import loop_report, speculative_module
from dflash_jax.bench.step_costs import format_step_costs, step_costs
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decode import programs as G
from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.models.drafter import init_drafter
from dflash_jax.models.target import init_target
from dflash_jax.quant.linear import linear, resolve_backend, set_default_backend
from dflash_jax.quant.nvfp4 import quantize
from dflash_jax.quant.quantize import quantize_nvfp4
from dflash_jax.train import corpus


# -- 3. step costs on a random Qwen3-8B-shaped target ------------------------------------------------------------

def _qwen3_8b_pair(target_layers: int, drafter_layers: int, smoke: bool):
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if smoke:
        cfg = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=target_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, param_dtype=dtype,
                          compute_dtype=dtype)
    else:  # Qwen3-8B shapes (36 layers in the real model)
        cfg = TargetConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_hidden_layers=target_layers, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, param_dtype=dtype, compute_dtype=dtype)
    taps = tuple(sorted({min(target_layers - 1, max(0, round(1 + i * (target_layers - 2) / 4))) for i in range(5)}))
    dcfg = DrafterConfig(cfg.replace(num_hidden_layers=drafter_layers), 16, cfg.vocab_size - 1, taps, target_layers)
    return init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))


def step_cost_section(report: Report, smoke: bool, target_layers: int) -> dict:
    t0 = time.perf_counter()
    target, dense = _qwen3_8b_pair(target_layers, 1 if smoke else 5, smoke)
    q = quantize_nvfp4(dense)
    jax.block_until_ready((target, dense, q))
    out = {"target_layers": target_layers, "drafter_layers": dense.config.model.num_hidden_layers,
           "target_layer_ids": list(dense.config.target_layer_ids),
           "hidden": target.config.hidden_size, "vocab": target.config.vocab_size,
           "dtype": target.config.compute_dtype, "setup_s": time.perf_counter() - t0, "drafters": {}}
    kw = dict(context_len=64 if smoke else 256, draft_length=15 if not smoke else 3, reps=3 if smoke else 20)
    # On CPU (smoke) pallas runs interpreted: it checks the path, not a speed.
    variants = [("dense", dense, None), ("nvfp4 pallas", q, "pallas"), ("nvfp4 portable", q, "portable")]
    for name, d, backend in variants:
        if report.left() < (5 if smoke else 60):
            report.skip(f"step costs {name}", "time budget nearly spent")
            continue
        try:
            set_backend(backend)
            c = step_costs(target, d, **kw)
            out["drafters"][name] = c
            print("  " + name + ": " + format_step_costs(c).replace("\n", " | "), flush=True)
        except Exception as e:
            out["drafters"][name] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        finally:
            set_backend(None)
        report.section("step_costs", out)
    dense_c = next((v.get("c") for k, v in out["drafters"].items() if "dense" in k), None)
    for name, v in out["drafters"].items():
        if dense_c and "c" in v and "dense" not in name:
            v["c_over_dense"] = v["c"] / dense_c
    report.section("step_costs", out)
    return out


# Qwen3.5-27B-like shapes for one layer of each kind (taken as: hidden 5120, MLP 17408, gated attention 24 q / 4 KV
# heads of 256 with a quarter rotated, DeltaNet 16 key / 48 value heads of 128, conv kernel 4, vocabulary 248,320).
QWEN3_5_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                   num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
HYBRID_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)


def _hybrid_pair(smoke: bool, dtype: str | None = None):
    """A random hybrid target with one Gated DeltaNet and one gated-attention layer, and a 1-layer DFlash drafter
    tapping both layers (dtype: float32 on CPU, bfloat16 on accelerators, unless given)."""
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    shape = HYBRID_SMOKE if smoke else QWEN3_5_27B
    cfg = TargetConfig(num_hidden_layers=2, model_type="qwen3_5", layer_types=("linear_attention", "full_attention"),
                      partial_rotary_factor=0.25, rope_theta=1e7, param_dtype=dtype, compute_dtype=dtype, **shape)
    heads = (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16) if smoke else
             dict(num_attention_heads=cfg.hidden_size // 128, num_key_value_heads=8, head_dim=128))
    dmodel = TargetConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=1, param_dtype=dtype,
                         compute_dtype=dtype, **heads)
    dcfg = DrafterConfig(dmodel, 8, cfg.vocab_size - 1, (0, 1), 2)
    return init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))


def hybrid_section(report: Report, smoke: bool) -> dict:
    """A hybrid target on the device (its DeltaNet states must roll back exactly after a partial acceptance): the
    verify (with that rollback) vs autoregressive step cost at D = 7 and 15, the DeltaNet state bytes per row, and
    greedy speculative == autoregressive."""
    t0 = time.perf_counter()
    target, drafter = _hybrid_pair(smoke)
    jax.block_until_ready((target, drafter))
    cfg = target.config
    out = {"shape": "smoke" if smoke else "Qwen3.5-27B-like, one layer of each kind", "hidden": cfg.hidden_size,
           "vocab": cfg.vocab_size, "dtype": cfg.compute_dtype, "setup_s": time.perf_counter() - t0, "steps": {}}
    for D in ((3,) if smoke else (7, 15)):
        if report.left() < (5 if smoke else 60):
            report.skip(f"hybrid step costs D={D}", "time budget nearly spent")
            continue
        c = step_costs(target, drafter, context_len=64 if smoke else 256, draft_length=D, reps=3 if smoke else 20)
        out["steps"][f"D{D}"] = c
        print(f"  hybrid D={D}: " + format_step_costs(c).replace("\n", " | ")
              + f" | DeltaNet state {c['state_bytes_per_row'] / 2 ** 20:.2f} MiB per row", flush=True)
        report.section("hybrid", out)
    if not smoke and report.left() > 60:  # the loop with rollback on the device (CPU: tests/test_hybrid.py)
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (37, 64)]
        sp = G.generate(target, drafter, prompts, max_new_tokens=64, eos_ids=())
        ar = G.generate_autoregressive(target, prompts, max_new_tokens=64, eos_ids=())
        out["greedy_identical_rows"] = sum(a == b for a, b in zip(sp.token_lists(), ar.token_lists()))
        out["rows"], out["tau"] = len(prompts), sp.tau
        print(f"  hybrid greedy speculative == autoregressive: {out['greedy_identical_rows']}/{len(prompts)} rows "
              f"(tau {sp.tau:.2f}, random drafter)", flush=True)
    report.section("hybrid", out)
    return out


def hybrid_exact_section(report: Report, smoke: bool) -> dict:
    """Greedy speculative == autoregressive on the hybrid target in float32 compute on the device. The bfloat16 check
    above may part at a near-tie (a random target's logits are nearly flat); float32 is where equality is promised,
    so a mismatch here is a bug, not a rounding (dots at full float32 precision, not a GPU's default TF32)."""
    target, drafter = _hybrid_pair(smoke, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, target.config.vocab_size, n)) for n in ((5, 9) if smoke else (37, 64))]
    new = 8 if smoke else 64
    with jax.default_matmul_precision("highest"):  # a GPU's default runs float32 dots in TF32
        sp = G.generate(target, drafter, prompts, max_new_tokens=new, eos_ids=())
        ar = G.generate_autoregressive(target, prompts, max_new_tokens=new, eos_ids=())
    out = {"dtype": "float32 (matmul precision highest)", "rows": len(prompts), "max_new_tokens": new, "tau": sp.tau,
           "greedy_identical_rows": sum(a == b for a, b in zip(sp.token_lists(), ar.token_lists()))}
    print(f"  hybrid float32 greedy speculative == autoregressive: {out['greedy_identical_rows']}/{len(prompts)} rows "
          f"(tau {sp.tau:.2f}, random drafter)", flush=True)
    report.section("hybrid_exact", out)
    return out


def set_backend(backend: str | None):
    # generate's programs are keyed on the backend resolved per call, so setting the default is enough
    set_default_backend(backend)


# -- 4b. the decode core: what a step costs the device beyond its matmuls --------------------------------------

def _lowering_counts(smoke: bool) -> dict:
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
    dcfg = DrafterConfig(cfg.replace(num_hidden_layers=1), 4, 63, (0, 1), 2)
    target, drafter = init_target(cfg, jax.random.key(0)), init_drafter(dcfg, jax.random.key(1))
    out = {}
    for name, kw in (("greedy", {}), ("sampled", dict(temperature=0.8, top_k=5, top_p=0.9, p_min=0.05))):
        text = speculative_module(target, drafter, [list(range(1, 21))], chunk=8, max_new_tokens=16, **kw)
        out[name] = loop_report(text)
        print(f"  lowered for CUDA, {name}: {out[name]}", flush=True)
    return out


def _bf16_backend_agreement(smoke: bool) -> dict:
    n, k = SMOKE_SHAPES[0] if smoke else QWEN3_8B_SHAPES[0]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, k)), jnp.bfloat16)
    q = quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.02, jnp.float32))
    ys = {b: np.asarray(jax.jit(lambda x, q, b=b: linear(x, q, backend=b))(x, q).astype(jnp.float32))
          for b in ("portable", "pallas")}
    rel = float(np.max(np.abs(ys["pallas"] - ys["portable"])) / np.max(np.abs(ys["portable"])))
    print(f"  bf16 {n}x{k}, M=4: max |pallas - portable| / max |portable| = {rel:.2e}", flush=True)
    return {"shape": [n, k], "m": 4, "max_rel_diff": rel}


def decode_core_section(report: Report, smoke: bool) -> dict:
    """What a step costs the device beyond its matmuls: no host round trip inside a step (loops lowered for CUDA),
    bounded prefill memory, long-cache attention, NVFP4 backends agreeing in bf16. Each part records its own failure
    instead of losing the others."""
    out: dict[str, Any] = {}

    def part(name, fn):
        if report.left() < (5 if smoke else 30):
            report.skip(f"decode core {name}", "time budget nearly spent")
            return
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"unavailable": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        report.section("decode_core", out)

    part("lowering", lambda: _lowering_counts(smoke))

    def prefill_memory():
        small = (512, 2048) if smoke else (2048, 8192)
        a, b = (compilebench.prefill_temp_bytes(compilebench.SMALL_PREFILL, n) for n in small)
        res = {"small_tokens": list(small), "small_bytes": [a, b], "ratio": b / a}
        if not smoke:
            res["qwen3_8b_layer_32k_bytes"] = compilebench.prefill_temp_bytes(compilebench.QWEN3_8B_LAYER, 32768)
        print(f"  prefill temp memory: {res}", flush=True)
        return res

    part("prefill_memory", prefill_memory)

    def long_cache():
        target, drafter = _qwen3_8b_pair(2, 1, smoke)
        lens = (32, 96) if smoke else (256, 16384)
        return compilebench.attention_section(target, drafter, live=8 if smoke else 64, cache_lens=lens,
                                              reps=2 if smoke else 10)

    part("long_cache_attention", long_cache)
    part("nvfp4_bf16_agreement", lambda: _bf16_backend_agreement(smoke))
    return out


# -- 4. the embedded pair ---------------------------------------------------------------------------------------

def embedded_section(report: Report, smoke: bool) -> dict:
    root = checkpoints_dir()
    # bfloat16 as on a GPU; the CPU smoke run too (the programs section below then reuses its compiled programs)
    dtype = "float32" if jax.default_backend() == "cpu" and not smoke else "bfloat16"
    target = load_target(root / "target", param_dtype=dtype, compute_dtype=dtype)
    drafter = load_drafter(root / "drafter", param_dtype=dtype, compute_dtype=dtype)
    tok = Tokenizer.from_file(root / "tokenizer.json")
    n_prompts, new = (1, 8) if smoke else (6, 128)
    prompts = [tok.encode(t) for t in corpus.held_out_prompts(n_prompts, seed=0)]
    q = quantize_nvfp4(drafter)
    set_backend(None)
    res = bench.compare(target, drafter, prompts, max_new_tokens=new, eos_ids=(), drafters={"nvfp4": q})
    out = {"dtype": dtype, "prompts": n_prompts, "max_new_tokens": new, "nvfp4_backend": resolve_backend(),
           "ar_tokens_per_s": res["ar_tokens_per_s"]}
    for name in ("dflash", "nvfp4"):
        r = res[name]
        out[name] = {k: r[k] for k in ("tokens_per_s", "tau", "acceptance_rate", "speedup", "exact_match")}
        print(f"  embedded {name}: tau {r['tau']:.2f}, {r['tokens_per_s']:.1f} tok/s, speedup {r['speedup']:.2f}x, "
              f"exact {r['exact_match']}", flush=True)
    report.section("embedded", out)
    return out


# -- 4c. programs compiled per prompt length, and bf16 exactness ------------------------------------------------

def programs_section(report: Report, smoke: bool) -> dict:
    """The embedded pair in bfloat16 compute: greedy speculative vs autoregressive over 32 prompts x 256 tokens
    (mismatch rate, first divergence), and the programs compiled for prompt lengths spread over 1..1000 (prefill and
    loop counted apart: a new prompt bucket should compile prefill only)."""
    root = checkpoints_dir()
    target = load_target(root / "target", param_dtype="bfloat16", compute_dtype="bfloat16")
    drafter = load_drafter(root / "drafter", param_dtype="bfloat16", compute_dtype="bfloat16")
    tok = Tokenizer.from_file(root / "tokenizer.json")
    set_backend(None)
    n_prompts, new = (2, 8) if smoke else (32, 256)
    prompts = [tok.encode(t) for t in corpus.held_out_prompts(n_prompts, seed=0)]
    ex = bench.bf16_exactness(target, drafter, prompts, max_new_tokens=new)
    print("  " + bench.format_bf16_exactness(ex), flush=True)
    n_lens, max_len = (3, 40) if smoke else (20, 1000)
    p0, l0 = G.TRACE_COUNTS["prefill"], G.TRACE_COUNTS["speculative"]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for n in np.linspace(1, max_len, n_lens).astype(int):
        G.generate(target, drafter, [rng.integers(2, tok.vocab_size, int(n)).tolist()], max_new_tokens=8,
                       eos_ids=(), prefill_timing=bench.PREFILL_TIMING)
    counts = {"prompt_lengths": n_lens, "max_len": max_len, "prefill_programs": G.TRACE_COUNTS["prefill"] - p0,
              "loop_programs": G.TRACE_COUNTS["speculative"] - l0, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"  {n_lens} prompt lengths over 1..{max_len}: {counts['loop_programs']} loop program(s), "
          f"{counts['prefill_programs']} prefill programs ({counts['seconds']} s)", flush=True)
    out = {"bf16_exactness": ex, "compiles": counts}
    report.section("programs", out)
    return out


__all__ = ["step_cost_section", "hybrid_section", "hybrid_exact_section", "decode_core_section", "embedded_section",
           "programs_section", "set_backend"]
