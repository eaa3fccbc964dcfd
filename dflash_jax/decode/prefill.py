"""Prefill: right-padded prompts into fresh caches, and what it hands the generation loop.

The prefill program runs prompts [B, Tp] (a prompt bucket) through the target into a fresh cache of the call's cache
bucket, fills the drafter's context cache with every prompt position, and keeps the logits of each row's last prompt
token (the loop samples the first new token from them). Its result (`Prefilled`) is one device-side value that the
loop program takes as a donated argument: no host sync between the two programs, and the caches are not held twice.
"""

from __future__ import annotations

import dataclasses
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dflash_jax.decode import lookup
from dflash_jax.models.cache import KVCache
from dflash_jax.models.drafter import Drafter, append_context, empty_draft_cache
from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.parallel import sharding as shd


def prefill(target: Target, prompt: jax.Array, lens: jax.Array, cache_len: int, *, drafter: Drafter | None = None
            ) -> tuple[jax.Array, jax.Array, KVCache, KVCache | None]:
    """Run right-padded prompts [B, Tp] (row lengths [B]) into fresh caches of cache_len slots.

    Returns (logits at each row's last prompt token [B, V] f32, target features of the drafter's taps [B, Tp, K*H],
    the target cache with lengths = lens, and the drafter's context cache holding every prompt position, or None
    without a drafter). Padded slots stay in memory past each row's length, never visible. Only the kept row of
    each prompt goes through the LM head (not [B, Tp, V]). A row of length 0 is an inert padding row (a batch padded
    to the mesh's data axis): it writes nothing to either cache. On the execution context's mesh the caches are
    pinned to `sharding.cache_sharding`.
    """
    B, _ = prompt.shape
    layer_ids = () if drafter is None else drafter.config.target_layer_ids
    cache = shd.constrain_cache(KVCache.empty(target.config, B, cache_len), target.config)
    # state_keep: a hybrid target's DeltaNet states absorb each row's real prompt only, not its right padding
    logits, feats, cache = forward_with_cache(target, prompt, cache, layer_ids,
                                              logits_at=jnp.maximum(lens - 1, 0)[:, None], empty_cache=True,
                                              state_keep=lens if target.config.is_hybrid else None)
    cache = shd.constrain_cache(cache.replace(lengths=lens), target.config)
    dcache = None
    if drafter is not None:
        dcache = shd.constrain_cache(empty_draft_cache(drafter.config, B, cache_len), drafter.config.model)
        dcache = shd.constrain_cache(append_context(drafter, feats, lens, dcache), drafter.config.model)
    return logits[:, 0], feats, cache, dcache


# The prefill-done stamp: process-wide, not thread-local (the runtime may run host callbacks on its own threads).
STAMPS = {"prefill_done": None}


def _stamp(x):
    STAMPS["prefill_done"] = time.perf_counter()
    return np.zeros((), np.int32)


def _mark_prefill_done(logits: jax.Array) -> jax.Array:
    """Records when prefill finished (one host callback per call, at the end of the prefill program, never in the
    loop); returns 0, which the loop starts its step counter from (so the callback cannot be dropped).

    A program with a host callback never enters JAX's persistent compilation cache: `prefill_timing="rerun"` leaves
    it out (see `generate`); only the prefill program carries it."""
    return io_callback(_stamp, jax.ShapeDtypeStruct((), jnp.int32), logits, ordered=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
    """What prefill hands the loop: one device-side value, donated to the loop program."""

    logits: jax.Array  # [B, V] f32 at each row's last prompt token
    lens: jax.Array  # [B] int32 prompt lengths (0: an inert padding row)
    tcache: KVCache  # the target cache, lengths = lens
    dcache: KVCache | None  # the drafter's context cache (every prompt position), None without a drafter
    step: jax.Array  # [] int32 0 (the prefill stamp's result when timed by callback)
    # [B, W] int32 each row's last W prompt tokens, right-aligned (`decode.lookup.prompt_tail`), for a draft tree's
    # context lookup; None where the loop does not look up
    prompt_tail: jax.Array | None = None


def prefill_program(target: Target, drafter: Drafter | None, prompt, lens, *, cache_len: int, stamp: bool,
                    lookup_window: int = 0) -> Prefilled:
    """What the prefill program traces: prompt [B, Tp] int32 and lens [B] -> the handoff to the loop (stamped when
    prefill is timed by callback; with the prompts' last `lookup_window` tokens for context lookup when > 0)."""
    B, _ = prompt.shape
    chex.assert_shape(lens, (B,))
    logits, _, tcache, dcache = prefill(target, prompt, lens, cache_len, drafter=drafter)
    step = _mark_prefill_done(logits) if stamp else jnp.zeros((), jnp.int32)
    tail = lookup.prompt_tail(prompt, lens, lookup_window) if lookup_window else None
    return Prefilled(logits=logits, lens=lens, tcache=tcache, dcache=dcache, step=step, prompt_tail=tail)


__all__ = ["Prefilled", "STAMPS", "prefill", "prefill_program"]
