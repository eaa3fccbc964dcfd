"""The KV cache: one entry per layer plus each row's length.

An attention layer's entry holds its keys and values (slot = position); a Gated DeltaNet layer's (hybrid targets)
holds its conv window and recurrent state, and after a verify pass the inputs that pass has not yet committed
(`models.target.commit_states`). `lengths[b]` is how many positions row b holds: attention entries roll back by
arithmetic on it (a slot at or past the length is never read and is overwritten by the next write); DeltaNet entries
cannot, which is why a verify defers them.

Every array is a buffer of its own (k and v never share one), so a program that takes a cache as a donated argument
(generate's loop takes prefill's) updates it in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.frozen import Replaceable
from dflash_jax.models import deltanet as dn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache(Replaceable):
    k: jax.Array  # [B, nKV, S, hd] post-RoPE keys, slot = position (head-major: a head's keys are one stream)
    v: jax.Array  # [B, nKV, S, hd]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetCache(Replaceable):
    conv: jax.Array  # [B, K-1, C] the last K-1 conv inputs
    state: jax.Array  # [B, nV, dk, dv] float32 recurrent state
    deferred: dn.DeltaInputs | None = None  # a verify pass's inputs, not yet in conv / state (`commit_states`)


LayerCache = AttentionCache | DeltaNetCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(Replaceable):
    layers: tuple[LayerCache, ...]  # one entry per layer, by the config's layer types
    lengths: jax.Array  # [B] int32: positions < lengths[b] are valid

    @property
    def max_len(self) -> int:
        """Slots per row (the attention entries' S)."""
        return next(e.k for e in self.layers if isinstance(e, AttentionCache)).shape[2]

    @property
    def has_deferred(self) -> bool:
        """Whether a verify pass left DeltaNet inputs to commit."""
        return any(isinstance(e, DeltaNetCache) and e.deferred is not None for e in self.layers)

    @classmethod
    def empty(cls, cfg: TargetConfig, batch: int, max_len: int) -> "KVCache":
        if not any(cfg.layer_type(i) == "full_attention" for i in range(cfg.num_hidden_layers)):
            raise ValueError("config: a target needs at least one full_attention layer (its KV cache holds the "
                             "positions)")
        return cls(layers=tuple(empty_layer(cfg, i, batch, max_len) for i in range(cfg.num_hidden_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def state_bytes_per_row(self) -> int:
        """Bytes of the DeltaNet states (conv windows and recurrent states) one row holds."""
        leaves = [x for e in self.layers if isinstance(e, DeltaNetCache) for x in (e.conv, e.state)]
        return sum(x.nbytes // x.shape[0] for x in leaves)


def empty_layer(cfg: TargetConfig, i: int, batch: int, max_len: int) -> LayerCache:
    """Layer i's entry of an empty cache of `max_len` slots."""
    if cfg.layer_type(i) == "linear_attention":
        conv, state = dn.empty_states(cfg, batch)
        return DeltaNetCache(conv=conv, state=state)
    shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
    return AttentionCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))


__all__ = ["AttentionCache", "DeltaNetCache", "KVCache", "LayerCache", "empty_layer"]
