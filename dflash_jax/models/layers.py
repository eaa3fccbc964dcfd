"""The decoder building blocks shared by the target and the drafter: RMSNorm, RoPE, projections, SwiGLU, and the
decoder layer itself (attention is `dflash_jax.models.attention.attention`). One code path serves Qwen3, Qwen2 and
Llama: the config's switches (`qk_norm`, `attention_bias`, `rope_type`) pick the family's pieces.

Every linear goes through `dflash_jax.quant.linear.linear`, which dispatches on the weight's leaf type (dense or NVFP4);
nothing here knows or cares whether a weight is quantized.
"""

from __future__ import annotations

import math
from typing import Callable

import chex
import jax
import jax.numpy as jnp

from dflash_jax import execution
from dflash_jax.models.attention import attention
from dflash_jax.config import TargetConfig
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import cpu_kernel_runs, linear, linear_many
from dflash_jax.models.deltanet import deltanet, deltanet_tree
from dflash_jax.params import MLP, Attention, DecoderLayer, LinearAttnLayer
from dflash_jax.parallel.sharding import constrain_kv


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) as int32, the same index (the first maximum; the first NaN where there is one). In the
    CPU generation loops, the kernel's one pass over each row (`quant.cpu_kernel.first_argmax`: ~70 us -> a few us
    a decode step on a 49,152-wide row); elsewhere two plain reductions: XLA:CPU runs argmax's (value, index) reduce
    element by element (~5 ns per logit: 2.5 ms of an 8-token verify, 10% of the step), a max and a min it
    vectorises (measured 1.0 -> 0.2 ms)."""
    if x.ndim >= 1 and x.dtype == jnp.float32 and execution.current().cpu_kernel and cpu_kernel_runs():
        return cpu_kernel.first_argmax(x)
    m = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == m) | (jnp.isnan(x) & jnp.isnan(m))
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def sum_last_axis(x: jax.Array) -> jax.Array:
    """x.sum(-1, keepdims=True) in one order whatever x's other dimensions: zero-padded to a power of two, then halves
    added elementwise (XLA:CPU picks a reduction's order by its shape: a row's norm summed as one of 1 or of 8 rows
    came out an ulp apart)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centered: bool = False) -> jax.Array:
    """RMSNorm with its statistics in f32 whatever the activation dtype (as HF Qwen3RMSNorm does): y * w, cast to
    x.dtype first; zero_centered: Qwen3.5's `Qwen3_5RMSNorm`, y * (1 + w) all in float32, then cast. Where rows must
    not depend on each other (`execution.rows_in_fixed_order`), the mean is a fixed tree of adds."""
    x32 = x.astype(jnp.float32)
    if execution.rows_in_fixed_order():
        mean = sum_last_axis(x32 * x32) / x.shape[-1]
    else:
        mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean + eps)
    if zero_centered:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def norm(x: jax.Array, weight: jax.Array, cfg: TargetConfig) -> jax.Array:
    """The config's RMSNorm (its eps, zero-centred for Qwen3.5)."""
    return rms_norm(x, weight, cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm)


def rope_inv_freq(cfg: TargetConfig) -> jax.Array:
    """The rotary inverse frequencies [rd/2] float32 for the config's rope type (HF's `ROPE_INIT_FUNCTIONS`); rd is
    the rotated part of a head (`rotary_dim`: the whole head but for partial rotary)."""
    rd = cfg.rotary_dim
    half = rd // 2
    exponent = jnp.arange(0, half, dtype=jnp.float32) * 2.0 / rd
    inv_freq = 1.0 / (cfg.rope_theta ** exponent)  # [hd/2]
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_type == "llama3":
        # Llama 3.x: wavelengths longer than original / low_freq_factor are stretched by the factor, shorter than
        # original / high_freq_factor kept, and those between blended linearly in original / wavelength.
        factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original = cfg.rope_original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return jnp.where(medium, blended, scaled)
    return inv_freq


def rope(x: jax.Array, positions: jax.Array, cfg: TargetConfig) -> jax.Array:
    """NeoX rotate-half RoPE over the first `rotary_dim` dims of each head (the rest pass). x [B, T, n, hd],
    positions [B, T] (absolute). Qwen3.5's multimodal sections rotate by three position streams that are equal for
    text, which is this."""
    rd = cfg.rotary_dim
    half = rd // 2
    inv_freq = rope_inv_freq(cfg)  # [rd/2]
    # Angles in f32: bf16 cannot even represent position 257.
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    # cos and sin once per row and frequency, as one table the rotation reads. Fused into the rotation, XLA:CPU
    # evaluated both once per output element (every head, both halves): 21-27 us a call at 8 rows on SmolLM2, ~1 ms
    # of a verify of 8 tokens. reduce_precision to float32's own 8 exponent and 23 mantissa bits changes no value but
    # keeps XLA's fusion from copying the cos / sin into each consumer (and lets it compute the layers' identical
    # tables once); tests/test_target.py checks both on the compiled program.
    table = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)  # [B, T, rd]
    table = jax.lax.reduce_precision(table, exponent_bits=8, mantissa_bits=23)
    cos, sin = table[:, :, None, :half], table[:, :, None, half:]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:rd]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rd < cfg.head_dim:
        parts.append(x32[..., rd:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


def _heads(y: jax.Array, bias, heads: int, cfg: TargetConfig) -> jax.Array:
    """A projection's `linear` output y [B, T, heads*hd] -> [B, T, heads, hd], plus the bias where the family has one
    (Qwen2)."""
    B, T, _ = y.shape
    if (bias is not None) != cfg.attention_bias:  # params built for another family than the config says
        raise ValueError(f"config attention_bias={cfg.attention_bias} but the layer's params "
                         f"{'have' if bias is not None else 'have no'} q/k/v biases")
    if bias is not None:
        chex.assert_shape(bias, (heads * cfg.head_dim,))
        y = y + bias.astype(y.dtype)
    return y.reshape(B, T, heads, cfg.head_dim)


def _qk_norm(x: jax.Array, weight, cfg: TargetConfig) -> jax.Array:
    if (weight is not None) != cfg.qk_norm:
        raise ValueError(f"config qk_norm={cfg.qk_norm} but the layer's params "
                         f"{'have' if weight is not None else 'have no'} q_norm / k_norm")
    return norm(x, weight, cfg) if cfg.qk_norm else x


def project_kv(attn: Attention, h: jax.Array, positions: jax.Array, cfg: TargetConfig, *, projected=None):
    """Keys (normed where the family has q/k norm, rotated) and values of h [B, T, H] -> ([B, T, nKV, hd] x2).
    projected: the (k, v) `linear` outputs when the caller computed them already (`decoder_layer`'s one call)."""
    ky, vy = linear_many(h, (attn.k_proj, attn.v_proj)) if projected is None else projected
    k = _heads(ky, getattr(attn, "k_bias", None), cfg.num_key_value_heads, cfg)
    k = rope(_qk_norm(k, attn.k_norm, cfg), positions, cfg)
    v = _heads(vy, getattr(attn, "v_bias", None), cfg.num_key_value_heads, cfg)
    return constrain_kv(k, v, cfg)  # placed as the KV cache on a mesh (parallel.sharding); identity otherwise


def project_q(attn: Attention, h: jax.Array, positions: jax.Array, cfg: TargetConfig, *, projected=None):
    """Queries [B, T, nH, hd]; with an output gate (Qwen3.5) (queries, gate [B, T, nH * hd]).
    projected: the q `linear` output when the caller computed it already."""
    y = linear(h, attn.q_proj) if projected is None else projected
    if cfg.attn_output_gate:
        B, T, _ = h.shape
        nH, hd = cfg.num_attention_heads, cfg.head_dim
        y = y.reshape(B, T, nH, 2 * hd)  # per head: the query's hd, then the gate's hd
        q, gate = y[..., :hd], y[..., hd:].reshape(B, T, nH * hd)
        return rope(_qk_norm(q, attn.q_norm, cfg), positions, cfg), gate
    q = _heads(y, getattr(attn, "q_bias", None), cfg.num_attention_heads, cfg)
    return rope(_qk_norm(q, attn.q_norm, cfg), positions, cfg)


def mlp(p: MLP, x: jax.Array) -> jax.Array:
    gate, up = linear_many(x, (p.gate_proj, p.up_proj))  # one kernel call for both (same input)
    return linear(jax.nn.silu(gate) * up, p.down_proj)


def _identity(y: jax.Array) -> jax.Array:
    return y


def no_hook(kind: str, h: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """The sublayer hook of a plain decoder layer: the sublayer sees its normed input as it is, and its output goes
    to the residual as it is."""
    return h, _identity


# hook(kind, h) -> (what the sublayer runs on, what its output goes through before the residual add), for kind
# "attention" and "mlp": how DFlash2 puts its block convolution around both sublayers (`block_conv.sublayer_hook`).
SublayerHook = Callable[[str, jax.Array], tuple[jax.Array, Callable[[jax.Array], jax.Array]]]


def decoder_layer(layer: DecoderLayer, x: jax.Array, positions: jax.Array, cfg: TargetConfig, *,
                  cache_k: jax.Array | None = None, cache_v: jax.Array | None = None,
                  cache_len: jax.Array | None = None, write: bool = False, mask: jax.Array | None = None,
                  causal: bool, window: int | None = None, chunk: int | None = None, hook: SublayerHook = no_hook):
    """One Qwen3 decoder layer over x [B, T, H] at absolute positions [B, T], with the layer's causality and sliding
    window (None = full): the target's attention layers and every drafter layer.

    write=False: the queries attend to cached keys (cache_k/cache_v [B, nKV, S, hd], slot = position, valid below
    cache_len; none when cache_k is None) and to this call's own keys (restricted by mask [B, T, T] when given).
    Returns (x [B, T, H], k, v [B, T, nKV, hd]): this call's post-RoPE keys and values (the drafter drops its block's).
    write=True: this call's keys and values are first written into the cache at `positions` (a run of consecutive
    slots per row, from its length, as `forward_hidden` makes them), then the queries attend
    to the cache alone, valid below cache_len (which counts the new tokens). Returns (x, cache_k, cache_v) updated.
    Writing before reading lets XLA update the cache in place: a read of the old cache next to an in-place write of
    it forces a copy of the whole cache every step.
    hook: what runs around each sublayer (`SublayerHook`; DFlash2's convolution), nothing by default.
    """
    h, finish = hook("attention", norm(x, layer.input_layernorm, cfg))
    attn = layer.self_attn
    qy, ky, vy = linear_many(h, (attn.q_proj, attn.k_proj, attn.v_proj))  # one kernel call for all three
    q = project_q(attn, h, positions, cfg, projected=qy)
    q, gate = q if cfg.attn_output_gate else (q, None)
    k, v = project_kv(attn, h, positions, cfg, projected=(ky, vy))
    if write:  # positions are each row's run from its length (slot = position): `write_kv_run`, in place
        start, n = positions[:, 0], jnp.full(positions.shape[:1], positions.shape[1], jnp.int32)
        k, v = write_kv_run(cache_k, k, start, n), write_kv_run(cache_v, v, start, n)
        a = attention(q, positions, cache_k=k, cache_v=v, cache_len=cache_len, causal=causal, window=window,
                      chunk=chunk)
    else:
        a = attention(q, positions, cache_k=cache_k, cache_v=cache_v, cache_len=cache_len, k=k, v=v,
                      k_pos=positions, k_mask=mask, causal=causal, window=window, chunk=chunk)
    if gate is not None:  # Qwen3.5: a sigmoid output gate per head and dim
        a = a * jax.nn.sigmoid(gate)
    x = x + finish(linear(a, layer.self_attn.o_proj))
    h, finish = hook("mlp", norm(x, layer.post_attention_layernorm, cfg))
    x = x + finish(mlp(layer.mlp, h))
    return x, k, v


def linear_attn_layer(layer: LinearAttnLayer, x: jax.Array, cfg: TargetConfig, conv: jax.Array, state: jax.Array, *,
                      keep: jax.Array | None = None, defer: bool = False, tree: tuple | None = None):
    """One Qwen3.5 Gated DeltaNet decoder layer over x [B, T, H] from its states (see `models.deltanet.deltanet`).

    Returns (x, new conv, new state), or with defer=True (x, DeltaInputs) and the states untouched. tree = (mask
    [B, T, T], conv taps [B, T, K]): the tokens are a draft tree's nodes, each run from its parent's states
    (`models.deltanet.deltanet_tree`; deferred, as a verify is)."""
    h = norm(x, layer.input_layernorm, cfg)
    if tree is not None:
        mask, taps = tree
        out, *states = deltanet_tree(layer.linear_attn, h, cfg, conv, state, mask=mask, taps=taps)
    else:
        out, *states = deltanet(layer.linear_attn, h, cfg, conv, state, keep=keep, defer=defer)
    x = x + out
    x = x + mlp(layer.mlp, norm(x, layer.post_attention_layernorm, cfg))
    return (x, *states)


def write_rows(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Scatter new [B, T, ...] into cache [B, S, ...] at positions [B, T].

    Out-of-range positions are *dropped*, never clamped: a clamped write would silently overwrite valid entries.
    Callers mark slots they do not want written with a position >= S.
    """
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")


def write_kv_run(cache: jax.Array, new: jax.Array, start: jax.Array, n: jax.Array) -> jax.Array:
    """`write_kv` of a run: new [B, T, nKV, hd] row j at slot start[b] + j of cache [B, nKV, S, hd] for j < n[b]
    (slots past S dropped). With one batch row this is a slice, a select and a dynamic-update-slice of T slots (the
    block [s0, s0 + T) clamped inside the cache, new row j at block row start - s0 + j), which XLA:CPU runs in place
    as one small loop; a scatter of T rows into the cache was split across its thread pool (a tree step's 60 commits
    and the drafter's context writes). Several rows: `write_kv` at the run's slots."""
    B, nKV, S, hd = cache.shape
    T = new.shape[1]
    j = jnp.arange(T, dtype=jnp.int32)
    if B != 1 or T > S:
        return write_kv(cache, new, jnp.where(j[None] < n[:, None], start[:, None] + j[None], S))
    s0 = jnp.clip(start[0], 0, S - T)
    src = j - (start[0] - s0)  # [T] the new row each block row takes (< 0 or >= n: it keeps its old value)
    taken = jnp.take(jnp.swapaxes(new, 1, 2), jnp.clip(src, 0, T - 1), axis=2).astype(cache.dtype)  # [1, nKV, T, hd]
    old = jax.lax.dynamic_slice(cache, (0, 0, s0, 0), (1, nKV, T, hd))
    block = jnp.where(((src >= 0) & (src < n[0]))[None, None, :, None], taken, old)
    return jax.lax.dynamic_update_slice(cache, block, (0, 0, s0, 0))


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Scatter keys or values new [R, T, nKV, hd] (as the projections make them) into a head-major cache
    [B, nKV, S, hd] at positions [R, T] of cache rows `rows` [R, 1] (default: every row, R = B); out-of-range
    positions and rows are dropped, as in `write_rows`."""
    rows = jnp.arange(cache.shape[0])[:, None] if rows is None else rows
    # the index arrays sit on either side of the head slice, so their [R, T] dims lead: the update is [R, T, nKV, hd]
    return cache.at[rows, :, positions].set(new.astype(cache.dtype), mode="drop")
