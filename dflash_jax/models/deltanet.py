"""Qwen3.5's linear attention: the Gated DeltaNet (HF transformers 5.x `Qwen3_5GatedDeltaNet`), with its two states.

Per layer and row the state is (conv window [B, K-1, C], the last K-1 conv inputs, channels grouped by key head as
in_proj_qkv's rows (`params.linear_qkv_order`); recurrent state S [B, nV, dk, dv],
float32). For each token t (after a depthwise causal conv + SiLU over q, k, v and L2-normalised q, k):

  S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t / sqrt(dk)
  beta = sigmoid(b),   g = -exp(A_log) * softplus(a + dt_bias)   (g <= 0: a decay)

Two forms compute it: `recurrent_rule` (a `lax.scan` over tokens: one decode step, and the exact rollback below) and
`chunked_rule` (the UT-transform form over chunks of tokens, a `lax.scan` over a static number of chunks: prefill and
verify). They agree up to float rounding (tests/test_hybrid.py).

Rollback. A KV cache rolls back by a length; S after verifying D + 1 tokens has absorbed all of them. So the verify
(`defer=True`) leaves the states untouched and returns each layer's delta-rule inputs (`DeltaInputs`: the conv
inputs and q, k, v, g, beta per token; the rollback reads dk + dv + 2 floats per value head and token); once the
acceptance length n is known per row, `commit` runs the recurrent form over those tokens keeping the update of token t only where t < n, and
takes the conv window ending at token n - 1. Keeping the per-position states instead would hold dk x dv floats per
value head and token: at Qwen3.5-27B shapes (48 DeltaNet layers of 48 value heads of 128 x 128) and D = 15 that is
2,304 MiB per row against 54 MiB of inputs (README, "Hybrid targets").

Draft trees (`deltanet_tree`): the nodes of a tree (parents before children) each run from their parent's states:
the conv reads up the node's own path (`tree_conv`, taps by parent index) and the delta rule runs along it
(`tree_rule`: the chunked form's one chunk with the chain's order replaced by the ancestor relation). The states stay
untouched; `commit_path` takes the accepted path's inputs in path order and commits them as a chain's (`commit`), so
no per-node state is ever kept.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.params import GatedDeltaNet
from dflash_jax.quant.linear import linear, linear_many

CHUNK = 64  # tokens per chunk of the chunked form (HF's default); fewer tokens make one chunk of their own length


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaInputs:
    """What a deferred (verify) pass of one DeltaNet layer hands to `commit`."""

    xin: jax.Array  # [B, K-1+T, C] the conv window before the pass, then the pass's conv inputs
    q: jax.Array  # [B, T, nV, dk] float32, L2-normalised and scaled by dk^-0.5, repeated to the value heads
    #   (`commit` does not read q: inside the loop program XLA never keeps it)
    k: jax.Array  # [B, T, nV, dk] float32, L2-normalised
    v: jax.Array  # [B, T, nV, dv] float32
    g: jax.Array  # [B, T, nV] float32 log decay
    beta: jax.Array  # [B, T, nV] float32


def empty_states(cfg: TargetConfig, batch: int) -> tuple[jax.Array, jax.Array]:
    """(conv window [B, K-1, C] in the compute dtype, recurrent state [B, nV, dk, dv] float32), all zeros."""
    conv = jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), cfg.dtype)
    state = jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                      jnp.float32)
    return conv, state


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    # As FLA / HF: x * rsqrt(sum x^2 + eps), in float32.
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(xin: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise causal conv + SiLU: xin [B, K-1+T, C] (window then new inputs), weight [C, 1, K] -> [B, T, C].

    Output t reads inputs t..t+K-1 of xin, tap j weighting xin[t + j] (PyTorch's conv1d is a cross-correlation)."""
    K = weight.shape[-1]
    T = xin.shape[1] - (K - 1)
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    x32 = xin.astype(jnp.float32)
    out = sum(x32[:, j:j + T, :] * w[None, None, :, j] for j in range(K))  # K is static and small (4)
    return jax.nn.silu(out).astype(xin.dtype)


def _masked(g, beta, keep):
    """g and beta with the tokens at t >= keep[b] made no-ops: exp(0) = 1 leaves S as it is and beta = 0 writes 0,
    so such a token leaves the state bit for bit unchanged (finite states)."""
    if keep is None:
        return g, beta
    live = (jnp.arange(g.shape[1], dtype=jnp.int32)[None, :] < keep.astype(jnp.int32)[:, None])[..., None]
    return jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)


def _step(S, kt, vt, gt, bt):
    """One token's update of S [B, nV, dk, dv]: decay, then the delta rule's write."""
    S = S * jnp.exp(gt)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", S, kt)
    delta = (vt - kv_mem) * bt[..., None]
    return S + kt[..., :, None] * delta[..., None, :]


def recurrent_rule(q, k, v, g, beta, state, keep: jax.Array | None = None):
    """The gated delta rule one token at a time (a `lax.scan` over T).

    q, k [B, T, nV, dk], v [B, T, nV, dv], g, beta [B, T, nV] (float32; q already scaled), state [B, nV, dk, dv].
    keep [B] (optional): token t updates row b's state only where t < keep[b] (the rollback of a verify).
    Returns (o [B, T, nV, dv], final state)."""
    g, beta = _masked(g, beta, keep)

    def step(S, xs):
        qt, kt, vt, gt, bt = xs  # [B, nV, dk], [B, nV, dk], [B, nV, dv], [B, nV], [B, nV]
        S = _step(S, kt, vt, gt, bt)
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt)

    state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1), state


def recurrent_state(k, v, g, beta, state, keep: jax.Array | None = None) -> jax.Array:
    """`recurrent_rule`'s final state alone (no outputs: what a rollback needs)."""
    g, beta = _masked(g, beta, keep)

    def step(S, xs):
        return _step(S, *xs), None

    state, _ = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (k, v, g, beta)))
    return state


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + strictly_lower(a))^-1 for a [..., C, C] (a's diagonal and upper part ignored), by the nilpotent series:
    with N = -strictly_lower(a), N^C = 0, so (I - N)^-1 = I + N + ... + N^(C-1) = (I + N)(I + N^2)(I + N^4)...,
    ceil(log2 C) - 1 squarings. A zero of a (a non-ancestor in `tree_rule`) stays an exact zero of the inverse.

    Matmuls, not `lax.linalg.triangular_solve`: on CPU that is LAPACK's trsm through an FFI call that splits its batch
    over XLA's intra-op thread pool and waits inside a pool thread; two such solves scheduled at once on a 2-thread
    pool left both threads waiting for work neither could run (the test suite's rare stall of 2026-12-04/05; the
    stacks: reports/experiments/README.md)."""
    C = a.shape[-1]
    hi = jax.lax.Precision.HIGHEST  # squarings compound rounding: no reduced-precision (TF32) passes on GPU
    n = -jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), a, 0)
    inv, power, covered = jnp.eye(C, dtype=a.dtype) + n, n, 2  # inv = I + N + ... + N^(covered-1)
    while covered < C:
        power = jnp.matmul(power, power, precision=hi)
        inv = inv + jnp.matmul(inv, power, precision=hi)
        covered *= 2
    return inv


def _ut_transform(q, k, v, beta, cum, sees):
    """The UT transform of `chunked_rule` and `tree_rule` over one group of tokens (a chunk, or a tree's nodes):
    q, k [.., T, dk], v [.., T, dv], beta and cum (log decay from the group's start through t) [.., T], sees [.., T, T]
    (t sees s: s <= t in a chunk, s on t's path in a tree). Returns (new_v [.., T, dv], k_cum [.., T, dk], intra
    [.., T, T]): (I + strictly_lower(ut))^-1 applied to v * beta and to the decayed k * beta (unit diagonal: ut's own
    is ignored), and the decayed q . k pairs."""
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # exp(cum_t - cum_s) where t sees s, else 0 (masked before exp: the difference may be > 0 elsewhere)
    pair = jnp.exp(jnp.where(sees, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [.., T, T]
    ut = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pair
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * pair
    inverse = unit_lower_inverse(ut)  # [.., T, T]
    solve = lambda rhs: jnp.matmul(inverse, rhs, precision=jax.lax.Precision.HIGHEST)
    return solve(v_beta), solve(k_beta * jnp.exp(cum)[..., None]), intra


def chunked_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over chunks of `chunk` tokens (HF's `torch_chunk_gated_delta_rule`): inside a chunk a
    UT transform turns the sequential delta updates into a unit-lower-triangular inverse and matmuls; a `lax.scan`
    over the static number of chunks carries the state. Same arguments and result as `recurrent_rule` (without keep:
    a token whose beta and g are 0 changes nothing, which is how padding is left out)."""
    B, T, nV, dk = q.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [B, T, nV, ...] -> [B, nV, n, C, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)  # [B, nV, T', ...]
        return x.reshape(B, nV, n, C, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # g, beta: [B, nV, n, C]
    cum = jnp.cumsum(g, axis=-1)  # [B, nV, n, C] log decay from the chunk's start through t
    lower = jnp.tril(jnp.ones((C, C), bool))  # j <= i
    new_v, k_cum, intra = _ut_transform(q, k, v, beta, cum, lower)  # [.., C, dv], [.., C, dk], [.., C, C]
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, nV, n]

    def body(S, xs):  # S [B, nV, dk, dv]
        nv, kc, qd, kd, ia, cd = xs
        v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, S)
        o = jnp.einsum("bhck,bhkv->bhcv", qd, S) + jnp.einsum("bhij,bhjv->bhiv", ia, v_new)
        S = S * cd[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return S, o

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_v, k_cum, q_dec, k_dec, intra, chunk_decay))
    state, o = jax.lax.scan(body, state, xs)  # o [n, B, nV, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, nV, n * C, dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def tree_rule(q, k, v, g, beta, state, mask: jax.Array) -> jax.Array:
    """The gated delta rule along a tree, all nodes at once: node t's output is the one the sequence form gives on
    its own path (root .. t) from `state`. mask [B, T, T] bool: t sees s iff s is t or one of its ancestors, nodes
    parent before child (so the mask is lower triangular).

    `chunked_rule`'s one-chunk form with the chain's order replaced by the tree's: the cumulative log decay runs
    along each node's path (a sum over its ancestors), and the UT transform's pairs are kept only between a node and
    its ancestors. Its triangular inverse then couples a node only to its ancestors, which are exactly the earlier
    tokens of its path, so each node gets its path's sequence result. Same arguments as `recurrent_rule` (plus the
    mask); returns o [B, T, nV, dv]. The state after the accepted path is `commit_path`'s, not this."""
    B, T, nV, dk = q.shape
    chex.assert_shape(mask, (B, T, T))
    q, k, v = (jnp.moveaxis(x, 2, 1) for x in (q, k, v))  # [B, nV, T, d]
    g, beta = jnp.moveaxis(g, 2, 1), jnp.moveaxis(beta, 2, 1)  # [B, nV, T]
    cum = jnp.einsum("bts,bhs->bht", mask.astype(jnp.float32), g)  # log decay from the root through t, on its path
    new_v, k_cum, intra = _ut_transform(q, k, v, beta, cum, mask[:, None])  # [B, nV, T, dv], [.., dk], [.., T]
    v_new = new_v - jnp.einsum("bhck,bhkv->bhcv", k_cum, state)
    o = jnp.einsum("bhck,bhkv->bhcv", q * jnp.exp(cum)[..., None], state) + jnp.einsum("bhij,bhjv->bhiv", intra,
                                                                                      v_new)
    return jnp.moveaxis(o, 1, 2)


def tree_conv(xin: jax.Array, weight: jax.Array, taps: jax.Array) -> jax.Array:
    """`causal_conv` along a tree: xin [B, K-1+T, C] (the window before the root, then the nodes' inputs), taps
    [B, T, K] the indices into xin that node t's K taps read (its inputs up its path, by parent index) -> [B, T, C].
    On a chain (taps[t, j] = t + j) it is `causal_conv`, term for term."""
    B, T, K = taps.shape
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    x = jnp.take_along_axis(xin.astype(jnp.float32), taps.reshape(B, T * K)[..., None], axis=1)
    x = x.reshape(B, T, K, -1)
    out = sum(x[:, :, j, :] * w[None, None, :, j] for j in range(K))
    return jax.nn.silu(out).astype(xin.dtype)


def _inputs(p: GatedDeltaNet, h: jax.Array, conv: jax.Array, cfg: TargetConfig, taps: jax.Array | None = None):
    """Projections, conv and gates of h [B, T, H] after the window conv [B, K-1, C]: (DeltaInputs, z [B, T, nV, dv]).
    taps [B, T, K]: the tokens are the nodes of a tree, each conv reading up its own path (`tree_conv`)."""
    B, T, _ = h.shape
    nK, nV, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    # the four input projections share h: one kernel call on CPU (`linear_many`)
    mixed, b_raw, a, z = linear_many(h, (p.in_proj_qkv, p.in_proj_b, p.in_proj_a, p.in_proj_z))  # [B, T, C], ...
    xin = jnp.concatenate([conv.astype(mixed.dtype), mixed], axis=1)  # [B, K-1+T, C]
    mixed = (causal_conv(xin, p.conv1d) if taps is None else tree_conv(xin, p.conv1d, taps)).astype(jnp.float32)
    # channels grouped by key head (params.linear_qkv_order): [q_h | k_h | v of the nV / nK value heads reading h]
    grouped = mixed.reshape(B, T, nK, 2 * dk + (nV // nK) * dv)
    q = grouped[..., :dk]  # [B, T, nK, dk]
    k = grouped[..., dk:2 * dk]
    v = grouped[..., 2 * dk:].reshape(B, T, nV, dv)  # value head h r + j is group h's j-th, as in HF's order
    q = l2norm(q) * dk ** -0.5
    k = l2norm(k)
    if nV != nK:  # each key head serves nV / nK consecutive value heads
        q, k = (jnp.repeat(x, nV // nK, axis=2) for x in (q, k))
    beta = jax.nn.sigmoid(b_raw.astype(jnp.float32))  # [B, T, nV]
    a = a.astype(jnp.float32)
    g = -jnp.exp(p.A_log.astype(jnp.float32)) * jax.nn.softplus(a + p.dt_bias.astype(jnp.float32))
    z = z.reshape(B, T, nV, dv)
    return DeltaInputs(xin=xin, q=q, k=k, v=v, g=g, beta=beta), z


def _output(p: GatedDeltaNet, o: jax.Array, z: jax.Array, cfg: TargetConfig, dtype) -> jax.Array:
    """`Qwen3_5RMSNormGated(o, z)` then out_proj: o [B, T, nV, dv] float32 -> [B, T, H]."""
    B, T = o.shape[:2]
    o = o.astype(dtype).astype(jnp.float32)  # HF hands the norm the core output in the activation dtype
    y = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    y = p.norm.astype(dtype) * y.astype(dtype)
    y = (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
    return linear(y.reshape(B, T, cfg.linear_value_dim), p.out_proj)


def _window(xin: jax.Array, n: jax.Array, width: int) -> jax.Array:
    """The conv window after the first n[b] new tokens of each row: xin [B, K-1+T, C] -> xin[b, n : n+K-1]."""
    idx = n.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, K-1]
    return jnp.take_along_axis(xin, idx[:, :, None], axis=1)


def deltanet(p: GatedDeltaNet, h: jax.Array, cfg: TargetConfig, conv: jax.Array, state: jax.Array, *,
             keep: jax.Array | None = None, defer: bool = False, chunk: int = CHUNK):
    """One Gated DeltaNet over h [B, T, H] (the layer's normed input) from (conv [B, K-1, C], state [B, nV, dk, dv]).

    keep [B]: the states absorb only each row's first keep[b] tokens (right-padded prompts); None = all T.
    defer=False: returns (out [B, T, H], new conv, new state). T == 1 runs the recurrent form, else the chunked one.
    defer=True (verify): returns (out, DeltaInputs), the states untouched; `commit` applies the kept prefix."""
    B, T, _ = h.shape
    K1 = cfg.linear_conv_kernel_dim - 1
    chex.assert_shape(conv, (B, K1, cfg.linear_conv_dim))
    chex.assert_shape(state, (B, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    d, z = _inputs(p, h, conv, cfg)
    g, beta = _masked(d.g, d.beta, keep)  # a token past keep neither decays nor writes (its output is never read)
    if T == 1:
        o, new_state = recurrent_rule(d.q, d.k, d.v, g, beta, state)
    else:
        o, new_state = chunked_rule(d.q, d.k, d.v, g, beta, state, chunk)
    out = _output(p, o, z, cfg, h.dtype)
    if defer:
        return out, d
    n = jnp.full((B,), T, jnp.int32) if keep is None else keep.astype(jnp.int32)
    return out, _window(d.xin, n, K1), new_state


def deltanet_tree(p: GatedDeltaNet, h: jax.Array, cfg: TargetConfig, conv: jax.Array, state: jax.Array, *,
                  mask: jax.Array, taps: jax.Array) -> tuple[jax.Array, DeltaInputs]:
    """One Gated DeltaNet over the nodes of a draft tree h [B, T, H] (nodes parent before child, node 0 the root),
    every node from its parent's states: the conv reads up each node's path (taps [B, T, K], `tree_conv`) and the
    delta rule runs along it (mask [B, T, T] ancestor-or-self, `tree_rule`). The states stay untouched: returns
    (out [B, T, H], DeltaInputs in node order) for `commit_path` once the accepted path is known."""
    B, T, _ = h.shape
    chex.assert_shape(taps, (B, T, cfg.linear_conv_kernel_dim))
    d, z = _inputs(p, h, conv, cfg, taps=taps)
    o = tree_rule(d.q, d.k, d.v, d.g, d.beta, state, mask)
    return _output(p, o, z, cfg, h.dtype), d


def commit_path(d: DeltaInputs, state: jax.Array, path: jax.Array, n: jax.Array, conv_width: int
                ) -> tuple[jax.Array, jax.Array]:
    """The states after the first n[b] nodes of path [B, P] (node indices, root first) of a tree pass's inputs d
    (`deltanet_tree`): the path's inputs taken in path order make a chain, committed as a verify's are (`commit`)."""
    def take(x):  # [B, T, ...] -> [B, P, ...] along the path
        return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)

    xin = jnp.concatenate([d.xin[:, :conv_width], take(d.xin[:, conv_width:])], axis=1)
    chain = DeltaInputs(xin=xin, q=take(d.q), k=take(d.k), v=take(d.v), g=take(d.g), beta=take(d.beta))
    return commit(chain, state, n, conv_width)


def commit(d: DeltaInputs, state: jax.Array, n: jax.Array, conv_width: int) -> tuple[jax.Array, jax.Array]:
    """The states after the first n[b] tokens of a deferred pass (0 <= n <= T): (conv window, recurrent state).

    The recurrent form runs over the pass's tokens with token t's update kept only where t < n[b], so the result is
    the state a pass over exactly those tokens leaves (up to float rounding between the pass's and a one-token step's
    inputs), for every n at once with static shapes."""
    return _window(d.xin, n, conv_width), recurrent_state(d.k, d.v, d.g, d.beta, state, keep=n)


__all__ = ["DeltaInputs", "CHUNK", "chunked_rule", "recurrent_rule", "recurrent_state", "causal_conv", "commit",
           "commit_path", "deltanet", "deltanet_tree", "empty_states", "l2norm", "tree_conv", "tree_rule"]
