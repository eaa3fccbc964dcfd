"""audit_scales: every NVFP4 block/global scale must reach the forward's output."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.audit import ScaleAudit, audit_scales
from dflash_jax.linear import linear
from dflash_jax.nvfp4 import NVFP4Array, quantize


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
        tamper = lambda n, w: w.replace(block_scale=jnp.ones(w.block_scale.shape, jnp.float32)) if n == "layers[1].up" else w
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
    assert audit.missing == tuple(f"layers[1].{n}: {s}" for n in ("up", "down") for s in ("block_scale", "global_scale"))


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
