"""The DFlash drafter: KV injection of target features, and one non-causal pass over a block of mask tokens.

Per layer, the fused context `ctx = hidden_norm(fc(concat of target layer outputs))` is projected with the layer's own
`k_proj`/`k_norm`/`v_proj` (RoPE at the context tokens' absolute positions) into keys/values that sit in front of the
block's own keys/values. Context K/V are cached (post-RoPE) with per-row lengths; the block's K/V are scratch and are
never written, so the cache only ever holds committed positions (< block start).

DFlash2 drafters (config.kind == "dflash2") run the same pass with a grouped dynamic convolution around every
attention and MLP sublayer (block_conv.py), and propose tokens with the candidate selector (selector.py) instead of
the argmax of the draft logits. Layers may be causal and/or sliding-window (the rule is applied by attention.py), for
both kinds. A drafter layer is the decoder layer of layers.py (DFlash2's convolution goes in through its sublayer
hook).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import chex
import jax
import jax.numpy as jnp

from dflash_jax.models import block_conv, selector
from dflash_jax import execution
from dflash_jax.config import DrafterConfig, check_pair
from dflash_jax.frozen import Replaceable
from dflash_jax.models.layers import decoder_layer, first_argmax, norm, project_kv, write_kv_run
from dflash_jax.quant.linear import embedding_rows, linear, program_backend
from dflash_jax.params import (DFlash2Params, DrafterParams, abstract_drafter, committed, init_from_abstract,
                               static_field)
from dflash_jax.models.cache import AttentionCache, KVCache
from dflash_jax.models.target import Target


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafter(Replaceable):
    params: DrafterParams | DFlash2Params  # DFlash2Params when config.kind == "dflash2"
    config: DrafterConfig = static_field()


def empty_draft_cache(cfg: DrafterConfig, batch: int, max_len: int) -> KVCache:
    """An empty drafter context cache: a `KVCache` (per layer an `AttentionCache` of [B, nKV, S, hd] keys after
    k_norm + RoPE, and values; lengths [B] = committed context positions held) shaped by the drafter's own model
    config."""
    return KVCache.empty(cfg.model, batch, max_len)


def init_drafter(cfg: DrafterConfig, key: jax.Array) -> Drafter:
    return Drafter(params=init_from_abstract(abstract_drafter(cfg), key, cfg.model.storage_dtype), config=cfg)


def fuse_context(drafter: Drafter, features: jax.Array) -> jax.Array:
    """[B, C, K*H] target features -> [B, C, H] context, computed once and shared by every layer."""
    cfg = drafter.config.model
    return norm(linear(features.astype(cfg.dtype), drafter.params.fc), drafter.params.hidden_norm, cfg)


def _context_rows(drafter: Drafter, features: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per drafter layer, the context keys (k_norm + RoPE at `positions` [B, C]) and values [B, C, nKV, hd] of target
    features [B, C, K*H]: what every block query sees of the context."""
    cfg = drafter.config.model
    ctx = fuse_context(drafter, features)
    return [project_kv(layer.self_attn, ctx, positions, cfg) for layer in drafter.params.layers]


def context_kv(drafter: Drafter, features: jax.Array, positions: jax.Array) -> tuple[AttentionCache, ...]:
    """`_context_rows` as cache entries (head-major, [B, nKV, C, hd]): what training attends directly (slot =
    position: C covers positions 0..C-1); inference appends the rows to its cache instead (`append_context`)."""
    return tuple(AttentionCache(k=k.transpose(0, 2, 1, 3), v=v.transpose(0, 2, 1, 3))
                 for k, v in _context_rows(drafter, features, positions))


def append_context(drafter: Drafter, features: jax.Array, n_valid: jax.Array, cache: KVCache) -> KVCache:
    """Append the first n_valid[b] of features [B, C, K*H] to each row's context K/V (a static-width slab)."""
    cfg = drafter.config.model
    B, C, _ = features.shape
    chex.assert_shape(features, (B, C, drafter.config.num_taps * cfg.hidden_size))
    positions = cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]  # [B, C]
    n = n_valid.astype(jnp.int32)  # a row's slots past its valid count are not written
    layers = tuple(AttentionCache(k=write_kv_run(old.k, k, cache.lengths, n),
                                  v=write_kv_run(old.v, v, cache.lengths, n))
                   for old, (k, v) in zip(cache.layers, _context_rows(drafter, features, positions)))
    return KVCache(layers=layers, lengths=cache.lengths + n_valid.astype(jnp.int32))


def block_pass(drafter: Drafter, x: jax.Array, positions: jax.Array, context: Sequence[AttentionCache],
               ctx_len: jax.Array, *, mask: jax.Array | None = None, chunk: int | None = None,
               block_len: int | None = None) -> jax.Array:
    """The drafter layer stack over block queries x [B, Q, H] at positions [B, Q]: Q / block_len whole blocks
    (default block_len = block_size); DFlash2's convolution never crosses from one block into the next.

    context: per layer the context keys/values [B, nKV, S, hd], slot = position, valid below ctx_len ([B] per row,
    or [B, Q] per query); mask [B, Q, Q]: which block keys each query sees (None: the whole block). Each layer's
    causality and sliding window come from the config (`layer_attention`, z-lab's rule) and are applied by
    `attention` to context and block keys alike, by absolute position. Inference (one block, cache) and training
    (many blocks per sequence, one mask) both call this, so what is trained is exactly what runs. Returns the
    final-normed hidden states [B, Q, H].
    """
    dcfg = drafter.config
    cfg = dcfg.model
    conv = dict(kernel_size=dcfg.conv_kernel_size, group_size=dcfg.conv_group_size,
                block_len=dcfg.block_size if block_len is None else block_len)
    for i, (layer, ctx) in enumerate(zip(drafter.params.layers, context)):
        causal, window = dcfg.layer_attention(i)
        # DFlash2 wraps both sublayers of the decoder layer in its convolution; the block's own K/V are scratch
        hook = block_conv.sublayer_hook(getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None),
                                        **conv)
        with jax.named_scope(f"draft_layer{i}"):
            x, _, _ = decoder_layer(layer, x, positions, cfg, cache_k=ctx.k, cache_v=ctx.v, cache_len=ctx_len,
                                    mask=mask, causal=causal, window=window, chunk=chunk, hook=hook)
    return norm(x, drafter.params.norm, cfg)


def embed_block(drafter: Drafter, target: Target, block: jax.Array) -> jax.Array:
    """Block tokens are embedded with the target's (frozen) embedding table, times input_embedding_scale."""
    x = embedding_rows(target.params.embed_tokens, block, drafter.config.model.dtype)
    scale = drafter.config.input_embedding_scale
    return x if scale == 1.0 else x * jnp.asarray(scale, x.dtype)


def pad_vocabulary(logits: jax.Array, vocab_size: int) -> jax.Array:
    """Logits over a draft vocabulary's first n ids [.., n] -> [.., vocab_size], -inf past n (impossible drafts)."""
    if logits.shape[-1] == vocab_size:
        return logits
    return jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, vocab_size - logits.shape[-1])],
                   constant_values=-jnp.inf)


def head_logits(drafter: Drafter, target: Target, h: jax.Array, *, full_vocabulary: bool = False,
                padded: bool = True) -> jax.Array:
    """Draft logits [.., V] f32 of final hidden states h [.., H]: the target's lm_head, times output_multiplier,
    then cap * tanh(logits / cap) when final_logit_softcapping is set (z-lab `compute_logits`).

    With a draft vocabulary (config.draft_vocab_size = n) only the head's first n rows are computed and ids >= n get
    -inf: argmax, sampling and rejection sampling then treat them as impossible drafts (probability 0) with no other
    change. full_vocabulary: all V logits regardless (training, whose loss vocabulary is its own choice).
    padded=False: only the n computed logits [.., n] (`pad_vocabulary` makes them [.., V]); an argmax or a top-k of
    them is the same ids as of the padded row, without writing and reading V - n entries of -inf per position."""
    dcfg = drafter.config
    V = dcfg.model.vocab_size
    n = None if full_vocabulary else dcfg.draft_vocab_size
    head = target.lm_head
    logits = linear(h, head, out_rows=n).astype(jnp.float32)  # [.., n or V]
    if dcfg.output_multiplier != 1.0:
        logits = logits * dcfg.output_multiplier
    if dcfg.final_logit_softcapping is not None:
        cap = dcfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return pad_vocabulary(logits, V) if padded else logits  # [.., V] or [.., n]


def draft_block(drafter: Drafter, last: jax.Array, num_slots: int) -> jax.Array:
    """The block a draft step passes [B, W]: the last committed token [B], then mask tokens; slots 1..num_slots
    are the drafted ones. W by the config's `draft_pass`: block_size ("block", and None: z-lab's loop), or
    num_slots + 1 ("drafted": the slots past the drafted ones propose nothing, and each costs a row of every drafter
    layer). Which one a pair runs is measured, not assumed (`DrafterConfig.draft_pass`): on the default pair the
    drafted slots alone kept held-out tau (1.4588 -> 1.4564 at D 1) and cut c at D 1 by a third; the code-5m drafter
    (block 16) lost 3% of its tau at D 7 without the block's trailing mask keys (docs/cpu-step.md, "Draft pass: the
    whole block or the drafted slots only")."""
    cfg = drafter.config
    width = min(int(num_slots) + 1, cfg.block_size) if cfg.draft_pass == "drafted" else cfg.block_size
    return jnp.full((last.shape[0], width), cfg.mask_token_id, jnp.int32).at[:, 0].set(last)


def block_hidden(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache) -> jax.Array:
    """One pass over block [B, bs] at positions lengths..lengths+bs-1 -> final hidden [B, bs, H].

    Every block slot sees all committed context (cache slots below the row's length) and the whole block, narrowed
    by the layers' causal / sliding-window rules."""
    B, bs = block.shape
    positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]  # [B, bs]
    return block_pass(drafter, embed_block(drafter, target, block), positions, cache.layers, cache.lengths,
                      block_len=bs)


def block_logits(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache,
                 num_slots: int | None = None) -> jax.Array:
    """Logits [B, num_slots, V] f32 for block slots 1..num_slots (slot k predicts position start+k itself)."""
    num_slots = block.shape[1] - 1 if num_slots is None else num_slots
    h = block_hidden(drafter, target, block, cache)[:, 1:1 + num_slots]
    return head_logits(drafter, target, h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
    """What one draft step proposes for slots 1..D."""

    tokens: jax.Array  # [B, D] int32
    logits: jax.Array  # [B, D, V] f32 base draft logits (DFlash2: before the selector)
    scores: jax.Array | None = None  # DFlash2: [B, D, k] selector scores along the chosen path
    candidates: jax.Array | None = None  # DFlash2: [B, D, k] candidate ids


def propose_from_hidden(drafter: Drafter, target: Target, h: jax.Array, anchor: jax.Array, *, temperature=0.0,
                        uniforms: jax.Array | None = None) -> Proposal:
    """Proposals from the final hidden states h [B, D, H] of slots 1..D; anchor [B] = the block's first token.

    DFlash: the argmax of the draft logits (callers that sample draw from `logits` themselves). DFlash2: the
    selector walk from the anchor, greedy, or sampled at temperature > 0 from uniforms [B, D, k].
    """
    logits = head_logits(drafter, target, h)
    if not drafter.config.is_dflash2:
        return Proposal(tokens=first_argmax(logits), logits=logits)
    tokens, cand, scores = selector.select(drafter.params.candidate_selector, h, logits, anchor,
                                           drafter.config.selector_top_k, temperature=temperature, uniforms=uniforms)
    return Proposal(tokens=tokens, logits=logits, scores=scores, candidates=cand)


def _check_inputs(drafter: Drafter, target: Target, features, block):
    check_pair(drafter.config, target.config)
    features, block = jnp.asarray(features), jnp.asarray(block)
    B = features.shape[0] if features.ndim else 0
    if block.ndim != 2 or block.shape[0] != B:
        raise ValueError(f"block must be [B={B}, bs], got {list(block.shape)}")
    want = drafter.config.num_taps * drafter.config.model.hidden_size
    if features.ndim != 3 or features.shape[-1] != want:
        raise ValueError(f"features must be [B, C, {want}] (len(target_layer_ids) * hidden), got "
                         f"{list(features.shape)}")
    return features, block


def _target_first(target, drafter, call: str) -> tuple[Target, Drafter]:
    """The public calls take (target, drafter, ...), like `generate`. The old order (drafter first) still works, with a
    DeprecationWarning; the two are told apart by type, so a wrong pair fails here by name, not deep in a trace."""
    if isinstance(target, Drafter) and isinstance(drafter, Target):
        warnings.warn(f"{call}(drafter, target, ...) is deprecated: pass the target first, "
                      f"{call}(target, drafter, ...)", DeprecationWarning, stacklevel=3)
        target, drafter = drafter, target
    if not isinstance(target, Target) or not isinstance(drafter, Drafter):
        raise TypeError(f"{call}(target, drafter, ...) takes a Target and a Drafter, got "
                        f"{type(target).__name__} and {type(drafter).__name__}")
    return target, drafter


def draft_logits(target: Target, drafter: Drafter, features, block, *,
                 nvfp4_backend: str | None = None) -> jax.Array:
    """Public call (no cache): logits [B, W-1, V] for block slots 1..W-1 (after output_multiplier and
    final_logit_softcapping; for DFlash2 these are the base logits the selector starts from).

    features [B, C, K*H]: target layer outputs of context positions 0..C-1; block [B, W] at positions C..C+W-1
    (generate passes the block `draft_block` builds: the whole block, W = bs, as z-lab's loop, or D + 1 slots).
    nvfp4_backend: for NVFP4 weights (see `dflash_jax.quant.linear`); None = the current default, resolved per call.
    """
    target, drafter = _target_first(target, drafter, "draft_logits")
    return _proposal(target, drafter, features, block, nvfp4_backend).logits


def draft_tokens(target: Target, drafter: Drafter, features, block, *,
                 nvfp4_backend: str | None = None) -> jax.Array:
    """Public call (no cache): the greedy proposals [B, bs-1] int32 for block slots 1..bs-1, either kind.

    DFlash: argmax of `draft_logits`. DFlash2: the candidate selector's greedy walk from block[:, 0].
    """
    target, drafter = _target_first(target, drafter, "draft_tokens")
    return _proposal(target, drafter, features, block, nvfp4_backend).tokens


def draft_proposal(target: Target, drafter: Drafter, features, block, *,
                   nvfp4_backend: str | None = None) -> Proposal:
    """`draft_tokens` with its logits and (DFlash2) selector scores and candidates, e.g. for `audit_scales`."""
    target, drafter = _target_first(target, drafter, "draft_proposal")
    return _proposal(target, drafter, features, block, nvfp4_backend)


def as_compiled(drafter: Drafter) -> Drafter:
    """The drafter as compiled programs take it, so that equal drafters compile once whatever way they were built.

    * Its model config's `tie_word_embeddings` describes the target it borrows the embedding and head from; the
      drafter has neither and no program reads the field, but it is part of the static config a program is compiled
      for: a GGUF drafter file does not record it, and the shipped drafter read back from one compiled every program
      again. One value (False) for drafters.
    * Every array committed to its device (`params.committed`): the same drafter quantized in memory and read back
      from a file compiled separately too."""
    if drafter.config.model.tie_word_embeddings:
        drafter = drafter.replace(config=drafter.config.replace(
            model=drafter.config.model.replace(tie_word_embeddings=False)))
    return committed(drafter)


def _proposal(target: Target, drafter: Drafter, features, block, nvfp4_backend: str | None) -> Proposal:
    features, block = _check_inputs(drafter, target, features, block)
    # the program runs (and is keyed) under the backend resolved now, on the host
    with execution.changed(nvfp4_backend=program_backend(drafter, target, backend=nvfp4_backend)):
        return _draft_jit(as_compiled(drafter), committed(target), features, block)


def cached_context(drafter: Drafter, features: jax.Array) -> KVCache:
    """A draft cache holding all C context positions of features [B, C, K*H]."""
    B, C = features.shape[:2]
    cache = empty_draft_cache(drafter.config, B, C)
    return append_context(drafter, features, jnp.full((B,), C, jnp.int32), cache)


@jax.jit
def _draft_jit(drafter, target, features, block):
    cache = cached_context(drafter, features)
    h = block_hidden(drafter, target, block, cache)[:, 1:]
    return propose_from_hidden(drafter, target, h, block[:, 0])
