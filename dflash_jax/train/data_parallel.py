"""Data-parallel drafter training over a device mesh, in one process or several (`jax.distributed`), with the
project's own mesh and logical-axis rules (`parallel.sharding`): the batch goes along the mesh's "data" axis, the
drafter's parameters (and Adam's moments) are replicated, or split by the rules along "model" when that axis is
larger than 1; the frozen target parameters the loss reads (embedding, LM head, its top layers for a KL teacher)
are replicated. XLA's SPMD partitioner adds the gradient all-reduce; nothing here is hand-written collectives.

    dflash-jax train-drafter ... --mesh-data 8                      # 8 devices of this process
    dflash-jax train-drafter ... --coordinator HOST:PORT --num-processes 2 --process-id I   # on each host
    dflash-jax train-drafter ... --distributed                      # a TPU slice / SLURM / GPU cluster: JAX's own
                                                                    # auto-detection of the coordinator

Every process runs the same command on the same data: each computes the same host batch (a pure function of the
step) and builds only its own devices' shards of it. Logs, reports and the saved drafter come from process 0; the
checkpoints are written by all processes together (orbax), so a multi-host run needs a shared --work-dir.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax.models.drafter import Drafter
from dflash_jax.parallel import sharding as S
from dflash_jax.train.loop import Placement


def add_mesh_arguments(ap) -> None:
    ap.add_argument("--mesh-data", type=int, default=0,
                    help="data-parallel devices (the mesh's data axis; 0 = every device when several processes or "
                         "--mesh-model are given, else a single device and no mesh)")
    ap.add_argument("--mesh-model", type=int, default=1,
                    help="the mesh's model axis: the drafter's heads / MLP / vocabulary split by the sharding rules")
    ap.add_argument("--coordinator", default=None, help="jax.distributed coordinator HOST:PORT (several processes)")
    ap.add_argument("--num-processes", type=int, default=1, help="processes of a jax.distributed run")
    ap.add_argument("--process-id", type=int, default=0, help="this process's index in a jax.distributed run")
    ap.add_argument("--distributed", action="store_true",
                    help="jax.distributed.initialize() with JAX's auto-detection (Cloud TPU, SLURM, ...)")


def init_distributed(args) -> None:
    """Starts jax.distributed when the flags ask for it; must run before anything touches a device."""
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; ignored by GPU / TPU
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    elif args.distributed:
        jax.distributed.initialize()


def make_training_mesh(args):
    """The ("data", "model") mesh of the flags, or None for a plain single-device run."""
    n = len(jax.devices())
    if not args.mesh_data and args.mesh_model == 1 and jax.process_count() == 1:
        return None
    data = args.mesh_data or n // args.mesh_model
    try:
        return S.make_mesh(data=data, model=args.mesh_model)
    except S.ShardingError as e:
        raise SystemExit(f"error: --mesh-data {args.mesh_data} --mesh-model {args.mesh_model}: {e}") from None


def placement_for(drafter: Drafter, mesh) -> Placement:
    """Drafter parameters by the rules (replicated on a model axis of 1), batches along "data"."""
    try:
        shardings = S.param_shardings(drafter, mesh)
    except S.ShardingError as e:
        raise SystemExit(f"error: {e}") from None
    return Placement(params=shardings, batch=lambda batch: place_batch(batch, mesh))


def place_batch(batch: dict, mesh) -> dict:
    """A host batch on the mesh: every array split along "data" on its first axis; the frozen target's parameters
    (already placed by `place_target`) pass as they are."""
    def one(x):
        nd = np.ndim(x)
        return S.place(x, NamedSharding(mesh, P("data", *([None] * (nd - 1))) if nd else P()))
    return {k: v if k == "target" else jax.tree.map(one, v) for k, v in batch.items()}


def check_batch(batch: int, mesh) -> None:
    if mesh is not None and batch % mesh.shape["data"]:
        raise SystemExit(f"error: --batch {batch} is not divisible by the mesh's data axis ({mesh.shape['data']})")


def place_replicated(tree, mesh):
    """The frozen target parameters the loss reads, a copy on every device of the mesh (small next to the
    activations of a step: SmolLM2's embedding / head is 113 MB in float32)."""
    return S.place_tree(tree, S.replicated(mesh))


def host_params(params):
    """Parameters as host arrays on every process (for evaluation and saving): replicated leaves are read from this
    process's own copy; split ones are gathered."""
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_shards[0].data)
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, params)


__all__ = ["add_mesh_arguments", "init_distributed", "make_training_mesh", "placement_for", "place_batch",
           "check_batch", "place_replicated", "host_params"]
