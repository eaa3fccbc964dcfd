"""Quantizing whole models to NVFP4: RTN (the ModelOpt recipe), a calibrated scale search, W4A4, and the ablation.

A quantized model is the same kind of model with `NVFP4Array` leaves where linear weights were: every forward, loader
and saver works unchanged because `linear` dispatches on the leaf type. Norms and embeddings always stay dense.

`method="rtn"` is ModelOpt's recipe bit for bit. `method="calibrated"` ("RTNcal": round-to-nearest with scales
chosen on real activations) keeps the tensor scale and, for every 16-element block, picks among E4M3 block scales
near the RTN one the scale that minimises the block's contribution to the layer-output error on calibration
activations, ||X_b (w_b - q_b)||^2 = d^T (X_b^T X_b) d, then rounds the elements to nearest at that scale.
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import execution
from dflash_jax.quant.nvfp4 import BLOCK_SIZE, E2M1_GRID, E2M1_MAX, E4M3_MAX, NVFP4Array, _round_to_e2m1_codes, quantize
from dflash_jax.params import committed, is_linear_name, map_named, named_leaves

ATTENTION_PROJECTIONS = ("*self_attn.q_proj", "*self_attn.k_proj", "*self_attn.v_proj", "*self_attn.o_proj")
# DFlash2's own linears: the matmuls llama.cpp still runs without their tensor scales (llama.cpp PR #28000
# scaled only the attention projections of src/models/dflash.cpp).
DFLASH2_PROJECTIONS = ("*_conv.kernel_projection", "candidate_selector.hidden_projection")


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or name == p for p in patterns)


def quantizable_names(model, *, exclude: Sequence[str] = (), lm_head: bool = False) -> list[str]:
    names = []
    for name, leaf in named_leaves(model.params).items():
        if not is_linear_name(name) or _matches(name, exclude) or isinstance(leaf, NVFP4Array):
            continue
        if name == "lm_head" and not lm_head:
            continue
        names.append(name)
    return names


# One compiled program per shape (eager, each of its compares and adds would compile on its own).
_round_codes = jax.jit(_round_to_e2m1_codes)


def quantize_nvfp4(model, *, method: str = "rtn", exclude: Sequence[str] = (), calibration=None,
                   lm_head: bool = False, activations: str = "w4a16", candidates: int = 9):
    """The same kind of model (Target or Drafter) with NVFP4 leaves for every linear weight.

    exclude: fnmatch patterns of parameter names kept dense (e.g. "layers.0.*"). lm_head: also quantize an untied
    target LM head (a drafter has none: it borrows the target's). method: "rtn" | "calibrated".
    calibration: {name: activations [n, in]} as returned by `collect_linear_inputs`; required for "calibrated" and
    for activations="w4a4" (which sets each leaf's input_scale = amax(activations) / (6 * 448)).
    """
    if method not in ("rtn", "calibrated"):
        raise ValueError(f"method must be 'rtn' or 'calibrated', got {method!r}")
    if activations not in ("w4a16", "w4a4"):
        raise ValueError(f"activations must be 'w4a16' or 'w4a4', got {activations!r}")
    names = set(quantizable_names(model, exclude=exclude, lm_head=lm_head))
    need_cal = method == "calibrated" or activations == "w4a4"
    if need_cal:
        if calibration is None:
            raise ValueError(f"method={method!r} / activations={activations!r} needs calibration activations "
                             "(see dflash_jax.quant.quantize.collect_linear_inputs)")
        missing = sorted(names - set(calibration))
        if missing:
            raise ValueError(f"calibration has no activations for {missing}")

    def convert(name, leaf):
        if name not in names:
            return leaf
        w = np.asarray(jax.device_get(leaf), np.float32)
        if method == "rtn":
            q = quantize(w)
        else:
            q = calibrated_quantize(w, np.asarray(calibration[name], np.float32), candidates=candidates)
        if activations == "w4a4":
            amax = float(np.abs(np.asarray(calibration[name], np.float32)).max())
            q = q.replace(input_scale=jnp.float32(max(amax, 1e-12) / (E2M1_MAX * E4M3_MAX)))
        return q

    return model.replace(params=map_named(convert, model.params))


def calibrated_quantize(w: np.ndarray, x: np.ndarray, *, candidates: int = 9) -> NVFP4Array:
    """Per-block E4M3 scale search on activations x [n, in] for weight w [out, in] (same tensor scale as RTN)."""
    rtn = quantize(w)
    out_f, in_f = w.shape
    nb = in_f // BLOCK_SIZE
    s2 = np.float32(rtn.global_scale)
    xb = x.reshape(-1, nb, BLOCK_SIZE).astype(np.float64)
    hess = np.einsum("nbk,nbl->bkl", xb, xb)  # [nb, 16, 16] per block-column Gram matrix
    wb = w.reshape(out_f, nb, BLOCK_SIZE)
    sb_rtn = np.asarray(rtn.block_scale.astype(jnp.float32))  # [out, nb]
    half = candidates // 2
    best_err = np.full((out_f, nb), np.inf)
    best_sb = sb_rtn.copy()
    for i in range(-half, half + 1):
        cand = np.clip(sb_rtn * 2.0 ** (i / 8), 2.0 ** -9, E4M3_MAX)
        cand = np.asarray(jnp.asarray(cand, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32))
        step = cand * s2  # [out, nb]
        codes = np.asarray(_round_codes(jnp.asarray(wb / step[..., None], jnp.float32)))
        d = (wb - E2M1_GRID[codes] * step[..., None]).astype(np.float64)  # [out, nb, 16]
        err = np.einsum("obk,bkl,obl->ob", d, hess, d)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_sb = np.where(better, cand, best_sb)
    return quantize_with_block_scales(w, best_sb, s2)


def quantize_with_block_scales(w: np.ndarray, block_scale: np.ndarray, global_scale) -> NVFP4Array:
    """Round w [out, in] to E2M1 (nearest-even) under given E4M3 block scales and tensor scale."""
    out_f, in_f = w.shape
    sb = jnp.asarray(block_scale, jnp.float32).astype(jnp.float8_e4m3fn)
    s2 = jnp.float32(global_scale)
    step = np.asarray(sb.astype(jnp.float32)) * np.float32(s2)
    v = w.reshape(out_f, in_f // BLOCK_SIZE, BLOCK_SIZE) / step[..., None]
    codes = np.asarray(_round_codes(jnp.asarray(v, jnp.float32))).reshape(out_f, in_f // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    return NVFP4Array(packed=jnp.asarray(packed), block_scale=sb, global_scale=s2, shape=(out_f, in_f))


def collect_linear_inputs(forward, model, *args, max_rows: int = 4096, seed: int = 0) -> dict[str, np.ndarray]:
    """Run forward(model, *args) eagerly and record every linear's input activations, by parameter name.

    Returns {name: [n, in] float32}, at most max_rows rows per layer (a random subset).
    """
    # Committed first: the package's jitted calls commit their model arguments (`params.committed`), and
    # an uncommitted leaf would reach `linear` as a new object that `by_id` does not know.
    model = committed(model)
    by_id = {id(leaf): name for name, leaf in named_leaves(model.params).items()}
    seen: dict[str, list[np.ndarray]] = {}

    def record(x, w):
        name = by_id.get(id(w))
        if name is not None:
            seen.setdefault(name, []).append(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))

    with execution.changed(input_recorder=record), jax.disable_jit():
        forward(model, *args)
    rng = np.random.default_rng(seed)
    out = {}
    for name, xs in seen.items():
        x = np.concatenate(xs)
        if len(x) > max_rows:
            x = x[rng.choice(len(x), max_rows, replace=False)]
        out[name] = x
    return out


def _without_global_scales(params, patterns: Sequence[str]):
    def drop(name, leaf):
        if isinstance(leaf, NVFP4Array) and _matches(name, patterns):
            return leaf.replace(global_scale=jnp.ones((), jnp.float32))
        return leaf
    return map_named(drop, params)


def drop_global_scales(model, patterns: Sequence[str] = ATTENTION_PROJECTIONS):
    """The missing-scale bug, on purpose: NVFP4 leaves matching `patterns` get global_scale := 1.

    This is what an engine that forgets to multiply `weight_scale_2` computes. dflash-jax cannot do it by accident
    (linear always applies the scales the value carries); here the value itself is falsified.
    """
    return model.replace(params=_without_global_scales(model.params, patterns))


def ablated_forward(forward, patterns: Sequence[str] = ATTENTION_PROJECTIONS):
    """forward(params, ...) -> a forward that ignores the tensor scales of `patterns` (for `audit_scales`)."""
    def fn(params, *args, **kwargs):
        return forward(_without_global_scales(params, patterns), *args, **kwargs)
    return fn
