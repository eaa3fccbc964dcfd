"""audit_scales: every NVFP4 block-scale element and global scale must reach the forward's output, and the forward must
equal the same forward with each NVFP4 leaf replaced by its exact dense dequantization."""

import dataclasses
import importlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.quant.audit import ScaleAudit, audit_scales
from dflash_jax.quant.linear import linear
from dflash_jax.quant.nvfp4 import NVFP4Array, quantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    up: Any  # [hidden, d]
    down: Any  # [d, hidden]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLP:
    layers: list[Layer]
    norm: jax.Array  # [d], dense


D, H = 32, 64
ALL = ("layers[0].up", "layers[0].down", "layers[1].up", "layers[1].down")


def _params() -> MLP:
    rng = np.random.default_rng(0)
    w = lambda *s: quantize(rng.standard_normal(s).astype(np.float32) * 0.05)
    return MLP(layers=[Layer(w(H, D), w(D, H)) for _ in range(2)], norm=jnp.ones(D))


def _x():
    return jnp.asarray(np.random.default_rng(1).standard_normal((3, D)), jnp.float32)


def forward(p: MLP, x, tamper=lambda name, w: w):
    for i, layer in enumerate(p.layers):
        h = jax.nn.gelu(linear(x * p.norm, tamper(f"layers[{i}].up", layer.up)))
        x = x + linear(h, tamper(f"layers[{i}].down", layer.down))
    return x


def test_correct_forward_passes():
    audit = audit_scales(forward, _params(), _x())
    assert audit.ok and audit.checked == ALL and audit.missing == ()
    audit.raise_if_missing()
    assert "layers[1].down: block_scale ok, global_scale ok" in str(audit)


def test_jitted_forward_and_kwargs():
    f = jax.jit(lambda p, x, *, scale: forward(p, x) * scale)
    assert audit_scales(f, _params(), _x(), scale=2.0).ok


def test_dropped_global_scale_is_named():
    def bad(p, x):
        return forward(p, x, lambda n, w: w.replace(global_scale=jnp.ones(())) if n == "layers[0].down" else w)

    audit = audit_scales(bad, _params(), _x())
    assert not audit.ok
    assert audit.missing == ("layers[0].down: global_scale",)
    assert "layers[0].down: block_scale ok, global_scale MISSING" in str(audit)
    with pytest.raises(AssertionError, match=r"layers\[0\]\.down: global_scale"):
        audit.raise_if_missing()


def test_ignored_block_scale_is_named():
    def bad(p, x):
        def tamper(n, w):
            return w.replace(block_scale=jnp.ones(w.block_scale.shape, jnp.float32)) if n == "layers[1].up" else w

        return forward(p, x, tamper)

    assert audit_scales(bad, _params(), _x()).missing == ("layers[1].up: block_scale",)


def test_scale_folded_in_elsewhere_still_counts():
    # A forward may apply s2 after the matmul itself (llama.cpp style); it still reaches the output.
    def post_scaled(p, x):
        tamper = lambda n, w: w.replace(global_scale=jnp.ones(())) if n == "layers[0].up" else w
        up0 = p.layers[0].up
        h = jax.nn.gelu(linear(x, tamper("layers[0].up", up0)) * up0.global_scale)
        return x + linear(h, p.layers[0].down)

    audit = audit_scales(post_scaled, _params(), _x())
    assert audit.checked == ALL
    # layer 1 is unused by this forward, so all of its scales are reported.
    assert audit.missing == tuple(f"layers[1].{n}: {s}" for n in ("up", "down")
                                  for s in ("block_scale", "global_scale"))


def test_no_nvfp4_leaves():
    audit = audit_scales(lambda p, x: x @ p["w"], {"w": jnp.ones((D, 4))}, _x())
    assert audit == ScaleAudit(checked=(), missing=()) and audit.ok
    assert "no NVFP4 leaves" in str(audit)


def test_dict_tuple_and_root_params():
    q1, q2 = quantize(np.ones((4, 16), np.float32)), quantize(np.arange(64, dtype=np.float32).reshape(4, 16))
    params = {"a": (q1, jnp.ones((4, 16))), "b": {"c": q2}}

    def f(p, x):
        # Output pytree with an integer leaf: ignored, not an error.
        y = linear(x, p["a"][0]) + linear(x, p["b"]["c"]) + linear(x, p["a"][1])
        return {"y": y, "argmax": jnp.argmax(y, -1)}

    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 16)), jnp.float32)
    audit = audit_scales(f, params, x)
    assert audit.ok and audit.checked == ("a[0]", "b.c")
    assert isinstance(params["a"][0], NVFP4Array)  # params are not mutated
    assert params["a"][0].block_scale.dtype == jnp.float8_e4m3fn
    root = audit_scales(lambda w, x: linear(x, w), q2, x)
    assert root.ok and root.checked == ("<root>",)


# ---------------------------------------------------------------------------------------------------------------
# Meaning, not only reachability: forwards that mis-apply a scale (every scale still reaches the output, so a
# reachability check alone passes them). Each must fail the audit and name the leaf. `missing` = some scale element
# does not reach the output; `mismatched` = the forward differs from the same forward with the leaf replaced by its
# exact dense dequantization.
# ---------------------------------------------------------------------------------------------------------------

def _tampered(leaf_name, change):
    def bad(p, x):
        return forward(p, x, lambda n, w: change(w) if n == leaf_name else w)
    return bad


def _reuse_block0(w):  # block 0's scale applied to every block of the row
    return w.replace(block_scale=jnp.broadcast_to(w.block_scale[..., :1], w.block_scale.shape))


def _shift_rows(w):  # block scales of row r applied to row r + 1
    return w.replace(block_scale=jnp.roll(w.block_scale, 1, axis=0))


def _shift_blocks(w):  # block b's scale applied to block b + 1 (within the row)
    return w.replace(block_scale=jnp.roll(w.block_scale, 1, axis=-1))


def _square_global(w):
    return w.replace(global_scale=w.global_scale * w.global_scale)


def _transpose_flat(w):  # the [out, in/16] matrix read in the wrong order (transposed, then viewed in the same shape)
    return w.replace(block_scale=w.block_scale.T.reshape(w.block_scale.shape))


def _drop_one_block(w):  # one block scale forgotten (treated as 1)
    return w.replace(block_scale=w.block_scale.at[3, 1].set(1.0))


def _global_into_blocks(w):  # the tensor scale applied twice: once folded into the block scales, once by linear
    return w.replace(block_scale=w.block_scale.astype(jnp.float32) * w.global_scale)


# (mutation, leaf, whether some scale element also stops reaching the output)
MUTATIONS = [
    (_reuse_block0, "layers[0].up", True),
    (_shift_rows, "layers[1].down", False),
    (_shift_blocks, "layers[0].down", False),
    (_square_global, "layers[0].down", False),
    (_transpose_flat, "layers[1].up", False),
    (_drop_one_block, "layers[1].up", True),
    (_global_into_blocks, "layers[1].down", False),
]


@pytest.mark.parametrize("change,leaf,unreachable", MUTATIONS, ids=lambda m: getattr(m, "__name__", None))
def test_misapplied_scale_is_named(change, leaf, unreachable):
    params = _params()
    assert float(getattr(params.layers[0], "up").global_scale) != 1.0
    audit = audit_scales(_tampered(leaf, change), params, _x())
    assert not audit.ok, str(audit)
    assert audit.mismatched == (leaf,), str(audit)  # exactly the tampered leaf: the others are applied correctly
    assert audit.missing == ((f"{leaf}: block_scale",) if unreachable else ()), str(audit)
    assert audit.output_error > 1e-3
    assert f"{leaf}: block_scale {'MISSING' if unreachable else 'ok'}, global_scale ok, dequantized forward DIFFERS" \
        in str(audit)
    with pytest.raises(AssertionError, match=re.escape(leaf)):
        audit.raise_if_missing()


@pytest.mark.parametrize("change,leaf", [(_reuse_block0, "layers[0].up"), (_shift_rows, "layers[1].down")],
                         ids=["reuse_block0", "shift_rows"])
def test_unlocalized_audit_finds_the_same_fault_without_naming_the_leaf(change, leaf):
    """localize=False (what tests auditing a deliberately broken forward use: naming the leaf is one op-by-op forward
    per leaf): the same reachability result and output error, still not ok, the mismatch reported as a whole."""
    named = audit_scales(_tampered(leaf, change), _params(), _x())
    whole = audit_scales(_tampered(leaf, change), _params(), _x(), localize=False)
    assert whole.missing == named.missing and whole.output_error == named.output_error > 1e-3
    assert not whole.ok and whole.mismatched == ("<all NVFP4 leaves together>",), str(whole)
    assert "localize=False" in str(whole)
    assert audit_scales(forward, _params(), _x(), localize=False).ok  # a correct forward passes either way


def test_dropped_block_scale_names_the_element():
    audit = audit_scales(_tampered("layers[1].up", _drop_one_block), _params(), _x())
    assert "1 of 128 block scales do not reach the output (first at [3, 1])" in str(audit)


def test_correct_forward_reports_no_mismatch():
    audit = audit_scales(forward, _params(), _x())
    assert audit.mismatched == () and audit.output_error <= 1e-6


# A square block-scale matrix ([4, 64] weight -> [4, 4] scales): a plain transpose keeps the shape.
def _square_params():
    rng = np.random.default_rng(3)
    return {"sq": quantize(rng.standard_normal((4, 64)).astype(np.float32)),
            "other": quantize(rng.standard_normal((4, 64)).astype(np.float32))}


def _square_forward(p, x, tamper=lambda n, w: w):
    return linear(x, tamper("sq", p["sq"])) * linear(x, tamper("other", p["other"]))


def test_transposed_square_block_scales_are_named():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 64)), jnp.float32)
    assert audit_scales(_square_forward, _square_params(), x).ok
    bad = lambda p, x: _square_forward(p, x, lambda n, w: w.replace(block_scale=w.block_scale.T) if n == "sq" else w)
    audit = audit_scales(bad, _square_params(), x)
    assert audit.mismatched == ("sq",) and audit.missing == (), str(audit)


def test_squared_unit_global_scale_is_caught_by_the_gradients():
    """global_scale == 1: squaring it changes no value, so only the gradient identity sees it (d/ds s^2 = 2s)."""
    rng = np.random.default_rng(5)
    w = lambda *s: quantize(rng.standard_normal(s).astype(np.float32) * 0.05, global_scale=1.0)
    params = MLP(layers=[Layer(w(H, D), w(D, H)) for _ in range(2)], norm=jnp.ones(D))
    assert audit_scales(forward, params, _x()).ok
    audit = audit_scales(_tampered("layers[1].up", _square_global), params, _x())
    assert audit.output_error == 0.0  # same numbers
    assert audit.mismatched == ("layers[1].up",) and audit.missing == (), str(audit)
    assert "global_scale: gradient differs" in str(audit)


def test_a_broken_dequantize_inside_linear_is_caught(monkeypatch):
    """The dense reference is computed by the audit itself, not by nvfp4.dequantize: a bug in the library's own
    dequantization (here: block scales shifted by one block) is caught on every leaf."""
    import dflash_jax.quant.nvfp4 as nvfp4_mod
    linear_mod = importlib.import_module("dflash_jax.quant.linear")
    kernel_mod = importlib.import_module("dflash_jax.quant.pallas_nvfp4")

    def shifted(q, dtype=jnp.float32):
        return nvfp4_mod.dequantize(q.replace(block_scale=jnp.roll(q.block_scale, 1, axis=-1)), dtype)

    def shifted_unscaled(q, dtype=jnp.float32):  # what the portable W4A16 path dequantizes with
        return nvfp4_mod.dequantize_unscaled(q.replace(block_scale=jnp.roll(q.block_scale, 1, axis=-1)), dtype)

    monkeypatch.setattr(linear_mod, "dequantize", shifted)
    monkeypatch.setattr(kernel_mod, "dequantize_unscaled", shifted_unscaled)
    audit = audit_scales(forward, _params(), _x())
    assert audit.mismatched == ALL, str(audit)


# -- W4A4 leaves and the native backend --------------------------------------------------------------------------

def _w4a4_params():
    p = _params()
    scale = jnp.float32(4.0 / 2688.0)  # activations of |x| <= ~4 map onto the E2M1 x E4M3 range
    return MLP(layers=[Layer(l.up.replace(input_scale=scale), l.down.replace(input_scale=scale)) for l in p.layers],
               norm=p.norm)


def test_w4a4_forward_matches_its_activation_rounded_reference():
    audit = audit_scales(forward, _w4a4_params(), _x())
    assert audit.ok, str(audit)


def test_w4a4_forward_that_skips_the_activation_rounding_is_named():
    audit = audit_scales(_tampered("layers[0].down", lambda w: w.replace(input_scale=None)), _w4a4_params(), _x())
    assert audit.mismatched == ("layers[0].down",) and audit.missing == (), str(audit)


def test_native_backend_reference_rounds_activations(monkeypatch):
    """On the native (W4A4) backend, emulated on CPU, the reference rounds activations with the dynamic scale, so a
    correct forward matches it and a mis-applied scale is named. (Reachability is not asserted: the native path casts
    block scales to float8 for the kernel, and a float8 cast has no tangent.)"""
    linear_mod = importlib.import_module("dflash_jax.quant.linear")

    def emulated(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), 16, axis=-1)
        b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), 16, axis=-1)
        return jnp.einsum("bmk,bnk->bmn", a, b).astype(preferred_element_type)

    monkeypatch.setattr(linear_mod, "_scaled_matmul", emulated)
    monkeypatch.setattr(linear_mod, "native_supported", lambda: True)
    linear_mod.set_default_backend("native")
    try:
        good = audit_scales(forward, _params(), _x())
        assert good.mismatched == () and good.output_error < 1e-5, str(good)
        bad = audit_scales(_tampered("layers[1].up", _shift_rows), _params(), _x())
        assert bad.mismatched == ("layers[1].up",), str(bad)
    finally:
        linear_mod.set_default_backend(None)


def test_tensor_scale_before_rmsnorm_with_large_inputs():
    """A tensor scale in front of an RMSNorm reaches the output only through eps; with large inputs its float32
    gradient can round to exactly 0 (it does for the shipped drafter's fc on real target features: test_shipped.py).
    The audit then re-checks it with shrunken inputs: a correct forward passes, a dropped scale is still named."""
    from dflash_jax.models.layers import rms_norm

    p = MLP(layers=[_params().layers[0]], norm=jnp.ones(D))

    def fwd(p, x, drop=False):
        up = p.layers[0].up
        if drop:
            up = up.replace(global_scale=jnp.ones_like(up.global_scale))
        h = rms_norm(linear(x, up), jnp.ones(H), 1e-6)
        return linear(h, p.layers[0].down)

    for scale in (1.0, 1e4):
        x = _x() * scale
        assert audit_scales(fwd, p, x).ok, scale
        assert audit_scales(lambda p, x: fwd(p, x, drop=True), p, x).missing == ("layers[0].up: global_scale",)
