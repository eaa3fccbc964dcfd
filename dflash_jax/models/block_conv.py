"""DFlash2's grouped dynamic causal convolution (z-lab dflash/model.py `GroupedDynamicCausalConv` at 07ebd93db9f4).

Around a sublayer f (attention or MLP) with input x [.., T, H]:
    dyn       = kernel_projection(x) viewed as [.., T, 2, Kc, groups]   (side, tap, group; group fastest)
    prepare   u_t = sum_o (base[0, o] + dyn_t[0, o, g(c)]) * x_{t-o}    (per channel c; g(c) = c // group_size)
    finish    y_t = sum_o (base[1, o] + dyn_t[1, o, g(c)]) * f(u)_{t-o}
Both sides use the dynamic taps computed from the sublayer's *input* at the output position t. Taps reach back
Kc - 1 positions, zero-padded at the start of each block: the convolution never crosses a block boundary (slot 0
reads zeros for o >= 1, slot 1 reads the anchor). The block's context (the target features) is never convolved.

Blocks are the last `block_len` positions of every group along T: inference passes one block (T = bs), the trainer
N blocks per sequence (T = N * bs); both reshape to [.., T / bs, bs, H], so both compute the same thing.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from dflash_jax.quant.linear import linear
from dflash_jax.params import DynamicConv


def dynamic_taps(conv: DynamicConv, x: jax.Array, kernel_size: int, group_size: int) -> jax.Array:
    """x [B, T, H] -> dynamic taps [B, T, 2, Kc, groups] (in x.dtype)."""
    B, T, H = x.shape
    groups = H // group_size
    dyn = linear(x, conv.kernel_projection)  # [B, T, 2*Kc*groups]
    chex.assert_shape(dyn, (B, T, 2 * kernel_size * groups))
    return dyn.reshape(B, T, 2, kernel_size, groups)


def grouped_causal_conv(x: jax.Array, taps: jax.Array, base: jax.Array, group_size: int, block_len: int
                        ) -> jax.Array:
    """x [B, T, H]; taps [B, T, Kc, groups] (dynamic, per output position); base [Kc, H] (per channel).

    out_t = sum_o (base[o] + taps_t[o, group]) * x_{t-o}, with x_{t-o} = 0 when t-o falls before t's block.
    """
    B, T, H = x.shape
    Kc, groups = taps.shape[-2:]
    chex.assert_shape(taps, (B, T, Kc, H // group_size))
    chex.assert_shape(base, (Kc, H))
    if T % block_len:
        raise ValueError(f"grouped_causal_conv: length {T} is not a whole number of {block_len}-token blocks")
    xb = x.reshape(B, T // block_len, block_len, H)  # [B, nb, bs, H]
    base = base.astype(x.dtype)
    out = jnp.zeros((B, T // block_len, block_len, groups, group_size), x.dtype)
    for o in range(Kc):
        # x_{t-o} inside the block: shift by o along the block axis, zeros in front.
        shifted = xb if o == 0 else jnp.pad(xb[:, :, :block_len - o], ((0, 0), (0, 0), (o, 0), (0, 0)))
        shifted = shifted.reshape(B, T // block_len, block_len, groups, group_size)
        dyn = taps[:, :, o].reshape(B, T // block_len, block_len, groups, 1)  # one tap per group
        out = out + (base[o].reshape(groups, group_size) + dyn) * shifted
    return out.reshape(B, T, H)


def prepare(conv: DynamicConv, x: jax.Array, *, kernel_size: int, group_size: int, block_len: int
            ) -> tuple[jax.Array, jax.Array]:
    """The input side: (conv(x; base[0] + dyn[0]) [B, T, H], dyn[1] [B, T, Kc, groups] kept for `finish`)."""
    dyn = dynamic_taps(conv, x, kernel_size, group_size)
    out = grouped_causal_conv(x, dyn[:, :, 0], conv.base_kernel[0], group_size, block_len)
    return out, dyn[:, :, 1]


def finish(conv: DynamicConv, y: jax.Array, taps: jax.Array, *, group_size: int, block_len: int) -> jax.Array:
    """The output side: conv(y; base[1] + dyn[1]) [B, T, H]."""
    return grouped_causal_conv(y, taps, conv.base_kernel[1], group_size, block_len)


def sublayer_hook(attention_conv: DynamicConv | None, mlp_conv: DynamicConv | None, *, kernel_size: int,
                  group_size: int, block_len: int):
    """A decoder layer's sublayer hook (`models.layers.SublayerHook`) that convolves around each sublayer:
    finish(sublayer(prepare(x))) with the layer's attention or MLP convolution; a sublayer without one (DFlash) runs
    as it is."""
    convs = {"attention": attention_conv, "mlp": mlp_conv}

    def hook(kind: str, x: jax.Array):
        conv = convs[kind]
        if conv is None:
            return x, lambda y: y
        u, taps = prepare(conv, x, kernel_size=kernel_size, group_size=group_size, block_len=block_len)
        return u, lambda y: finish(conv, y, taps, group_size=group_size, block_len=block_len)

    return hook


__all__ = ["dynamic_taps", "grouped_causal_conv", "prepare", "finish", "sublayer_hook"]
