"""Prove that every NVFP4 scale reaches a forward's output.

A forward that drops a weight's global scale still runs and still gives plausible
shapes; only its numbers are wrong (llama.cpp PR #28000: the V/O scales were missing
and draft acceptance fell to ~0). Here each scale is made a differentiation variable:
a scale that never reaches the output has an identically zero gradient.

Caveats: a scale multiplying only zeros (an all-zero weight, or inputs that zero
that weight's contribution) is reported missing too, so audit with generic random
inputs. The cotangent is random so that gradients cannot cancel by symmetry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.nvfp4 import NVFP4Array


@dataclasses.dataclass(frozen=True)
class ScaleAudit:
    checked: tuple[str, ...]  # names of all NVFP4 leaves, in tree order
    missing: tuple[str, ...]  # e.g. "layers[0].self_attn.v_proj: global_scale"

    @property
    def ok(self) -> bool:
        return not self.missing

    def raise_if_missing(self) -> None:
        if self.missing:
            raise AssertionError("NVFP4 scales not reaching the output:\n  " + "\n  ".join(self.missing))

    def __str__(self) -> str:
        if not self.checked:
            return "ScaleAudit: no NVFP4 leaves"
        lines = [f"ScaleAudit: {len(self.checked)} NVFP4 leaves, {len(self.missing)} scales missing"]
        for name in self.checked:
            status = [
                f"{part} {'MISSING' if f'{name}: {part}' in self.missing else 'ok'}"
                for part in ("block_scale", "global_scale")
            ]
            lines.append(f"  {name}: " + ", ".join(status))
        return "\n".join(lines)


def _path_name(path: tuple[Any, ...]) -> str:
    # `.layers[0].self_attn.v_proj` style for attributes, indices and string dict keys alike.
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(f".{k.name}")
        elif isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str):
            parts.append(f".{k.key}")
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(f"[{k.idx}]")
        else:
            parts.append(jax.tree_util.keystr((k,)))
    return "".join(parts).lstrip(".") or "<root>"


def audit_scales(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> ScaleAudit:
    """Check that each NVFP4Array's block_scale and global_scale in `params` affect `fn(params, *args, **kwargs)`."""
    is_q = lambda x: isinstance(x, NVFP4Array)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)
    q_idx = [i for i, (_, leaf) in enumerate(leaves) if is_q(leaf)]
    names = tuple(_path_name(leaves[i][0]) for i in q_idx)
    if not q_idx:
        return ScaleAudit(checked=(), missing=())

    # float32 block scales: float8 has no useful tangent space.
    scales = [
        (leaves[i][1].block_scale.astype(jnp.float32), leaves[i][1].global_scale.astype(jnp.float32))
        for i in q_idx
    ]

    def forward(scales):
        new = [leaf for _, leaf in leaves]
        for i, (bs, gs) in zip(q_idx, scales):
            new[i] = new[i].replace(block_scale=bs, global_scale=gs)
        out = fn(jax.tree_util.tree_unflatten(treedef, new), *args, **kwargs)
        # Integer outputs carry no gradient; keep the float leaves only.
        return [o for o in jax.tree_util.tree_leaves(out) if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]

    out, vjp = jax.vjp(forward, scales)
    keys = jax.random.split(jax.random.key(0), max(len(out), 1))
    cot = [jax.random.normal(k, jnp.shape(o), jnp.result_type(o)) for k, o in zip(keys, out)]
    (grads,) = vjp(cot)

    missing = []
    for name, (g_bs, g_gs) in zip(names, grads):
        if not np.any(np.asarray(g_bs) != 0):
            missing.append(f"{name}: block_scale")
        if not np.any(np.asarray(g_gs) != 0):
            missing.append(f"{name}: global_scale")
    return ScaleAudit(checked=names, missing=tuple(missing))
