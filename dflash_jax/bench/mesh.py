"""Benchmark: one device vs a (data x model) mesh, for the embedded pair and a random Qwen3-8B-shaped pair with few
layers; and host memory when a big bf16 checkpoint is loaded straight into shards.

    python -m dflash_jax.bench.mesh                         # 8 virtual CPU devices, mesh data 2 x model 4
    python -m dflash_jax.bench.mesh --skip-8b --load-gb 2   # + peak host memory loading a 2 GB bf16 checkpoint

Per model: compile time, decode tokens/s and greedy exactness (sharded tokens == one-device tokens) for the dense and
the NVFP4 drafter, and the collectives per decode step found in the compiled HLO (none may all-gather a weight).
On CPU the "devices" are threads of one host sharing its cores: the point here is exactness and the program's
communication, not speed; run on a real accelerator mesh for speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m dflash_jax.bench.mesh", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices when running on CPU (default 8)")
    p.add_argument("--data", type=int, default=2)
    p.add_argument("--model", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=2, help="target layers of the Qwen3-8B-shaped pair (drafter: 1)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary of the Qwen3-8B-shaped pair")
    p.add_argument("--skip-embedded", action="store_true")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--load-gb", type=float, default=0.0, help="also measure peak host memory loading a random bf16 "
                                                                "checkpoint of about this many GB into one shard "
                                                                "per device (mesh 1 x devices; 0: skip)")
    p.add_argument("--smoke", action="store_true", help="tiny random models and checkpoint instead (a quick check of "
                                                        "the script; on fewer devices than data x model, a 1 x 1 mesh)")
    p.add_argument("--measure-load", default=None, help=argparse.SUPPRESS)  # internal: the loading subprocess
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def xla_flags_with_devices(devices: int) -> str:
    """This process's XLA_FLAGS with the virtual CPU device count set to `devices`: the user's other flags are kept
    and an inherited device count is replaced (XLA keeps the first of two)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    return " ".join(flags.split() + [f"--xla_force_host_platform_device_count={devices}"])


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None:  # virtual CPU devices must be asked for before jax creates its CPU client (first device use)
    os.environ["XLA_FLAGS"] = xla_flags_with_devices(ARGS.devices)

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from dflash_jax.decode import programs as G  # noqa: E402
from dflash_jax.decode.programs import generate  # noqa: E402
from dflash_jax.io.checkpoint import load_target  # noqa: E402
from dflash_jax.io.hf_config import target_config_to_hf  # noqa: E402
from dflash_jax.io.shipped import load_default  # noqa: E402
from dflash_jax.models.drafter import Drafter  # noqa: E402
from dflash_jax.models.target import Target  # noqa: E402
from dflash_jax.quant.quantize import quantize_nvfp4  # noqa: E402
from dflash_jax.parallel import sharding as S  # noqa: E402
from dflash_jax.config import DrafterConfig, TargetConfig  # noqa: E402
from dflash_jax.io.safetensors_io import write_safetensors  # noqa: E402
from dflash_jax.params import abstract_drafter, abstract_target  # noqa: E402
from dflash_jax.params import abstract_target, named_leaves  # noqa: E402
from dflash_jax.params import is_spec  # noqa: E402


def qwen3_8b_shaped(layers: int, vocab: int) -> tuple[TargetConfig, DrafterConfig]:
    """Qwen3-8B's widths (hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128) with `layers` layers."""
    cfg = TargetConfig(vocab_size=vocab, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      param_dtype="bfloat16", compute_dtype="float32")
    taps = tuple(sorted({0, layers - 1}))
    dcfg = DrafterConfig(model=cfg.replace(num_hidden_layers=1), block_size=16, mask_token_id=vocab - 1,
                         target_layer_ids=taps, num_target_layers=layers)
    return cfg, dcfg


def _random(model_cls, abstract, cfg_dtype, seed):
    """Random params (std 0.02, norms 1) drawn with numpy, one tensor at a time."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        if spec.init == "ones":
            return np.ones(spec.shape, cfg_dtype)
        return (0.02 * rng.standard_normal(spec.shape, np.float32)).astype(cfg_dtype)
    return jax.tree.map(draw, abstract, is_leaf=is_spec)


def random_pair(cfg: TargetConfig, dcfg: DrafterConfig, seed: int = 0):
    dt = np.dtype(cfg.storage_dtype)
    target = Target(params=_random(Target, abstract_target(cfg), dt, seed), config=cfg)
    drafter = Drafter(params=_random(Drafter, abstract_drafter(dcfg), dt, seed + 1), config=dcfg)
    return jax.device_put(target, jax.devices()[0]), jax.device_put(drafter, jax.devices()[0])


def _prompts(vocab: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - 1, int(n)).tolist() for n in rng.integers(4, 30, batch)]


def compare(name: str, target, drafter, mesh, prompts, max_new: int) -> dict:
    """One device vs `mesh`: compile time, decode tok/s (a second, compiled run), greedy exactness, collectives."""
    out = {"model": name}
    ts, ds = S.shard(target, mesh), S.shard(drafter, mesh)
    many = str(mesh.devices.size) if mesh.devices.size > 1 else "mesh1"  # a 1 x 1 mesh (--smoke on one device)
    for where, (t, d) in (("1", (target, drafter)), (many, (ts, ds))):
        first = generate(t, d, prompts, max_new_tokens=max_new, prefill_timing="rerun")
        again = generate(t, d, prompts, max_new_tokens=max_new, prefill_timing="rerun")
        out[f"compile_s_{where}"] = round(first.timings["compile_s"], 2)
        out[f"decode_tok_s_{where}"] = round(again.decode_tokens_per_second, 2)
        out[f"tau_{where}"] = round(again.tau, 3)
        out[f"tokens_{where}"] = again.tokens
    out["greedy_equal"] = float((out.pop("tokens_1") == out.pop(f"tokens_{many}")).mean())
    call = G.speculative_call(ts, ds, prompts, max_new_tokens=max_new, prefill_timing="rerun")
    hlo = call.compiled_text()
    coll = S.hlo_collectives(hlo, S.weight_shapes(ts, ds))
    out["collectives_per_step"] = {k: v for k, v in coll["decode_loop"].items() if v}
    out["weight_all_gathers_in_loop"] = len(coll["weight_all_gathers"])
    tp = [S.shard_fraction(x) for x in (ts.params.layers[0].self_attn.q_proj, ts.params.layers[0].mlp.down_proj,
                                        ts.params.embed_tokens)]
    out["tp_weight_fraction_per_device"] = sorted(set(round(f, 4) for f in tp))
    return out


# -- loading a big checkpoint ----------------------------------------------------------------------------------------

def load_config(gb: float, model: int) -> TargetConfig:
    """A Qwen3-shaped bf16 config of about `gb` GB whose heads, intermediate and vocabulary split over `model`."""
    H, I, V = (2048, 6144, 32768) if gb >= 0.5 else (256, 768, 4096)
    per_layer = 3 * H * H + 3 * H * I  # q, o, k+v (16 query / 8 KV heads of H/16: k+v = H*H), mlp
    layers = max(1, int(round((gb * 1e9 / 2 - 2 * V * H) / per_layer)))
    return TargetConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=H // 16, param_dtype="bfloat16")


def write_random_checkpoint(folder: Path, cfg: TargetConfig, file_gb: float = 0.5) -> int:
    """A random HF Qwen3 checkpoint (bf16) in several safetensors files with an index; returns its bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(target_config_to_hf(cfg)))
    rng = np.random.default_rng(0)
    files, current, size, total, weight_map = [], {}, 0, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(files) + 1:05d}.safetensors"
            write_safetensors(folder / name, current, {"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in current})
            current, size = {}, 0
    for name, spec in named_leaves(abstract_target(cfg)).items():
        key = ("model." + name if name != "lm_head" else name) + ".weight"
        arr = (np.ones(spec.shape, np.float32) if spec.init == "ones"
               else 0.02 * rng.standard_normal(spec.shape, np.float32)).astype(ml_dtypes.bfloat16)
        current[key] = arr
        size += arr.nbytes
        total += arr.nbytes
        if size >= file_gb * 1e9:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
    return total


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure_load(folder: str, data: int, model: int) -> dict:
    """(In a fresh process.) Peak resident memory while loading `folder` into a data x model mesh, bf16."""
    mesh = S.make_mesh(data=data, model=model)
    jax.block_until_ready(jax.numpy.zeros(8))  # the runtime's own memory is part of the baseline
    base = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    target = load_target(folder, param_dtype="bfloat16", mesh=mesh)
    jax.block_until_ready(target)
    wall = time.perf_counter() - t0
    leaf = target.params.layers[0].mlp.gate_proj
    return {"baseline_rss_mb": base / 1024, "peak_rss_mb": _rss_kb("VmHWM") / 1024, "load_s": round(wall, 1),
            "shards_per_weight": len(leaf.addressable_shards), "gate_proj_shard": list(leaf.addressable_shards[0]
                                                                                    .data.shape)}


def load_benchmark(gb: float, data: int, model: int, devices: int) -> dict:
    cfg = load_config(gb, model)
    with tempfile.TemporaryDirectory(prefix="dflash-shardbench-") as tmp:
        folder = Path(tmp) / "target"
        t0 = time.perf_counter()
        size = write_random_checkpoint(folder, cfg)
        write_s = time.perf_counter() - t0
        proc = subprocess.run([sys.executable, "-m", "dflash_jax.bench.mesh", "--measure-load", str(folder),
                               "--data", str(data), "--model", str(model), "--devices", str(devices)],
                              capture_output=True, text=True)  # the child sets its own device count (--devices)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(checkpoint_mb=size / 2**20, layers=cfg.num_hidden_layers, write_s=round(write_s, 1))
    res["peak_over_checkpoint"] = round(res["peak_rss_mb"] / res["checkpoint_mb"], 3)
    res["peak_minus_baseline_over_checkpoint"] = round((res["peak_rss_mb"] - res["baseline_rss_mb"])
                                                       / res["checkpoint_mb"], 3)
    return res


def smoke_pair():
    cfg = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    dcfg = DrafterConfig(model=cfg.replace(num_hidden_layers=1), block_size=4, mask_token_id=95,
                         target_layer_ids=(0, 1), num_target_layers=2)
    return random_pair(cfg, dcfg)


def main(argv=None) -> dict:
    args = argv if isinstance(argv, argparse.Namespace) else _parse(argv)
    if args.measure_load:
        print(json.dumps(measure_load(args.measure_load, args.data, args.model)))
        return {}
    report = {"devices": len(jax.devices()),
              "backend": jax.default_backend(), "batch": args.batch, "max_new_tokens": args.max_new_tokens}
    if args.smoke and len(jax.devices()) < args.data * args.model:
        args.data = args.model = 1
    report["mesh"] = {"data": args.data, "model": args.model}
    mesh = S.make_mesh(data=args.data, model=args.model, devices=jax.devices()[:args.data * args.model])
    rows = []
    if args.smoke:
        target, drafter = smoke_pair()
        prompts = _prompts(target.config.vocab_size, args.batch)
        rows.append(compare("tiny random (smoke)", target, drafter, mesh, prompts, args.max_new_tokens))
        args.skip_embedded = args.skip_8b = True
        args.load_gb = min(args.load_gb, 0.01)
    if not args.skip_embedded:
        target, drafter, _ = load_default()
        prompts = _prompts(target.config.vocab_size, args.batch)
        rows.append(compare("embedded, dense drafter", target, drafter, mesh, prompts, args.max_new_tokens))
        rows.append(compare("embedded, NVFP4 drafter", target, quantize_nvfp4(drafter), mesh, prompts,
                            args.max_new_tokens))
    if not args.skip_8b:
        cfg, dcfg = qwen3_8b_shaped(args.layers, args.vocab)
        target, drafter = random_pair(cfg, dcfg)
        prompts = _prompts(cfg.vocab_size, args.batch, seed=1)
        rows.append(compare(f"Qwen3-8B-shaped, {args.layers} layers, random", target, drafter, mesh, prompts,
                            args.max_new_tokens))
    report["rows"] = rows
    for r in rows:
        print(json.dumps(r))
    if args.load_gb > 0:
        # Every device its own shard (data 1 x model N): on one host a data axis would hold replicated copies.
        n = args.devices if not args.smoke else 2
        report["load"] = load_benchmark(args.load_gb, 1, n, n)
        print(json.dumps({"load": report["load"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(ARGS)
