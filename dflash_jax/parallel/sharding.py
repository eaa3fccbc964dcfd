"""Target and drafter over a device mesh: tensor parallelism from the parameters' logical axes, data parallelism over
the batch, and XLA's SPMD partitioner doing the rest (no hand-written collectives).

Mesh axes are ("data", "model"). Rules, from the logical axes `params.py` gives every parameter:

  q_heads, mlp, vocab  -> "model"   attention heads (q_proj out, o_proj in), MLP intermediate (gate/up out, down in),
                                    vocabulary (embedding rows, LM head rows)
  kv_heads             -> "model"   when the model axis divides the KV head count; with FEWER KV heads than the model
                                    axis they are replicated (each device keeps every KV head, as Megatron / vLLM do)
  embed, head_dim, taps_embed -> replicated
  linear_heads, linear_v -> "model" Gated DeltaNet value heads (hybrid targets): in_proj_a / in_proj_b rows, A_log,
                                    dt_bias, in_proj_z rows and out_proj columns (whole value heads), so the recurrent
                                    state [B, nV, dk, dv] splits by head; the model axis must divide the value heads
  linear_conv          -> "model" in_proj_qkv rows and conv1d channels (with the conv window they fill), held grouped
                                    by key head (`params.linear_qkv_order`: q_h | k_h | the value heads reading h), so
                                    a contiguous split is whole key heads with the very value heads in_proj_z / a / b
                                    put on that device. Needs the model axis to divide the key heads; otherwise these
                                    are replicated (as KV heads are). In HF's fused q | k | v order no one
                                    PartitionSpec could split at whole heads (device 0 would hold all of q and part of
                                    k), hence the permutation at load. Qwen3.5-27B (48 DeltaNet layers, in_proj_qkv
                                    10240 x 5120): 4,800 MiB of bf16 per device replicated, 600 MiB on a model axis 8

A Qwen2 target's q/k/v biases carry their projection's out axis (q_heads, kv_heads), so they split with it.

The batch goes along "data"; KV caches (target and drafter context) are [B, nKV, S, hd] over ("data", model or
replicated, -, -). A sharded axis must be split at whole units (heads, not head_dim columns), so the model axis must
divide the head count, the intermediate size and the vocabulary; anything else is refused here, before compiling.

`NVFP4Array` leaves shard like the dense weight they stand for: packed codes [out, in/2] and block scales [out, in/16]
along the same mesh axes as [out, in] (column-parallel: along out; row-parallel o_proj / down_proj: along in, where
each shard must hold whole blocks of 16, i.e. in / model % 16 == 0), the per-tensor (and input) scale replicated, so
`linear` sees an ordinary NVFP4Array and every scale still reaches the output (`audit_scales`).

Leaves are placed with `jax.make_array_from_callback`, so the same call works with several processes (each process
builds only the shards of its own devices), and a checkpoint loader can read each shard's slice straight from disk
(`dflash_jax.io.checkpoint.load_target(..., mesh=...)`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dflash_jax import execution
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.quant.nvfp4 import BLOCK_SIZE, NVFP4Array
from dflash_jax.params import abstract_drafter, abstract_target, map_named, named_leaves

AXES = ("data", "model")


class ShardingError(ValueError):
    pass


def make_mesh(data: int = 1, model: int | None = None, *, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: every device of every process, `jax.devices()`), in that
    order, row-major (consecutive devices share a data row).

    model=None takes every device left after `data`. data * model must equal the number of devices."""
    if devices is None:  # by process, then id: the model axis (the chattier one) stays inside a process if it can
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    if int(data) < 1:
        raise ShardingError(f"make_mesh: data must be >= 1, got {data}")
    if model is None:
        if len(devices) % int(data):
            raise ShardingError(f"make_mesh: data={data} does not divide the {len(devices)} devices")
        model = len(devices) // int(data)
    if int(model) < 1 or int(data) * int(model) != len(devices):
        raise ShardingError(f"make_mesh: data={data} x model={model} = {int(data) * int(model)} devices, but "
                            f"{len(devices)} are available (pass devices=... to use a subset)")
    return Mesh(np.array(devices, dtype=object).reshape(int(data), int(model)), AXES)


def _check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        names = getattr(mesh, "axis_names", None)
        raise ShardingError(f"expected a Mesh with axes {AXES} (see make_mesh), got axes {names}")


# -- rules ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis -> mesh axis (or None = replicated) for one model config on one mesh, after the KV rule."""

    mapping: tuple[tuple[str, str | None], ...]
    kv_sharded: bool

    def axis(self, logical: str) -> str | None:
        return dict(self.mapping).get(logical)

    def spec(self, logical_axes: tuple[str, ...]) -> P:
        return P(*(self.axis(a) for a in logical_axes))


def rules_for(cfg: TargetConfig, mesh: Mesh, *, what: str = "model") -> Rules:
    """The rules for a Qwen3 layer stack (target or drafter) of config `cfg` on `mesh`; raises ShardingError naming
    the axis and the sizes when the model axis cannot split heads, intermediate or vocabulary into whole units."""
    _check_mesh(mesh)
    m = int(mesh.shape["model"])
    problems = []

    def need(name: str, count: int):
        if count % m:
            problems.append(f"{name} {count} is not divisible by the mesh's model axis of size {m}")

    need("num_attention_heads", cfg.num_attention_heads)
    need("intermediate_size", cfg.intermediate_size)
    need("vocab_size", cfg.vocab_size)
    if cfg.is_hybrid:
        need("linear_num_value_heads", cfg.linear_num_value_heads)
    kv_sharded = cfg.num_key_value_heads >= m
    # DeltaNet q / k / v channels split at whole key heads, or are replicated (see the module docstring)
    qkv_sharded = cfg.is_hybrid and cfg.linear_num_key_heads % m == 0 and m > 1
    if kv_sharded:  # fewer KV heads than the model axis: replicated (no check); more: they must split evenly
        need("num_key_value_heads", cfg.num_key_value_heads)
    if problems:
        raise ShardingError(f"cannot shard the {what} over mesh {dict(mesh.shape)}: " + "; ".join(problems))
    mapping = (("q_heads", "model"), ("mlp", "model"), ("vocab", "model"),
               ("kv_heads", "model" if kv_sharded and m > 1 else None),
               ("embed", None), ("head_dim", None), ("taps_embed", None),
               ("linear_heads", "model"), ("linear_v", "model"),
               ("linear_conv", "model" if qkv_sharded else None))
    return Rules(mapping=mapping, kv_sharded=kv_sharded and m > 1)


def _leaf_sharding(name: str, spec_axes: tuple[str, ...], leaf: Any, rules: Rules, mesh: Mesh, what: str):
    """NamedSharding for a dense leaf, or an NVFP4Array of NamedShardings for a quantized one."""
    pspec = rules.spec(spec_axes)
    if not isinstance(leaf, NVFP4Array):
        return NamedSharding(mesh, pspec)
    if len(spec_axes) != 2:
        raise ShardingError(f"{what} {name}: NVFP4 leaf with logical axes {spec_axes} (expected [out, in])")
    out_ax, in_ax = pspec[0], pspec[1]
    if in_ax is not None:  # row-parallel: each shard must hold whole blocks of 16 input features
        k, m = leaf.shape[1], int(mesh.shape[in_ax])
        if (k // m) % BLOCK_SIZE:
            raise ShardingError(f"{what} {name}: NVFP4 row-parallel weight with {k} input features over the "
                                f"'{in_ax}' axis of size {m}: {k // m} per shard is not a multiple of the "
                                f"{BLOCK_SIZE}-element block")
    rep = NamedSharding(mesh, P())
    return NVFP4Array(packed=NamedSharding(mesh, pspec), block_scale=NamedSharding(mesh, pspec), global_scale=rep,
                      shape=leaf.shape, input_scale=None if leaf.input_scale is None else rep)


def _model_parts(tree):
    """(params, config, abstract params, kind) of a Target or Drafter."""
    # Told apart by their config (models sit above this package and are not imported here).
    config = getattr(tree, "config", None)
    if isinstance(config, TargetConfig):
        return tree.params, config, abstract_target(config), "target"
    if isinstance(config, DrafterConfig):
        return tree.params, config.model, abstract_drafter(config), "drafter"
    raise TypeError(f"expected a Target or a Drafter, got {type(tree).__name__}")


def param_shardings(model, mesh: Mesh):
    """The params tree of a Target or Drafter with every leaf replaced by its NamedSharding (an NVFP4Array of
    NamedShardings for a quantized leaf). Validates the mesh against the config first."""
    params, cfg, abstract, kind = _model_parts(model)
    rules = rules_for(cfg, mesh, what=kind)
    axes = {n: s.logical_axes for n, s in named_leaves(abstract).items()}
    return map_named(lambda n, leaf: _leaf_sharding(n, axes[n], leaf, rules, mesh, kind), params)


def cache_sharding(cfg: TargetConfig, mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(K/V buffers [B, nKV, S, hd], lengths [B]) shardings of a KV cache of a model of config `cfg`."""
    rules = rules_for(cfg, mesh)
    return (NamedSharding(mesh, P("data", "model" if rules.kv_sharded else None, None, None)),
            NamedSharding(mesh, P("data")))


def constrain_cache(cache, cfg: TargetConfig):
    """`cache` (a KVCache, inside a traced program) pinned to `cache_sharding` on the execution context's mesh;
    identity without one."""
    mesh = execution.current().mesh
    if mesh is None or cache is None:
        return cache
    kv, lens = cache_sharding(cfg, mesh)
    c = jax.lax.with_sharding_constraint

    def pin(entry):  # an attention entry's K/V; a DeltaNet entry's states stay where XLA puts them (entries are told
        # apart by their fields: models sit above this package and are not imported here)
        return entry.replace(k=c(entry.k, kv), v=c(entry.v, kv)) if hasattr(entry, "k") else entry

    return cache.replace(layers=tuple(pin(e) for e in cache.layers), lengths=c(cache.lengths, lens))


def mesh_scope(mesh: Mesh | None):
    """Inside the block, the execution context's mesh is `mesh`: the mesh generation programs run on (set for them
    when a call is prepared), so that layer code pins caches and a few activations without a mesh argument threaded
    through every call."""
    return execution.changed(mesh=mesh)


def constrain_kv(k: jax.Array, v: jax.Array, cfg: TargetConfig) -> tuple[jax.Array, jax.Array]:
    """New keys/values [B, T, nKV, hd] placed as the cache they are written into (identity without a mesh in the
    execution context).

    Without this, with KV heads replicated and query heads sharded, XLA partitions the cache write like the grouped
    queries (KV heads split 2 ways) and then all-gathers the whole cache back every step."""
    mesh = execution.current().mesh
    if mesh is None:
        return k, v
    kv, _ = cache_sharding(cfg, mesh)
    return jax.lax.with_sharding_constraint(k, kv), jax.lax.with_sharding_constraint(v, kv)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# -- placing -------------------------------------------------------------------------------------------------------

def place(value, sharding: NamedSharding) -> jax.Array:
    """One host value as a global array with `sharding`, built shard by shard (works across processes: every process
    passes the same value and materializes only its own devices' shards)."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    host = np.asarray(jax.device_get(value)) if isinstance(value, jax.Array) else np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree, sharding: NamedSharding):
    return jax.tree.map(lambda x: place(x, sharding), tree)


def shard(tree, mesh: Mesh):
    """The same Target or Drafter (dense or NVFP4) with every parameter placed on `mesh` by the rules; raises
    ShardingError (naming the axis and the sizes) when the mesh's model axis cannot split this model."""
    params, _, _, _ = _model_parts(tree)
    shardings = param_shardings(tree, mesh)
    placed = jax.tree.map(place, params, shardings)  # NVFP4Array fields pair with their own shardings
    return tree.replace(params=placed)


# -- meshes of placed models ------------------------------------------------------------------------------------------

def _describe(mesh: Mesh) -> str:
    return f"{dict(mesh.shape)} over devices {[d.id for d in mesh.devices.flat]}"


def mesh_of(model) -> Mesh | None:
    """The ("data", "model") mesh a Target / Drafter was placed on by `shard`, or None when it was not (single
    device or a placement of the caller's own). Raises when its leaves sit on different meshes."""
    meshes = {}
    for leaf in jax.tree.leaves(model):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == AXES:
            meshes[s.mesh] = s.mesh
    if len(meshes) > 1:
        raise ShardingError(f"{type(model).__name__} has parameters on {len(meshes)} different meshes: "
                            + "; ".join(_describe(m) for m in meshes.values()))
    return next(iter(meshes.values()), None)


def models_mesh(*models) -> Mesh | None:
    """The one mesh all `models` (target, drafter) are sharded on, or None when none is; refuses a pair on different
    meshes (or one sharded and one not) and a mesh whose model axis does not split a model, before compiling."""
    found = [(type(m).__name__, mesh_of(m)) for m in models]
    meshes = [mesh for _, mesh in found if mesh is not None]
    if not meshes:
        return None
    first = meshes[0]
    for name, mesh in found:
        if mesh is None:
            raise ShardingError(f"{found[0][0]} and {found[1][0]} must be sharded on the same mesh: the "
                                f"{name} is not sharded (use dflash_jax.parallel.sharding.shard(model, mesh) on both)")
        if mesh != first:
            desc = "; ".join(f"{n} on mesh {_describe(m)}" for n, m in found)
            raise ShardingError(f"target and drafter are sharded on different meshes: {desc} (shard both on one "
                                f"mesh)")
    for m in models:  # the rules' divisibility checks, for models placed by other means than `shard`
        _, cfg, _, kind = _model_parts(m)
        rules_for(cfg, first, what=kind)
    return first


# -- inspection ----------------------------------------------------------------------------------------------------

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_COMP_HEADER = re.compile(r"^(?:ENTRY )?%([^\s(]+) ")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+?)(?:\{[^}]*\})? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, name = {}, None, None
    for line in hlo.splitlines():
        m = _COMP_HEADER.match(line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def _reachable(comps: dict[str, list[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo.extend(_CALLS.findall(line))
            for group in _BRANCHES.findall(line):
                todo.extend(x.strip().lstrip("%") for x in group.split(","))
    return seen


def _count(comps, names) -> tuple[dict[str, int], list[tuple[str, str]]]:
    counts, ops = {k: 0 for k in COLLECTIVES}, []
    for c in names:
        for line in comps[c]:
            m = _OP.match(line)
            if m:
                counts[m.group(2)] += 1
                ops.append((m.group(2), m.group(1)))
    return counts, ops


def hlo_collectives(hlo: str, weight_shapes=()) -> dict:
    """Collectives of a compiled (SPMD-partitioned) generation program, from `compiled.as_text()`.

    The decode loop is the top-level `while` whose body reaches the most computations (prefill's attention loops are
    small). Returns {"decode_loop": {op: count}, "outside_loop": {op: count}, "weight_all_gathers": [shapes]}: counts
    are instructions in the loop body and everything it calls (an instruction inside a nested loop, e.g. attention's
    chunk loop, counts once), and weight_all_gathers lists all-gathers in the loop whose result has the global shape
    of a parameter (`weight_shapes`: (dtype, shape) pairs, e.g. from `weight_shapes(model)`)."""
    comps, entry = _computations(hlo)
    loops = []
    for line in comps.get(entry, []):
        if " while(" in line:
            body = re.search(r"body=%([\w.\-]+)", line).group(1)
            cond = re.search(r"condition=%([\w.\-]+)", line).group(1)
            loops.append(_reachable(comps, [body, cond]))
    loop = max(loops, key=len) if loops else set()
    inside, ops = _count(comps, loop)
    everything, _ = _count(comps, _reachable(comps, [entry]) if entry else comps)
    outside = {k: everything[k] - inside[k] for k in COLLECTIVES}
    wanted = {f"{dt}[{','.join(map(str, shape))}]" for dt, shape in weight_shapes}
    weight_gathers = [shape for op, shape in ops if op == "all-gather" and shape in wanted]
    return {"decode_loop": inside, "outside_loop": outside, "weight_all_gathers": weight_gathers}


_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "uint8": "u8", "float8_e4m3fn": "f8e4m3fn"}


def weight_shapes(*models) -> set[tuple[str, tuple[int, ...]]]:
    """(HLO dtype, global shape) of every sharded parameter array of `models` (for `hlo_collectives`)."""
    out = set()
    for leaf in jax.tree.leaves(models):
        if getattr(leaf, "ndim", 0) >= 1 and leaf.dtype.name in _HLO_DTYPES:
            out.add((_HLO_DTYPES[leaf.dtype.name], tuple(leaf.shape)))
    return out


def shard_fraction(leaf: jax.Array) -> float:
    """Fraction of a global array's elements held by one addressable device (1 = replicated)."""
    shard0 = leaf.addressable_shards[0].data
    return math.prod(shard0.shape) / max(math.prod(leaf.shape), 1)


__all__ = ["make_mesh", "shard", "mesh_of", "models_mesh", "param_shardings", "cache_sharding", "constrain_cache",
           "mesh_scope", "constrain_kv", "rules_for", "Rules", "ShardingError", "place", "place_tree", "batch_sharding",
           "replicated", "shard_fraction", "hlo_collectives", "weight_shapes", "AXES"]
