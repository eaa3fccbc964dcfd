"""One draft step inside generate's loop, for either drafter kind: the proposals and the q that verifies them.

DFlash: drafts are the argmax of the draft logits (greedy), or samples from q = their processed softmax (T > 0,
draft_sampling "sample"), kept over the draft vocabulary's ids (`PrefixQ`) for `accept_block`.
DFlash2: drafts are the candidate selector's walk from the block's first token: greedy, or at T > 0 sampled slot by
slot from q_t = softmax(S_t / T) over the k candidates (z-lab draws the selector at temperature T without top-k /
top-p). That q (zero outside the candidates; kept over them) is the draft distribution of rejection sampling: the
proposals are drawn sequentially and each q_t is conditioned on the previous proposal, which is exactly the
accepted prefix whenever slot t is tested, so the rule stays lossless. With p_min, a DFlash2 slot's confidence is the
selector's own top probability (softmax of its scores at T, or at 1 when greedy); z-lab does not define this
interaction.
A draft tree (`draft_tree`) ranks prefixes of the same pass's per-position distributions (`decode.tree`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decode import tree
from dflash_jax.models import selector
from dflash_jax.models.drafter import Drafter, block_hidden, head_logits, pad_vocabulary, propose_from_hidden
from dflash_jax.models.layers import first_argmax
from dflash_jax.decode.sampling import PrefixQ, SamplingParams, _draw, in_cpu_kernel, processed_probs, sample_tokens
from dflash_jax.models.cache import KVCache
from dflash_jax.models.target import Target
from dflash_jax.quant import cpu_kernel


def draft_step(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache, num_slots: int, keys: jax.Array,
               sp: SamplingParams):
    """block [B, bs] (slot 0 = last committed token) over the draft cache -> (drafts [B, D] int32,
    draft logits [B, D, V] f32, draft q or None (a step that never reads q, or whose q is the logits' point mass),
    keys). A sampled DFlash step's q is a `PrefixQ`; DFlash2's the pair (q [B, D, k] f32, candidate ids [B, D, k])
    that `accept_block` takes."""
    D = num_slots
    h = block_hidden(drafter, target, block, cache)[:, 1:1 + D]  # [B, D, H]
    if not drafter.config.is_dflash2:
        drafted = head_logits(drafter, target, h, padded=False)  # [B, D, n]: the draft vocabulary's logits
        logits = pad_vocabulary(drafted, drafter.config.model.vocab_size)  # [B, D, V]
        if sp.greedy or sp.draft_sampling == "greedy":  # the same ids as over the padded row, at a fraction of it
            return first_argmax(drafted), logits, None, keys
        # drawn from, and verified against, q over the n computed ids (zero past them, as over the padded row)
        if in_cpu_kernel(drafted, sp):
            # the CPU loops: q and the drafts in one kernel call (`cpu_kernel.softmax_draw`), the same keys and uniforms
            keys, u = _draw(keys, D)
            q, drafts = cpu_kernel.softmax_draw(drafted, u, sp.temperature)  # [B, D, n], [B, D]
        else:
            q = processed_probs(drafted, sp)  # [B, D, n]
            drafts, keys = sample_tokens(drafted, keys, sp, draft=True, probs=q)
        return drafts, logits, PrefixQ(q, jnp.zeros(drafts.shape, bool)), keys
    B = block.shape[0]
    k = drafter.config.selector_top_k
    sample = not sp.greedy and sp.draft_sampling == "sample"
    uniforms = None
    if sample:
        keys, u = _draw(keys, D * k)
        uniforms = u.reshape(B, D, k)
    prop = propose_from_hidden(drafter, target, h, block[:, 0], temperature=sp.temperature if sample else 0.0,
                               uniforms=uniforms)
    if not (sample or sp.use_p_min):  # greedy, or point-mass drafts, without p_min: q is never read
        return prop.tokens, prop.logits, None, keys
    # q stays over the k candidates ([B, D, k], with their ids): accept_block spreads onto the vocabulary only the
    # one row its residual needs. Greedy runs use it for p_min's confidence only (softmax at T = 1 there).
    q = selector.selector_probs(prop.scores, 1.0 if sp.greedy else sp.temperature)  # [B, D, k]
    return prop.tokens, prop.logits, (q, prop.candidates), keys


def draft_tree(drafter: Drafter, target: Target, block: jax.Array, cache: KVCache, depth: int, budget: int,
               sp: SamplingParams) -> tree.DraftTree:
    """A draft tree step's drafting: one pass over block [B, W] (slot 0 = last committed token, its root) on the
    draft cache, the draft vocabulary's logits of slots 1..depth (ids past it never become nodes, and their padded
    -inf would only cost a log-softmax and a top-k over the whole vocabulary), the `budget` best prefixes."""
    h = block_hidden(drafter, target, block, cache)[:, 1:1 + depth]  # [B, depth, H]
    d_logits = head_logits(drafter, target, h, padded=False)  # [B, depth, n]
    top_lp, top_id = tree.draft_top(d_logits, sp, min(int(budget), d_logits.shape[-1]))  # [B, depth, K]
    return tree.build_from_top(top_lp, top_id, block[:, 0], budget)


__all__ = ["draft_step", "draft_tree"]
