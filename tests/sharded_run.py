"""The multi-device half of tests/test_sharding.py, run in a subprocess (XLA_FLAGS must be set before jax starts).

`python tests/sharded_run.py OUT.json` on 8 (virtual CPU) devices; with `--process-id I --num-processes N --port P`
it is one of N processes of a jax.distributed job (CPU collectives over gloo) and runs only the generation checks.
Prints nothing that matters: the test reads OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    return p.parse_args()


ARGS = _args()
from dflash_jax.bench.mesh import xla_flags_with_devices  # noqa: E402 (creates no JAX backend)

# The suite's XLA flags (tests/conftest.py) are kept; an inherited device count is replaced.
os.environ["XLA_FLAGS"] = xla_flags_with_devices(ARGS.devices)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(HERE))

import jax  # noqa: E402

if ARGS.process_id is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{ARGS.port}", num_processes=ARGS.num_processes,
                               process_id=ARGS.process_id)

import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax.decode import programs as G  # noqa: E402
from dflash_jax.parallel import sharding as S  # noqa: E402
from dflash_jax.config import DrafterConfig, TargetConfig  # noqa: E402
from dflash_jax.models.drafter import draft_proposal  # noqa: E402
from dflash_jax.params import named_leaves  # noqa: E402
from random_models import make_drafter, make_target, nontrivial_dflash2  # noqa: E402

# Tiny, but every rule is exercised: 4 query heads over model=4 (1 each), 2 KV heads (< 4: replicated), intermediate
# and vocabulary split in 4, head_dim 16 so that NVFP4 o_proj / down_proj shards hold whole 16-blocks.
CFG = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
DCFG = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=95, target_layer_ids=(0, 1),
                     num_target_layers=2)
# DFlash2: the conv's dynamic taps and the selector's codebooks (vocabulary axis: split in 4) under the same rules.
DCFG2 = DCFG.replace(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=6)
N = 10


def prompts(batch=8):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 95, n).tolist() for n in (5, 11, 7, 3, 9, 14, 2, 8)[:batch]]


def main():
    out: dict = {"devices": len(jax.devices()), "processes": jax.process_count()}
    target, drafter = make_target(CFG, 0), make_drafter(DCFG, 1)
    qdrafter = dj.quantize_nvfp4(drafter)
    mesh = S.make_mesh(data=2, model=len(jax.devices()) // 2)
    ts, ds, qs = S.shard(target, mesh), S.shard(drafter, mesh), S.shard(qdrafter, mesh)
    P8 = prompts()
    multi = jax.process_count() > 1

    # Greedy and sampled tokens: one device vs the mesh (dense and NVFP4 drafter, speculative and autoregressive).
    # Several processes: the same code path, fewer programs to compile twice over; only the mesh runs, their tokens
    # compared (by the test) with the one-device tokens of the single-process run, which runs the same models,
    # prompts and settings.
    runs = {}
    for name, fn in [
        ("greedy", lambda t, d: dj.generate(t, d, P8, max_new_tokens=N)),
        ("nvfp4", lambda t, d: dj.generate(t, d[1], P8, max_new_tokens=N)),
        ("sampled", lambda t, d: dj.generate(t, d[0], P8, max_new_tokens=N, temperature=0.8, top_k=20, seed=3)),
        ("autoregressive", lambda t, d: dj.generate_autoregressive(t, P8, max_new_tokens=N)),
    ][:3 if multi else 4]:
        if multi:
            many = fn(ts, ds) if name == "greedy" else fn(ts, (ds, qs))
            runs[name] = (None, many)
            out[f"{name}_tokens"] = np.asarray(many.tokens).tolist()
            out[f"{name}_tau"] = many.tau
            continue
        if name == "greedy":
            one = fn(target, drafter)
            t0 = time.perf_counter()
            many = fn(ts, ds)
            wall = time.perf_counter() - t0
            again = fn(ts, ds)
            out["greedy_compile_s"] = [one.timings["compile_s"], many.timings["compile_s"], wall]
            out["second_call_compile_s"] = again.timings["compile_s"]
            out["second_call_same"] = bool(np.array_equal(again.tokens, many.tokens))
        else:
            one, many = fn(target, (drafter, qdrafter)), fn(ts, (ds, qs))
        runs[name] = (one, many)
        out[f"{name}_equal"] = float((one.tokens == many.tokens).mean())
        out[f"{name}_tau"] = [one.tau, many.tau]
        out[f"{name}_one_device_tokens"] = np.asarray(one.tokens).tolist()
    # A batch the data axis does not divide: padded with inert rows that never reach the result (the same program).
    b7 = dj.generate(ts, ds, P8[:7], max_new_tokens=N)
    out["pad7_shape"] = list(b7.tokens.shape)
    # (several processes: the batch-8 mesh tokens, themselves compared with one device's by the test)
    out["pad7_equal"] = bool(np.array_equal(b7.tokens, runs["greedy"][1 if multi else 0].tokens[:7]))
    out["pad7_compile_s"] = b7.timings["compile_s"]

    # HF safetensors straight into shards (each process / device reads its own slices), dense bf16 and NVFP4.
    folder = Path(ARGS.out).parent / f"ckpt{jax.process_index()}"
    dj.save_hf(folder / "target", target, dtype="bfloat16")
    dj.save_hf(folder / "drafter", qdrafter)
    lt = dj.load_target(folder / "target", param_dtype="bfloat16", mesh=mesh)
    ld = dj.load_drafter(folder / "drafter", mesh=mesh)
    ref_t, ref_d = dj.load_target(folder / "target", param_dtype="bfloat16"), dj.load_drafter(folder / "drafter")

    def same_placement_and_values(a, b, ref):
        for x, y, r in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(ref)):
            if x.sharding != y.sharding or x.dtype != r.dtype:
                return False
            for sx in x.addressable_shards:  # each local shard equals the same slice of the one-device load
                if not np.array_equal(np.asarray(sx.data), np.asarray(r)[sx.index]):
                    return False
        return True
    out["loaded_target_ok"] = same_placement_and_values(lt, S.shard(ref_t, mesh), ref_t)
    out["loaded_drafter_ok"] = same_placement_and_values(ld, qs, ref_d)
    out["loaded_dtype"] = str(lt.params.embed_tokens.dtype)
    if multi:
        return out

    # Each device holds 1/4 of every tensor-parallel weight (q/o heads, gate/up/down, vocabulary), all of the rest.
    def fractions(model):
        return {name: S.shard_fraction(x) for name, x in named_leaves(model.params).items()
                if not isinstance(x, dj.NVFP4Array)}
    out["target_fractions"] = fractions(ts)
    out["drafter_fractions"] = fractions(ds)
    out["nvfp4_fractions"] = {
        name: [S.shard_fraction(x.packed), S.shard_fraction(x.block_scale), S.shard_fraction(x.global_scale)]
        for name, x in named_leaves(qs.params).items() if isinstance(x, dj.NVFP4Array)}
    out["devices_per_weight"] = len(ts.params.layers[0].mlp.down_proj.addressable_shards)

    # The sharded NVFP4 drafter's draft logits equal one device's (its scales are audited below, on the DFlash2
    # drafter, whose NVFP4 leaves are these (fc, q/k/v/o, gate/up/down) under the same rules plus conv and selector).
    feats = np.random.default_rng(0).standard_normal((2, 6, 2 * CFG.hidden_size)).astype(np.float32)
    block = np.array([[3, 95, 95, 95], [7, 95, 95, 95]], np.int32)
    out["sharded_draft_logits_close"] = bool(np.allclose(np.asarray(dj.draft_logits(ts, qs, feats, block)),
                                                         np.asarray(dj.draft_logits(target, qdrafter, feats, block)),
                                                         atol=1e-4, rtol=1e-4))

    # A DFlash2 drafter (conv + selector non-trivial), dense and NVFP4: greedy tokens equal to one device, and the
    # sharded NVFP4 conv / selector projections still pass the audit.
    d2 = make_drafter(DCFG2, 3)
    d2 = d2.replace(params=nontrivial_dflash2(d2.params, 4))
    q2 = dj.quantize_nvfp4(d2)
    d2s, q2s = S.shard(d2, mesh), S.shard(q2, mesh)
    for name, (one_d, many_d) in (("dflash2", (d2, d2s)), ("dflash2_nvfp4", (q2, q2s))):
        one, many = dj.generate(target, one_d, P8, max_new_tokens=N), dj.generate(ts, many_d, P8, max_new_tokens=N)
        out[f"{name}_equal"] = float((one.tokens == many.tokens).mean())
        out[f"{name}_tau"] = [one.tau, many.tau]
    out["dflash2_fractions"] = {name: S.shard_fraction(x) for name, x in named_leaves(d2s.params).items()
                                if "conv" in name or "selector" in name}
    # audit_scales on the sharded NVFP4 DFlash2 drafter: every scale still reaches the output through `linear`.
    # draft_proposal (logits and selector scores): the selector's hidden_projection never reaches draft_logits.
    audit2 = dj.audit_scales(lambda p: draft_proposal(ts, q2s.replace(params=p), feats, block), q2s.params)
    out["dflash2_audit_checked"], out["dflash2_audit_missing"] = list(audit2.checked), list(audit2.missing)

    # Collectives of the compiled speculative program (dense and NVFP4 drafter): none gathers a weight in the loop.
    for name, d in (("dense", ds), ("nvfp4", qs)):
        call = G.speculative_call(ts, d, P8, max_new_tokens=N)
        hlo = call.compiled_text()
        out[f"hlo_{name}"] = S.hlo_collectives(hlo, S.weight_shapes(ts, d))

    # Bad input, refused before anything compiles.
    traces = dict(G.TRACE_COUNTS)
    errors = {}

    def refused(key, fn):
        try:
            fn()
            errors[key] = None
        except S.ShardingError as e:
            errors[key] = str(e)
    refused("model8", lambda: S.shard(target, S.make_mesh(data=1, model=8)))
    other = S.make_mesh(data=4, model=2)
    refused("two_meshes", lambda: dj.generate(ts, S.shard(drafter, other), P8, max_new_tokens=N))
    refused("unsharded_drafter", lambda: dj.generate(ts, drafter, P8, max_new_tokens=N))
    odd = DCFG.replace(model=DCFG.model.replace(intermediate_size=96))  # 24 inputs of down_proj per shard
    refused("nvfp4_blocks", lambda: S.shard(dj.quantize_nvfp4(make_drafter(odd, 2)), mesh))
    refused("mesh_axes", lambda: S.shard(target, jax.sharding.Mesh(np.array(jax.devices()), ("x",))))
    out["errors"] = errors
    out["traces_after_errors"] = dict(G.TRACE_COUNTS) == traces
    return out


if __name__ == "__main__":
    result = main()
    if jax.process_index() == 0:
        Path(ARGS.out).write_text(json.dumps(result, indent=1))
    else:
        Path(ARGS.out + f".{jax.process_index()}").write_text(json.dumps(result, indent=1))
