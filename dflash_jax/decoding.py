"""Speculative generation (draft -> verify -> accept) and the autoregressive baseline, each ONE compiled program.

Layout of one DFlash step for a row whose last committed token `last` sits at position `start`:
  draft   block [last, M, ..., M] at positions start..start+bs-1 -> drafts d_1..d_D (slot k predicts start+k)
  verify  target over [last, d_1..d_D] at positions start..start+D -> post[j] = target token for start+j+1
  accept  a = number of leading j with d_{j+1} == post[j]  (cumprod)   ->  commit post[0..a] (a drafts + bonus)
  roll    target cache length := start+a+1; drafter context += verify features of rows 0..a; start += a+1
Everything is on device inside one `lax.while_loop`; rows that finish are frozen by masks, not removed.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dflash_jax.config import check_pair
from dflash_jax.drafter import Drafter, DraftCache, append_context, block_logits
from dflash_jax.sampling import SamplingParams, accept_block, sample_tokens
from dflash_jax.target import KVCache, Target, forward_with_cache

PAD = -1


# -- results -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] new tokens, -1 after each row's end
    num_tokens: np.ndarray  # [B] tokens generated per row
    acceptance_lengths: np.ndarray  # [B, steps] tokens committed per step incl. the bonus; 0 after a row's end
    finish_reason: tuple[str, ...]  # per row: "eos" | "length"
    num_steps: int  # loop iterations (draft+verify steps, or decode steps)
    draft_length: int  # drafted tokens per step (0 for autoregressive)
    timings: dict  # seconds: prefill_s, decode_s, total_s, compile_s

    @property
    def tau(self) -> float:
        """Mean committed tokens per step, including the bonus token (1 for autoregressive decoding)."""
        steps = self.acceptance_lengths[self.acceptance_lengths > 0]
        return float(steps.mean()) if steps.size else float("nan")

    @property
    def tau_per_row(self) -> np.ndarray:
        acc = self.acceptance_lengths
        n = np.maximum((acc > 0).sum(axis=1), 1)
        return acc.sum(axis=1) / n

    @property
    def tau_histogram(self) -> np.ndarray:
        """[draft_length + 2] counts of steps by committed tokens (index = tau of the step; index 0 unused)."""
        acc = self.acceptance_lengths[self.acceptance_lengths > 0]
        return np.bincount(acc, minlength=self.draft_length + 2)

    @property
    def position_acceptance(self) -> np.ndarray:
        """[draft_length] fraction of steps in which draft position k (1-based index k-1) was accepted."""
        acc = self.acceptance_lengths[self.acceptance_lengths > 0]
        if acc.size == 0 or self.draft_length == 0:
            return np.zeros((self.draft_length,))
        return np.array([(acc - 1 >= k).mean() for k in range(1, self.draft_length + 1)])

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (excludes the bonus)."""
        acc = self.acceptance_lengths[self.acceptance_lengths > 0]
        if acc.size == 0 or self.draft_length == 0:
            return float("nan")
        return float((acc - 1).sum() / (acc.size * self.draft_length))

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which prefill produces) per second of decode loop."""
        n = float(np.maximum(self.num_tokens - 1, 0).sum())
        return n / self.timings["decode_s"] if self.timings["decode_s"] > 0 else float("nan")

    @property
    def tokens_per_second(self) -> float:
        """All generated tokens per second, prefill included."""
        return float(self.num_tokens.sum()) / self.timings["total_s"]

    def token_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.num_tokens)]


# -- loop state --------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    step: jax.Array  # [] int32
    out: jax.Array  # [B, N + W] int32 output buffer (W = tokens one step can commit), PAD-filled
    n_out: jax.Array  # [B] int32 tokens emitted so far
    done: jax.Array  # [B] bool
    last: jax.Array  # [B] int32 last committed token, not yet run through the target
    start: jax.Array  # [B] int32 position of `last` == target cache length
    tcache: KVCache
    dcache: KVCache | None  # the drafter's context cache
    pending: jax.Array | None  # [B, W, K*H] target features not yet in the draft cache
    n_pending: jax.Array | None  # [B] int32 valid rows of `pending`
    acc: jax.Array  # [B, max_steps] int32 committed tokens per step (incl. bonus)
    key: jax.Array  # PRNG key data [B, 2] uint32 (one stream per row)

    def replace(self, **changes) -> "LoopState":
        return dataclasses.replace(self, **changes)


def _commit(state: LoopState, new_tokens: jax.Array, n_new: jax.Array, eos_ids: tuple[int, ...],
            max_new: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append the first n_new[b] of new_tokens [B, W] to each active row, cut at EOS and at the budget.

    Returns (out, n_out, done). Nothing after the first EOS is emitted; EOS itself is.
    """
    B, W = new_tokens.shape
    j = jnp.arange(W, dtype=jnp.int32)[None, :]
    n = jnp.where(state.done, 0, n_new)
    n = jnp.minimum(n, max_new - state.n_out)  # a block may overshoot the budget: cut inside it
    if eos_ids:
        is_eos = jnp.isin(new_tokens, jnp.asarray(eos_ids, jnp.int32)) & (j < n[:, None])
        first_eos = jnp.argmax(is_eos, axis=1)
        hit = is_eos.any(axis=1)
        n = jnp.where(hit, first_eos + 1, n)
    else:
        hit = jnp.zeros((B,), bool)
    cols = jnp.where(j < n[:, None], state.n_out[:, None] + j, state.out.shape[1])  # out of range -> dropped
    out = state.out.at[jnp.arange(B)[:, None], cols].set(new_tokens, mode="drop")
    n_out = state.n_out + n
    done = state.done | hit | (n_out >= max_new)
    return out, n_out, done


def _prefill(target: Target, prompt: jax.Array, lens: jax.Array, cache_len: int, layer_ids: tuple[int, ...],
             sampling: SamplingParams, keys: jax.Array):
    """Run the (right-padded) prompt; returns first tokens [B], features [B, Tp, K*H], cache, keys."""
    B, _ = prompt.shape
    cache = KVCache.empty(target.config, B, cache_len)
    logits, feats, cache = forward_with_cache(target, prompt, cache, layer_ids)
    cache = cache.replace(lengths=lens)  # padded slots stay in memory, masked by length
    last_logits = jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    first, keys = sample_tokens(last_logits, keys, sampling)
    return first, feats, cache, keys


# Process-wide, not thread-local: the runtime may run host callbacks on its own threads.
_STAMPS = {"prefill_done": None}


def _stamp(x):
    _STAMPS["prefill_done"] = time.perf_counter()
    return np.zeros((), np.int32)


def _mark_prefill_done(first: jax.Array) -> jax.Array:
    """Records when prefill finished (one host callback per call, outside the loop); returns 0 to sequence on."""
    return io_callback(_stamp, jax.ShapeDtypeStruct((), jnp.int32), first, ordered=True)


def _init_state(first, tcache, prompt_lens, keys, max_new, width, max_steps, eos_ids, dcache=None,
                pending=None, n_pending=None, stamp=None) -> LoopState:
    B = first.shape[0]
    step = jnp.zeros((), jnp.int32) if stamp is None else stamp
    state = LoopState(step=step, out=jnp.full((B, max_new + width), PAD, jnp.int32),
                      n_out=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool), last=first,
                      start=prompt_lens, tcache=tcache, dcache=dcache, pending=pending, n_pending=n_pending,
                      acc=jnp.zeros((B, max_steps), jnp.int32), key=keys)
    out, n_out, done = _commit(state, first[:, None], jnp.ones((B,), jnp.int32), eos_ids, max_new)
    return state.replace(out=out, n_out=n_out, done=done)


def _speculative_program(target: Target, drafter: Drafter, prompt, lens, keys, *, max_new: int, draft_length: int,
                         eos_ids: tuple[int, ...], cache_len: int, sampling: SamplingParams):
    dcfg = drafter.config
    layer_ids = dcfg.target_layer_ids
    bs, D = dcfg.block_size, draft_length
    B = prompt.shape[0]
    max_steps = max(max_new - 1, 1)

    first, feats, tcache, keys = _prefill(target, prompt, lens, cache_len, layer_ids, sampling, keys)
    dcache = append_context(drafter, feats, lens, DraftCache.empty(dcfg, B, cache_len))
    stamp = _mark_prefill_done(first)
    pending = jnp.zeros((B, D + 1, feats.shape[-1]), feats.dtype)
    state = _init_state(first, tcache, lens, keys, max_new, D + 1, max_steps, eos_ids, dcache=dcache,
                        pending=pending, n_pending=jnp.zeros((B,), jnp.int32), stamp=stamp)

    def cond(s: LoopState):
        return (s.step < max_steps) & ~jnp.all(s.done)

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        dcache = append_context(drafter, s.pending, s.n_pending, s.dcache)
        block = jnp.full((B, bs), dcfg.mask_token_id, jnp.int32).at[:, 0].set(s.last)
        d_logits = block_logits(drafter, target, block, dcache, num_slots=D)  # [B, D, V]
        drafts, keys = sample_tokens(d_logits, s.key, sampling, draft=True)  # [B, D]
        verify_in = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B, D+1]
        v_logits, v_feats, tcache = forward_with_cache(target, verify_in, s.tcache, layer_ids)
        n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling)  # [B], [B, D+1]
        chex.assert_shape(committed, (B, D + 1))
        out, n_out, done = _commit(s, committed, n_acc + 1, eos_ids, max_new)
        new_start = jnp.where(active, s.start + n_acc + 1, s.start)
        bonus = jnp.take_along_axis(committed, n_acc[:, None], axis=1)[:, 0]
        return s.replace(
            step=s.step + 1, out=out, n_out=n_out, done=done,
            last=jnp.where(active, bonus, s.last), start=new_start,
            tcache=tcache.replace(lengths=new_start),  # rollback: drop rejected slots by length
            dcache=dcache, pending=v_feats, n_pending=jnp.where(active, n_acc + 1, 0),
            acc=s.acc.at[:, s.step].set(jnp.where(active, n_acc + 1, 0)), key=keys)

    final = jax.lax.while_loop(cond, body, state)
    return final.out[:, :max_new], final.n_out, final.acc, final.step, final.done


def _autoregressive_program(target: Target, prompt, lens, keys, *, max_new: int, eos_ids: tuple[int, ...],
                            cache_len: int, sampling: SamplingParams):
    B = prompt.shape[0]
    max_steps = max(max_new - 1, 1)
    first, _, tcache, keys = _prefill(target, prompt, lens, cache_len, (), sampling, keys)
    stamp = _mark_prefill_done(first)
    state = _init_state(first, tcache, lens, keys, max_new, 1, max_steps, eos_ids, stamp=stamp)

    def cond(s: LoopState):
        return (s.step < max_steps) & ~jnp.all(s.done)

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        logits, _, tcache = forward_with_cache(target, s.last[:, None], s.tcache)
        nxt, keys = sample_tokens(logits[:, 0], s.key, sampling)
        out, n_out, done = _commit(s, nxt[:, None], jnp.ones((B,), jnp.int32), eos_ids, max_new)
        new_start = jnp.where(active, s.start + 1, s.start)
        return s.replace(step=s.step + 1, out=out, n_out=n_out, done=done, last=jnp.where(active, nxt, s.last),
                         start=new_start, tcache=tcache.replace(lengths=new_start),
                         acc=s.acc.at[:, s.step].set(active.astype(jnp.int32)), key=keys)

    final = jax.lax.while_loop(cond, body, state)
    return final.out[:, :max_new], final.n_out, final.acc, final.step, final.done


# -- host side: validation, padding, compilation cache ----------------------------------------------------------

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prepare_prompt(prompt, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int [B, T] array or list of token lists -> (right-padded [B, Tp] int32, lengths [B]); validates ids."""
    if isinstance(prompt, (np.ndarray, jax.Array)) or (
            isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (list, tuple, np.ndarray))):
        arr = np.asarray(prompt)
        if arr.ndim == 1:
            raise ValueError(f"prompt must be int [B, T] or a list of token lists, got a 1-D array of shape "
                             f"{arr.shape} (wrap a single prompt in a list)")
        rows = [list(r) for r in arr] if arr.ndim == 2 else None
        if rows is None:
            raise ValueError(f"prompt must be int [B, T], got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    else:
        rows = [list(r) for r in prompt]
    if not rows:
        raise ValueError("empty prompt: the batch has no rows")
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"empty prompt: row {b} has no tokens")
        for t, tok in enumerate(r):
            if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool):
                raise ValueError(f"token ids must be integers, got {tok!r} at row {b}, position {t}")
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"token id {int(tok)} at row {b}, position {t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    lens = np.array([len(r) for r in rows], np.int32)
    Tp = _round_up(int(lens.max()), 16)  # bucket prompt lengths to bound recompiles
    padded = np.zeros((len(rows), Tp), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = np.asarray(r, np.int64)
    return padded, lens


def _check_budget(target: Target, lens: np.ndarray, max_new_tokens: int, extra: int, max_cache_len):
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    need = int(lens.max()) + int(max_new_tokens)
    limit = target.config.max_position_embeddings
    if max_cache_len is not None:
        limit = min(limit, int(max_cache_len))
    if need > limit:
        raise ValueError(f"context overflow: prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = "
                         f"{need} exceeds the context limit of {limit} tokens")
    # The last verify writes up to `extra` slots past the committed text; the scatter drops out-of-range writes,
    # so the cache needs room for them only to keep them, never for correctness.
    return _round_up(need + extra, 64)


def _warn_short_drafter_context(drafter: Drafter, longest: int) -> None:
    limit = drafter.config.model.max_position_embeddings
    if longest > limit:
        warnings.warn(f"context of up to {longest} tokens exceeds the drafter's max_position_embeddings ({limit}): "
                      "acceptance may degrade (output stays exact)", stacklevel=3)


def _eos_tuple(eos_ids, vocab_size) -> tuple[int, ...]:
    if eos_ids is None:
        return ()
    if isinstance(eos_ids, (int, np.integer)):
        eos_ids = (eos_ids,)
    out = tuple(sorted({int(e) for e in eos_ids}))
    bad = [e for e in out if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"eos_ids {bad} outside the vocabulary [0, {vocab_size})")
    return out


_COMPILED: dict = {}
TRACE_COUNTS: dict[str, int] = {"speculative": 0, "autoregressive": 0}


def _compile(name: str, fn, static: dict, *args):
    """AOT-compile once per (static args, argument structure and shapes); compile time is reported apart."""
    leaves, treedef = jax.tree.flatten(args)
    sig = (name, tuple(sorted(static.items())), treedef, tuple((l.shape, str(l.dtype)) for l in leaves))
    if sig in _COMPILED:
        return _COMPILED[sig], 0.0
    t0 = time.perf_counter()

    def counted(*a):
        TRACE_COUNTS[name] += 1
        return fn(*a, **static)

    compiled = jax.jit(counted).lower(*args).compile()
    _COMPILED[sig] = compiled
    return compiled, time.perf_counter() - t0


def _row_keys(seed: int, batch: int) -> jax.Array:
    # One independent stream per row (fold_in of the row index): a row's samples do not depend on the batch.
    base = jax.random.key(seed)
    return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))(jnp.arange(batch))


def _run(name, fn, static, args, max_new, draft_length, eos) -> GenerationResult:
    compiled, compile_s = _compile(name, fn, static, *args)
    _STAMPS["prefill_done"] = None
    t0 = time.perf_counter()
    out, n_out, acc, steps, done = jax.block_until_ready(compiled(*args))
    t1 = time.perf_counter()
    t_prefill = _STAMPS["prefill_done"] if _STAMPS["prefill_done"] is not None else t0
    out, n_out, acc, steps = map(np.asarray, jax.device_get((out, n_out, acc, steps)))
    steps = int(steps)
    acc = acc[:, :steps]
    reasons = tuple("eos" if n > 0 and int(row[n - 1]) in eos else "length" for row, n in zip(out, n_out))
    timings = {"prefill_s": t_prefill - t0, "decode_s": t1 - t_prefill, "total_s": t1 - t0, "compile_s": compile_s}
    return GenerationResult(tokens=out, num_tokens=n_out, acceptance_lengths=acc, finish_reason=reasons,
                            num_steps=steps, draft_length=draft_length, timings=timings)


def generate(target: Target, drafter: Drafter, prompt, *, max_new_tokens: int, draft_length: int | None = None,
             temperature: float = 0.0, eos_ids: Sequence[int] = (), seed: int = 0, top_k: int = 0,
             top_p: float = 1.0, p_min: float = 0.0, draft_sampling: str = "sample",
             max_cache_len: int | None = None) -> GenerationResult:
    """DFlash speculative generation: one compiled program (prefill + one `lax.while_loop`).

    prompt: int [B, T] or a list of token lists (rows may differ in length). Greedy (temperature 0) output equals
    `generate_autoregressive` token for token; at temperature > 0 rejection sampling keeps the target's distribution.
    """
    check_pair(drafter.config, target.config)
    bs = drafter.config.block_size
    D = bs - 1 if draft_length is None else draft_length
    if not isinstance(D, (int, np.integer)) or not 1 <= D <= bs - 1:
        raise ValueError(f"draft_length must be in 1..block_size-1 = 1..{bs - 1}, got {draft_length!r}")
    sampling = SamplingParams.make(temperature, top_k, top_p, p_min, draft_sampling)
    padded, lens = prepare_prompt(prompt, target.config.vocab_size)
    cache_len = _check_budget(target, lens, max_new_tokens, D + 1, max_cache_len)
    _warn_short_drafter_context(drafter, int(lens.max()) + int(max_new_tokens))
    eos = _eos_tuple(eos_ids, target.config.vocab_size)
    static = dict(max_new=int(max_new_tokens), draft_length=int(D), eos_ids=eos, cache_len=cache_len,
                  sampling=sampling)
    args = (target, drafter, jnp.asarray(padded), jnp.asarray(lens), _row_keys(seed, len(lens)))
    return _run("speculative", _speculative_program, static, args, int(max_new_tokens), int(D), eos)


def generate_autoregressive(target: Target, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                            eos_ids: Sequence[int] = (), seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                            max_cache_len: int | None = None) -> GenerationResult:
    """Plain decoding with the same target, stopping rules and result type; also one `lax.while_loop`."""
    sampling = SamplingParams.make(temperature, top_k, top_p, 0.0, "sample")
    padded, lens = prepare_prompt(prompt, target.config.vocab_size)
    cache_len = _check_budget(target, lens, max_new_tokens, 1, max_cache_len)
    eos = _eos_tuple(eos_ids, target.config.vocab_size)
    static = dict(max_new=int(max_new_tokens), eos_ids=eos, cache_len=cache_len, sampling=sampling)
    args = (target, jnp.asarray(padded), jnp.asarray(lens), _row_keys(seed, len(lens)))
    return _run("autoregressive", _autoregressive_program, static, args, int(max_new_tokens), 0, eos)
