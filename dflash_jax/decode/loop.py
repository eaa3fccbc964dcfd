"""The generation loops: speculative (draft -> verify -> accept) and autoregressive, each one `lax.while_loop`.

Layout of one DFlash step for a row whose last committed token `last` sits at position `start`:
  draft   block [last, M, ..., M] at positions start..start+bs-1 -> drafts d_1..d_D (slot k predicts start+k)
  verify  target over [last, d_1..d_D] at positions start..start+D -> post[j] = target token for start+j+1
  accept  a = number of leading j with d_{j+1} == post[j]  (cumprod)   ->  commit post[0..a] (a drafts + bonus)
  roll    target cache length := start+a+1; drafter context += verify features of rows 0..a; start += a+1
Everything of a step is on device inside one `lax.while_loop`; rows that finish are frozen by masks, not removed.
A DFlash2 drafter proposes d_1..d_D with its candidate selector (a `lax.scan` inside the loop body, draft_step.py).
With a draft tree (`tree_budget` N, tree.py) the step drafts the same block, builds a tree of N nodes from its
per-position distributions, verifies root + N nodes in one pass with the target cache read-only, walks the tree with
the target's own token at every node, then writes the accepted path's K/V into consecutive slots and commits its
DeltaNet states (`_tree_step`): the loop state is the chain's, with D = the tree's depth.
Both loops start from prefill's handoff (prefill.py): the first token is sampled from its logits, then the loop runs
until every row is done or the step budget is spent (`_run`, the one condition of both).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from dflash_jax import execution
from dflash_jax.decode import lookup, tree
from dflash_jax.decode.buckets import PAD
from dflash_jax.decode.draft_step import draft_step, draft_tree
from dflash_jax.decode.prefill import Prefilled
from dflash_jax.decode.sampling import PrefixQ, SamplingParams, accept_block, sample_tokens
from dflash_jax.frozen import Replaceable
from dflash_jax.models.cache import KVCache
from dflash_jax.models.drafter import Drafter, append_context, draft_block
from dflash_jax.models.target import (Target, TreeLayout, commit_states, commit_tree, forward_tree,
                                      forward_with_cache)
from dflash_jax.parallel import sharding as shd


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState(Replaceable):
    step: jax.Array  # [] int32
    out: jax.Array  # [B, N + W] int32 output buffer (N = budget bucket, W = tokens one step can commit), PAD-filled
    n_out: jax.Array  # [B] int32 tokens emitted so far
    done: jax.Array  # [B] bool
    last: jax.Array  # [B] int32 last committed token, not yet run through the target
    start: jax.Array  # [B] int32 position of `last` == target cache length
    tcache: KVCache
    dcache: KVCache | None  # the drafter's context cache
    pending: jax.Array | None  # [B, W, K*H] target features not yet in the draft cache
    n_pending: jax.Array | None  # [B] int32 valid rows of `pending`
    acc: jax.Array  # [B, steps bucket] int32 committed tokens per step (incl. bonus)
    key: jax.Array  # PRNG key data [B, 2] uint32 (one stream per row)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Budget(Replaceable):
    """What ends a row or the loop: traced, so changing them never recompiles."""

    max_new: jax.Array  # [] int32 tokens to emit per row (<= the output buffer's bucket)
    max_steps: jax.Array  # [] int32 loop iterations allowed (0: prefill only)
    eos: jax.Array  # [E] int32 EOS ids, padded with -1 (never a token)


def _commit(state: LoopState, new_tokens: jax.Array, n_new: jax.Array, budget: Budget
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append the first n_new[b] of new_tokens [B, W] to each active row, cut at EOS and at the budget.

    Returns (out, n_out, done). Nothing after the first EOS is emitted; EOS itself is.
    """
    B, W = new_tokens.shape
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    n = jnp.where(state.done, 0, n_new)
    n = jnp.minimum(n, budget.max_new - state.n_out)  # a block may overshoot the budget: cut inside it
    is_eos = (new_tokens[:, :, None] == budget.eos[None, None, :]).any(axis=-1) & (j < n[:, None])
    hit = is_eos.any(axis=1)
    n = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, n)
    cols = jnp.where(j < n[:, None], state.n_out[:, None] + j, state.out.shape[1])  # out of range -> dropped
    out = state.out.at[jnp.arange(B)[:, None], cols].set(new_tokens, mode="drop")
    n_out = state.n_out + n
    done = state.done | hit | (n_out >= budget.max_new)
    return out, n_out, done


def _init_state(pre: Prefilled, keys, sampling: SamplingParams, budget: Budget, out_len: int, width: int,
                pending=None, n_pending=None) -> LoopState:
    """The first token (sampled from prefill's logits) committed into a fresh loop state."""
    first, keys = sample_tokens(pre.logits, keys, sampling)
    B = first.shape[0]
    # Rows of prompt length 0 are padding (batch bucket, mesh's data axis): done from the start, never emit a token.
    state = LoopState(step=pre.step, out=jnp.full((B, out_len + width), PAD, jnp.int32),
                      n_out=jnp.zeros((B,), jnp.int32), done=pre.lens == 0, last=first,
                      start=pre.lens, tcache=pre.tcache, dcache=pre.dcache, pending=pending, n_pending=n_pending,
                      acc=jnp.zeros((B, max(out_len - 1, 1)), jnp.int32), key=keys)
    out, n_out, done = _commit(state, first[:, None], jnp.ones((B,), jnp.int32), budget)
    return state.replace(out=out, n_out=n_out, done=done)


def _run(body, state: LoopState, budget: Budget):
    """The while loop of both generators, until every row is done or the step budget is spent.

    Returns (out, n_out, acc, steps, caches): the caches come back only so that XLA can alias them to the donated
    prefill handoff (the while loop then updates the prefill's cache in place instead of a copy); callers drop them."""
    def cond(s: LoopState):
        return (s.step < budget.max_steps) & ~jnp.all(s.done)

    final = jax.lax.while_loop(cond, body, state)
    res = final.out, final.n_out, final.acc, final.step
    mesh = execution.current().mesh
    if mesh is not None:  # replicated, so that every process can read the whole result
        res = jax.lax.with_sharding_constraint(res, shd.replicated(mesh))
    return (*res, (final.tcache, final.dcache))


def _tree_step(target: Target, drafter: Drafter, s: LoopState, sampling: SamplingParams, depth: int,
               budget_nodes: int, context_lookup: int = 0, prompt_tail: jax.Array | None = None):
    """One draft-tree step on the loop state: (committed tokens [B, D + 1], n_acc [B], target cache with the
    accepted path committed (lengths advanced only for active rows), pending features [B, D + 1, K*H], draft cache,
    keys). D = depth, N = budget_nodes; T = 1 + N verified nodes. context_lookup > 0: rows whose output ends in a
    repeat of at least that many tokens (in prompt_tail [B, W], then the output) take the continuation of its last
    occurrence as their tree (`lookup`)."""
    tcfg, dcfg = target.config, drafter.config
    B, D, N = s.last.shape[0], depth, budget_nodes
    dcache = append_context(drafter, s.pending, s.n_pending, s.dcache)
    block = draft_block(drafter, s.last, D)  # [B, W]: W = bs, or D + 1 (`draft_pass`)
    tr = draft_tree(drafter, target, block, dcache, D, N, sampling)  # one draft pass, as the chain's
    if context_lookup:
        tr, _ = lookup.prefer_context(tr, s.out, s.n_out, D, context_lookup, prompt_tail)
    kernel = tcfg.linear_conv_kernel_dim if tcfg.is_hybrid else 1
    anc = tree.ancestors(tr, max(D, kernel - 1))  # [B, 1 + N, >= D + 1]
    layout = TreeLayout(positions=tree.positions(tr, s.start), mask=tree.ancestor_mask(anc[..., :D + 1]),
                        conv_taps=tree.conv_taps(tr, anc, kernel) if tcfg.is_hybrid else None)
    v_logits, v_feats, pending = forward_tree(target, tree.verify_tokens(tr), s.tcache, dcfg.target_layer_ids,
                                              layout)
    # The target's own token at every node, under its own rule (argmax, or one draw per node from the row's key)
    own, keys = sample_tokens(v_logits, s.key, sampling)  # [B, 1 + N]
    path, n_acc = tree.walk(tr, anc[..., :D + 1], own)  # [B, D + 1], [B]
    committed = jnp.take_along_axis(own, path, axis=1)  # the path's target tokens: n_acc drafts, then the bonus
    tcache = commit_tree(s.tcache, pending, path, jnp.where(s.done, 0, n_acc + 1), tcfg)
    feats = jnp.take_along_axis(v_feats, path[:, :, None], axis=1)  # the accepted path's features, for the drafter
    chex.assert_shape(committed, (B, D + 1))
    return committed, n_acc, tcache, feats, dcache, keys


def speculative_loop(target: Target, drafter: Drafter, pre: Prefilled, keys, sampling: SamplingParams,
                     budget: Budget, *, draft_length: int, out_len: int, tree_budget: int | None = None,
                     context_lookup: int = 0):
    """The speculative loop program over prefill's handoff `pre`: (out, n_out, acc, steps, caches) (see `_run`).
    tree_budget: draft trees of that many nodes (draft_length is then the trees' depth); None: chains.
    context_lookup: the shortest repeat a step copies its continuation from (0: never): a tree's nodes, or a chain's
    first drafts (`_copied_drafts`)."""
    if tree_budget is not None:
        return _tree_loop(target, drafter, pre, keys, sampling, budget, depth=draft_length, out_len=out_len,
                          budget_nodes=tree_budget, context_lookup=context_lookup)
    dcfg = drafter.config
    layer_ids = dcfg.target_layer_ids
    D = draft_length
    B = pre.lens.shape[0]
    feat_dim = len(layer_ids) * target.config.hidden_size
    pending = jnp.zeros((B, D + 1, feat_dim), target.config.dtype)  # the dtype of the target's features
    state = _init_state(pre, keys, sampling, budget, out_len, D + 1, pending=pending,
                        n_pending=jnp.zeros((B,), jnp.int32))

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        dcache = append_context(drafter, s.pending, s.n_pending, s.dcache)
        block = draft_block(drafter, s.last, D)  # [B, W]: W = bs, or D + 1 (`draft_pass`)
        # drafts [B, D]; d_logits [B, D, V]; d_probs: the q a sampled step verifies against (a DFlash `PrefixQ` or
        # the DFlash2 selector's pair; None where acceptance never reads it)
        drafts, d_logits, d_probs, keys = draft_step(drafter, target, block, dcache, D, s.key, sampling)
        if context_lookup:
            drafts, d_logits, d_probs = _copied_drafts(drafts, d_logits, d_probs, s, context_lookup,
                                                       pre.prompt_tail, sampling)
        verify_in = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B, D+1]
        # A hybrid target's DeltaNet states are deferred: they absorb each row's accepted prefix below
        v_logits, v_feats, tcache = forward_with_cache(target, verify_in, s.tcache, layer_ids,
                                                       defer_states=target.config.is_hybrid)
        q_kw = {} if d_probs is None else {"draft_probs": d_probs}
        n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling, **q_kw)  # [B], [B, D+1]
        # rollback of recurrent states: `last` and the accepted drafts (a + 1 tokens) per active row, none otherwise
        tcache = commit_states(tcache, jnp.where(active, n_acc + 1, 0), target.config)
        chex.assert_shape(committed, (B, D + 1))
        out, n_out, done = _commit(s, committed, n_acc + 1, budget)
        new_start = jnp.where(active, s.start + n_acc + 1, s.start)
        bonus = jnp.take_along_axis(committed, n_acc[:, None], axis=1)[:, 0]
        return s.replace(
            step=s.step + 1, out=out, n_out=n_out, done=done,
            last=jnp.where(active, bonus, s.last), start=new_start,
            # rollback: drop rejected slots by length
            tcache=shd.constrain_cache(tcache.replace(lengths=new_start), target.config),
            dcache=shd.constrain_cache(dcache, dcfg.model), pending=v_feats,
            n_pending=jnp.where(active, n_acc + 1, 0),
            acc=s.acc.at[:, s.step].set(jnp.where(active, n_acc + 1, 0)), key=keys)

    return _run(body, state, budget)


def _copied_drafts(drafts: jax.Array, d_logits: jax.Array, d_probs: PrefixQ | None, s: LoopState, min_match: int,
                   prompt_tail: jax.Array, sampling: SamplingParams):
    """A chain step's (drafts [B, D], d_logits, d_probs) with, on rows whose text ends in a repeat of >= min_match
    tokens, the first n drafts replaced by the continuation of its last occurrence (`lookup.continuation`) and those
    slots' q made the point mass at the copied token (sampled drafts: `PrefixQ.copied`; otherwise the draft logits
    [B, D, V] one-hot there, which p_min's confidence reads): the copy is a proposal drawn from that point mass, so
    rejection sampling accepts it with probability p(token) and corrects from p with the token removed, which keeps
    the target's law (greedy: token for token). A slot past the copy keeps the drafter's proposal and its q (a
    DFlash slot's q does not depend on the slots before it)."""
    B, D = drafts.shape
    tokens, n = lookup.continuation(s.out, s.n_out, D, min_match, prompt_tail)  # [B, D], [B]
    copied = jnp.arange(D, dtype=jnp.int32)[None, :] < n[:, None]  # [B, D]
    drafts = jnp.where(copied, tokens, drafts)
    if isinstance(d_probs, PrefixQ):
        d_probs = PrefixQ(d_probs.probs, d_probs.copied | copied)
    elif not sampling.greedy:  # greedy acceptance never reads q
        ids = jnp.arange(d_logits.shape[-1], dtype=jnp.int32)
        one_hot = jnp.where(ids[None, None, :] == tokens[..., None], 0.0, -jnp.inf).astype(d_logits.dtype)
        d_logits = jnp.where(copied[..., None], one_hot, d_logits)
    return drafts, d_logits, d_probs


def _tree_loop(target: Target, drafter: Drafter, pre: Prefilled, keys, sampling: SamplingParams, budget: Budget, *,
               depth: int, out_len: int, budget_nodes: int, context_lookup: int = 0):
    """`speculative_loop` with draft trees of `budget_nodes` nodes, at most `depth` deep."""
    B, D = pre.lens.shape[0], depth
    feat_dim = len(drafter.config.target_layer_ids) * target.config.hidden_size
    state = _init_state(pre, keys, sampling, budget, out_len, D + 1,
                        pending=jnp.zeros((B, D + 1, feat_dim), target.config.dtype),
                        n_pending=jnp.zeros((B,), jnp.int32))

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        committed, n_acc, tcache, feats, dcache, keys = _tree_step(target, drafter, s, sampling, D, budget_nodes,
                                                                   context_lookup, pre.prompt_tail)
        out, n_out, done = _commit(s, committed, n_acc + 1, budget)
        bonus = jnp.take_along_axis(committed, n_acc[:, None], axis=1)[:, 0]
        return s.replace(
            step=s.step + 1, out=out, n_out=n_out, done=done, last=jnp.where(active, bonus, s.last),
            start=tcache.lengths, tcache=shd.constrain_cache(tcache, target.config),
            dcache=shd.constrain_cache(dcache, drafter.config.model), pending=feats,
            n_pending=jnp.where(active, n_acc + 1, 0),
            acc=s.acc.at[:, s.step].set(jnp.where(active, n_acc + 1, 0)), key=keys)

    return _run(body, state, budget)


def autoregressive_loop(target: Target, drafter: None, pre: Prefilled, keys, sampling: SamplingParams,
                        budget: Budget, *, out_len: int):
    """The autoregressive loop program (one token per step; `drafter` is None): as `speculative_loop`."""
    B = pre.lens.shape[0]
    state = _init_state(pre, keys, sampling, budget, out_len, 1)

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        logits, _, tcache = forward_with_cache(target, s.last[:, None], s.tcache)
        nxt, keys = sample_tokens(logits[:, 0], s.key, sampling)
        out, n_out, done = _commit(s, nxt[:, None], jnp.ones((B,), jnp.int32), budget)
        new_start = jnp.where(active, s.start + 1, s.start)
        return s.replace(step=s.step + 1, out=out, n_out=n_out, done=done, last=jnp.where(active, nxt, s.last),
                         start=new_start, tcache=shd.constrain_cache(tcache.replace(lengths=new_start), target.config),
                         acc=s.acc.at[:, s.step].set(active.astype(jnp.int32)), key=keys)

    return _run(body, state, budget)


__all__ = ["Budget", "LoopState", "autoregressive_loop", "speculative_loop"]
