"""Prove that a forward applies every NVFP4 scale, and applies it as dequantization says.

A forward that drops, reuses, shifts, squares or transposes a scale still runs and still gives plausible shapes;
only its numbers are wrong (llama.cpp PR #28000: the V/O tensor scales were missing and draft acceptance fell to ~0).
`audit_scales(fn, params, *args)` runs two independent checks on `fn(params, *args, **kwargs)`:

1. Reachability (`missing`). Every scale is a differentiation variable. Every block-scale ELEMENT whose block holds a
   non-zero code, and every global scale, must get a non-zero gradient for a random cotangent: a scale that never
   reaches the output has an identically zero one (dropped, or replaced by block 0's scale for every block).
2. Meaning (`mismatched`). The forward is run again with every NVFP4 leaf replaced by its exact dense dequantization
   e2m1(code) * f32(block_scale) * global_scale, computed here in numpy independently of `nvfp4.dequantize`, dressed
   as a `linear.DequantizedNVFP4` (unit scales; a W4A4 leaf, or any leaf on the native backend, rounds the
   activations the same way).
   * The outputs must agree within float tolerance. If they do not, each leaf is replaced alone and the leaves whose
     replacement changes the output are named.
   * If they do, the gradients must agree too: a correct forward sees the scales only through the dequantized weight
     W, so d/d block_scale[r, b] = global_scale * sum_k d/dW[r, 16b+k] * e2m1[r, 16b+k] and d/d global_scale =
     sum d/dW * e2m1 * block_scale, with d/dW from the dense forward. This catches what values alone cannot (a
     squared global scale that happens to be 1) and names the leaf, since the activations then agree.

Caveats. Audit with generic random inputs: a scale multiplying only zeros (all-zero weight, or inputs that zero the
weight's contribution) is reported missing. A tensor-scale error in front of a scale-invariant RMSNorm (q/k
projections before q_norm/k_norm, the drafter's fc before hidden_norm) changes the output only at the eps level, so
only the reachability check sees a dropped q/k tensor scale, and a squared one is invisible (and harmless in exact
arithmetic). With large activations (real target features) even that eps-level gradient rounds to exactly 0 in
float32, so a tensor scale with an exactly-zero gradient is checked again with the float inputs scaled by
INPUT_SHRINK; a dropped scale has an exactly-zero gradient for every input. The forward must be
differentiable (no `lax.while_loop` over the scales) and consume NVFP4 leaves through `linear` (it may read, replace
or multiply their scales itself: the reference's scales are ones); integer outputs are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quant.linear import DequantizedNVFP4, resolve_backend
from dflash_jax.quant.nvfp4 import BLOCK_SIZE, E2M1_GRID, NVFP4Array

PARTS = ("block_scale", "global_scale")
# Outputs agree when max |nvfp4 - dense| <= VALUE_RTOL * max |dense| (per output leaf). The two forwards run the same
# ops on the same weight values; only fusion and summation order may differ (~1e-6 relative in float32).
VALUE_RTOL = 1e-4
# Gradients are compared as sensitivities s = scale * d out/d scale (the effect of a relative change of the scale):
# |s - s_ref| <= GRAD_RTOL * |s_ref| + GRAD_ATOL * max |s_ref| over all leaves. The absolute part absorbs the
# rounding noise of scales whose true effect is ~0 (a q/k tensor scale in front of RMSNorm).
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-4
INPUT_SHRINK = 1e-3  # float inputs are multiplied by this to re-check a tensor scale whose gradient is exactly 0


@dataclasses.dataclass(frozen=True)
class ScaleAudit:
    checked: tuple[str, ...]  # names of all NVFP4 leaves, in tree order
    missing: tuple[str, ...]  # scales that do not reach the output, e.g. "layers[0].self_attn.v_proj: global_scale"
    # leaves whose forward differs from the forward with their exact dense dequantization, e.g. "layers[0].mlp.up_proj"
    mismatched: tuple[str, ...] = ()
    details: dict = dataclasses.field(default_factory=dict, compare=False)  # name -> list of explanation lines
    output_error: float = 0.0  # max relative difference between the NVFP4 forward and the all-dense forward

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched

    def raise_if_missing(self) -> None:
        """AssertionError naming every scale that does not reach the output and every leaf whose forward differs
        from its dequantized forward."""
        if self.ok:
            return
        parts = []
        if self.missing:
            parts.append("NVFP4 scales not reaching the output:\n  " + "\n  ".join(self.missing))
        if self.mismatched:
            lines = [f"{n}: {'; '.join(self.details.get(n, []))}" for n in self.mismatched]
            parts.append("NVFP4 leaves whose forward differs from the forward with their dequantized weight:\n  "
                         + "\n  ".join(lines))
        raise AssertionError("\n".join(parts))

    def __str__(self) -> str:
        if not self.checked:
            return "ScaleAudit: no NVFP4 leaves"
        lines = [f"ScaleAudit: {len(self.checked)} NVFP4 leaves, {len(self.missing)} scales missing, "
                 f"{len(self.mismatched)} leaves differing from their dequantized forward "
                 f"(output error {self.output_error:.2e})"]
        for name in self.checked:
            status = [f"{part} {'MISSING' if f'{name}: {part}' in self.missing else 'ok'}" for part in PARTS]
            status.append(f"dequantized forward {'DIFFERS' if name in self.mismatched else 'ok'}")
            lines.append(f"  {name}: " + ", ".join(status))
            lines.extend(f"    {d}" for d in self.details.get(name, []))
        for name in self.mismatched:
            if name not in self.checked:
                lines.append(f"  {name}: " + "; ".join(self.details.get(name, [])))
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


# -- the independent dense reference ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Reference:
    values: np.ndarray  # float32 [..., K] e2m1 value of every code
    block_scale: np.ndarray  # float32 [..., K/16]
    global_scale: np.float32
    weight: np.ndarray  # float32 [..., K] the exact dequantization
    live_blocks: np.ndarray  # bool [..., K/16] blocks with a non-zero code (their scale must reach the output)


def _reference(q: NVFP4Array) -> _Reference:
    """ModelOpt's dequantization in numpy: e2m1(code) * (f32(block_scale) * global_scale), same rounding order."""
    shape = tuple(q.shape)
    packed = np.asarray(jax.device_get(q.packed), np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(shape)  # element 2i = low nibble
    values = E2M1_GRID[codes]
    bs = np.asarray(jax.device_get(q.block_scale)).astype(np.float32)
    gs = np.float32(np.asarray(jax.device_get(q.global_scale), np.float32).reshape(()))
    step = (bs * gs).astype(np.float32)
    blocks = values.reshape(shape[:-1] + (shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    weight = (blocks * step[..., None]).astype(np.float32).reshape(shape)
    live = np.any((codes.reshape(blocks.shape) & 0x7) != 0, axis=-1)  # codes 0 and 8 are +-0
    return _Reference(values=values, block_scale=bs, global_scale=gs, weight=weight, live_blocks=live)


def _dense_leaf(leaf: NVFP4Array, weight: jax.Array, native: bool) -> DequantizedNVFP4:
    # The portable W4A16 path is x @ W.T; a W4A4 leaf (or the native backend) rounds x first, with the leaf's scale.
    return DequantizedNVFP4(weight=weight, packed=leaf.packed,
                            block_scale=jnp.ones(leaf.block_scale.shape, jnp.float32),
                            global_scale=jnp.ones((), jnp.float32), shape=tuple(leaf.shape),
                            input_scale=leaf.input_scale, act_scale=leaf.input_scale,
                            round_input=leaf.input_scale is not None or native)


def _float_outputs(out) -> list:
    # Integer outputs (argmax, lengths) carry no gradient and no tolerance: keep the float leaves only.
    return [o for o in jax.tree_util.tree_leaves(out) if jnp.issubdtype(jnp.result_type(o), jnp.inexact)]


def _relative_error(got: list, want: list) -> float:
    """max over output leaves of max |got - want| / max |want| (non-finite entries must match exactly)."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            return float("inf")
        finite = np.isfinite(g) & np.isfinite(w)
        same_nonfinite = (np.isnan(g) & np.isnan(w)) | (g == w)
        if not np.all(finite | same_nonfinite):
            return float("inf")
        scale = np.max(np.abs(w[finite]), initial=0.0)
        diff = np.max(np.abs(g - w)[finite], initial=0.0)
        if diff > 0:
            worst = max(worst, diff / scale if scale > 0 else float("inf"))
    return worst


def audit_scales(fn: Callable[..., Any], params: Any, *args: Any, localize: bool = True, **kwargs: Any) -> ScaleAudit:
    """Check every NVFP4Array in `params`: each block-scale element and global scale reaches
    `fn(params, *args, **kwargs)`, and the forward equals the forward with each leaf replaced by its exact dense
    dequantization (values, and gradients with respect to the scales). See the module docstring.

    localize=False: when the outputs differ, do not name the leaves that cause it (one op-by-op forward per NVFP4
    leaf, the slow part of auditing a deliberately broken forward); `mismatched` is then
    ("<all NVFP4 leaves together>",). `missing` (reachability) is computed the same either way."""
    is_q = lambda x: isinstance(x, NVFP4Array)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)
    q_idx = [i for i, (_, leaf) in enumerate(leaves) if is_q(leaf)]
    names = tuple(_path_name(leaves[i][0]) for i in q_idx)
    if not q_idx:
        return ScaleAudit(checked=(), missing=())
    refs = [_reference(leaves[i][1]) for i in q_idx]
    # float32 block scales everywhere: float8 has no useful tangent space (values are identical).
    base = [leaf for _, leaf in leaves]
    for i, r in zip(q_idx, refs):
        base[i] = base[i].replace(block_scale=jnp.asarray(r.block_scale))
    native = resolve_backend() == "native"

    def call(new, inputs=args):
        return _float_outputs(fn(jax.tree_util.tree_unflatten(treedef, new), *inputs, **kwargs))

    scales = [(jnp.asarray(r.block_scale), jnp.asarray(r.global_scale)) for r in refs]

    def quantized_forward(scales, inputs=args):
        new = list(base)
        for i, (bs, gs) in zip(q_idx, scales):
            new[i] = new[i].replace(block_scale=bs, global_scale=gs)
        return call(new, inputs)

    def dense_forward(weights):
        new = list(base)
        for i, w in zip(q_idx, weights):
            new[i] = _dense_leaf(base[i], w, native)
        return call(new)

    out_q, vjp_q = jax.vjp(quantized_forward, scales)
    out_d, vjp_d = jax.vjp(dense_forward, [jnp.asarray(r.weight) for r in refs])
    keys = jax.random.split(jax.random.key(0), max(len(out_q), 1))

    def random_cotangent(out):
        return [jax.random.normal(key, jnp.shape(o), jnp.result_type(o)) for key, o in zip(keys, out)]

    cot = random_cotangent(out_q)
    (grads_q,) = vjp_q(cot)

    def isolated_block_grad(k: int) -> np.ndarray:
        # Leaf k alone quantized, every other leaf its dense reference: a bug elsewhere (saturated activations
        # downstream of a dropped scale) cannot make this leaf's scales look unreachable.
        dense = [_dense_leaf(base[i], jnp.asarray(r.weight), native) for i, r in zip(q_idx, refs)]

        def f(bs):
            new = list(base)
            for j, i in enumerate(q_idx):
                new[i] = base[i].replace(block_scale=bs, global_scale=scales[k][1]) if j == k else dense[j]
            return call(new)

        out, vjp = jax.vjp(f, scales[k][0])
        return np.asarray(vjp(random_cotangent(out))[0])

    @functools.cache
    def global_grads_with_small_inputs() -> list[np.ndarray]:
        # A tensor scale in front of a scale-invariant RMSNorm (the drafter's fc before hidden_norm, q/k before
        # q_norm/k_norm) reaches the output only through the norm's eps; with large activations (real target
        # features) that term is below float32 resolution and the gradient rounds to exactly 0. Shrinking the float
        # inputs brings it back; a scale the forward really drops stays at exactly 0 for any input.
        small = jax.tree_util.tree_map(
            lambda a: a * INPUT_SHRINK if isinstance(a, (np.ndarray, jax.Array)) and
            jnp.issubdtype(jnp.result_type(a), jnp.inexact) else a, args)
        out, vjp = jax.vjp(lambda s: quantized_forward(s, small), scales)
        return [np.asarray(g_gs) for _, g_gs in vjp(random_cotangent(out))[0]]

    details: dict[str, list[str]] = {}
    missing = []
    for k, (name, ref, (g_bs, g_gs)) in enumerate(zip(names, refs, grads_q)):
        dead = (np.asarray(g_bs) == 0) & ref.live_blocks
        if dead.any() and not dead[ref.live_blocks].all():  # some, not all: confirm in isolation
            dead = (isolated_block_grad(k) == 0) & ref.live_blocks
        if dead.any():
            first = tuple(int(i) for i in np.argwhere(dead)[0])
            missing.append(f"{name}: block_scale")
            details.setdefault(name, []).append(
                f"block_scale: {int(dead.sum())} of {int(ref.live_blocks.sum())} block scales do not reach the "
                f"output (first at {list(first)})")
        if not np.any(np.asarray(g_gs) != 0) and not np.any(global_grads_with_small_inputs()[k] != 0):
            missing.append(f"{name}: global_scale")
            details.setdefault(name, []).append("global_scale: does not reach the output")

    error = _relative_error(out_q, out_d)
    mismatched: list[str] = []
    if error > VALUE_RTOL:
        # Localise: a correctly handled leaf can be swapped for its dense weight without changing the output. Op by
        # op (no jit): every variant has its own tree structure, and a jitted forward would compile once per leaf.
        for k, (name, i) in enumerate(zip(names, q_idx) if localize else ()):
            new = list(base)
            new[i] = _dense_leaf(base[i], jnp.asarray(refs[k].weight), native)
            with jax.disable_jit():
                e = _relative_error(out_q, call(new))
            if e > VALUE_RTOL:
                mismatched.append(name)
                details.setdefault(name, []).append(
                    f"the forward with this leaf replaced by its dequantized weight differs by {e:.3g} (relative)")
        if not mismatched:
            mismatched.append("<all NVFP4 leaves together>")
            details["<all NVFP4 leaves together>"] = [
                f"the forward with every leaf dequantized differs by {error:.3g}, "
                + ("no single leaf does" if localize else "leaves not named (localize=False)")]
    elif cot:
        # Same values: the gradients through the dequantized weight must match the scales' own gradients.
        (grads_w,) = vjp_d(cot)
        sens_q, sens_ref = [], []
        for ref, (g_bs, g_gs), g_w in zip(refs, grads_q, grads_w):
            gw = np.asarray(g_w, np.float64) * ref.values  # d out / d W * e2m1
            per_block = gw.reshape(ref.block_scale.shape + (BLOCK_SIZE,)).sum(-1)
            sens_ref.append((ref.block_scale * ref.global_scale * per_block,
                             ref.global_scale * np.sum(per_block * ref.block_scale)))
            sens_q.append((ref.block_scale * np.asarray(g_bs, np.float64),
                           ref.global_scale * np.asarray(g_gs, np.float64)))
        floor = GRAD_ATOL * max(max(np.max(np.abs(b)), abs(g)) for b, g in sens_ref)
        for name, (s_bs, s_gs), (r_bs, r_gs) in zip(names, sens_q, sens_ref):
            for part, s, r in (("block_scale", s_bs, r_bs), ("global_scale", s_gs, r_gs)):
                if f"{name}: {part}" in missing:
                    continue
                bad = np.abs(s - r) > GRAD_RTOL * np.abs(r) + floor
                if np.any(bad):
                    rel = float(np.max(np.abs(s - r)) / max(np.max(np.abs(r)), floor, 1e-300))
                    if name not in mismatched:
                        mismatched.append(name)
                    details.setdefault(name, []).append(
                        f"{part}: gradient differs from the dequantized forward's at {int(np.sum(bad))} of "
                        f"{np.size(r)} elements (max error {rel:.3g} of the largest)")
    return ScaleAudit(checked=names, missing=tuple(missing), mismatched=tuple(mismatched), details=details,
                      output_error=float(error))
