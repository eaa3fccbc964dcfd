"""Speculative generation (draft -> verify -> accept) and the autoregressive baseline, each ONE compiled program.

Layout of one DFlash step for a row whose last committed token `last` sits at position `start`:
  draft   block [last, M, ..., M] at positions start..start+bs-1 -> drafts d_1..d_D (slot k predicts start+k)
  verify  target over [last, d_1..d_D] at positions start..start+D -> post[j] = target token for start+j+1
  accept  a = number of leading j with d_{j+1} == post[j]  (cumprod)   ->  commit post[0..a] (a drafts + bonus)
  roll    target cache length := start+a+1; drafter context += verify features of rows 0..a; start += a+1
Everything is on device inside one `lax.while_loop`; rows that finish are frozen by masks, not removed.
A DFlash2 drafter proposes d_1..d_D with its candidate selector (a `lax.scan` inside the loop body, draft_step.py).

Compilation: each program is a `jax.jit` function, so its cache is keyed on everything that changes the program:
shapes, dtypes, shardings and tree structure of the arguments, plus the static arguments (draft length, buckets,
greedy or sampled, the NVFP4 backend resolved on the host). Sampling numbers (temperature, top-k, top-p, p_min), the
EOS ids (padded to a fixed width) and the budgets (tokens, steps) are traced, so one program serves all their values.
Prompt lengths and `max_new_tokens` are rounded up to power-of-two buckets (the output buffer and caches are sized
by bucket; the loop stops at the exact count on device), so any length maps to one of a few programs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dflash_jax.parallel import sharding as shd
from dflash_jax.config import check_pair
from dflash_jax.decode.draft_step import draft_step
from dflash_jax.models.drafter import Drafter, empty_draft_cache, append_context
from dflash_jax.quant.linear import backend_scope, program_backend
from dflash_jax.decode.sampling import SamplingParams, accept_block, sample_tokens
from dflash_jax.models.target import KVCache, Target, forward_with_cache

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
    timings: dict  # seconds: prefill_s, decode_s, total_s (this run), compile_s (tracing + compiling, apart)

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

    def replace(self, **changes) -> "LoopState":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Budget:
    """What ends a row or the loop: traced, so changing them never recompiles."""

    max_new: jax.Array  # [] int32 tokens to emit per row (<= the output buffer's bucket)
    max_steps: jax.Array  # [] int32 loop iterations allowed (0: prefill only)
    eos: jax.Array  # [E] int32 EOS ids, padded with -1 (never a token)

    def replace(self, **changes) -> "Budget":
        return dataclasses.replace(self, **changes)


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


def prefill(target: Target, prompt: jax.Array, lens: jax.Array, cache_len: int, *, drafter: Drafter | None = None,
            mesh=None) -> tuple[jax.Array, jax.Array, KVCache, KVCache | None]:
    """Run right-padded prompts [B, Tp] (row lengths [B]) into fresh caches of cache_len slots.

    Returns (logits at each row's last prompt token [B, V] f32, target features of the drafter's taps [B, Tp, K*H],
    the target cache with lengths = lens, and the drafter's context cache holding every prompt position, or None
    without a drafter). Padded slots stay in memory past each row's length, never visible. Only the kept row of
    each prompt goes through the LM head (not [B, Tp, V]). A row of length 0 is an inert padding row (a batch padded
    to the mesh's data axis): it writes nothing to either cache. mesh: where the caches live
    (`sharding.cache_sharding`); None on one device.
    """
    B, _ = prompt.shape
    layer_ids = () if drafter is None else drafter.config.target_layer_ids
    cache = shd.constrain_cache(KVCache.empty(target.config, B, cache_len), target.config, mesh)
    logits, feats, cache = forward_with_cache(target, prompt, cache, layer_ids,
                                              logits_at=jnp.maximum(lens - 1, 0)[:, None], empty_cache=True)
    cache = shd.constrain_cache(cache.replace(lengths=lens), target.config, mesh)
    dcache = None
    if drafter is not None:
        dcache = shd.constrain_cache(empty_draft_cache(drafter.config, B, cache_len), drafter.config.model, mesh)
        dcache = shd.constrain_cache(append_context(drafter, feats, lens, dcache), drafter.config.model, mesh)
    return logits[:, 0], feats, cache, dcache


# The prefill-done stamp: process-wide, not thread-local (the runtime may run host callbacks on its own threads).
_STAMPS = {"prefill_done": None}


def _stamp(x):
    _STAMPS["prefill_done"] = time.perf_counter()
    return np.zeros((), np.int32)


def _mark_prefill_done(first: jax.Array) -> jax.Array:
    """Records when prefill finished (one host callback per call, outside the loop); returns 0 to sequence on.

    A program with a host callback never enters JAX's persistent compilation cache: `prefill_timing="rerun"` leaves
    it out (see `generate`)."""
    return io_callback(_stamp, jax.ShapeDtypeStruct((), jnp.int32), first, ordered=True)


def _init_state(first, tcache, prompt_lens, keys, budget: Budget, out_len: int, width: int, stamp: bool,
                dcache=None, pending=None, n_pending=None) -> LoopState:
    B = first.shape[0]
    step = _mark_prefill_done(first) if stamp else jnp.zeros((), jnp.int32)
    # Rows of prompt length 0 are padding (to the mesh's data axis): done from the start, they never emit a token.
    state = LoopState(step=step, out=jnp.full((B, out_len + width), PAD, jnp.int32),
                      n_out=jnp.zeros((B,), jnp.int32), done=prompt_lens == 0, last=first,
                      start=prompt_lens, tcache=tcache, dcache=dcache, pending=pending, n_pending=n_pending,
                      acc=jnp.zeros((B, max(out_len - 1, 1)), jnp.int32), key=keys)
    out, n_out, done = _commit(state, first[:, None], jnp.ones((B,), jnp.int32), budget)
    return state.replace(out=out, n_out=n_out, done=done)


def _results(final: LoopState, mesh=None):
    res = final.out, final.n_out, final.acc, final.step
    if mesh is not None:  # replicated, so that every process can read the whole result
        res = jax.lax.with_sharding_constraint(res, shd.replicated(mesh))
    return res


def _speculative_program(target: Target, drafter: Drafter, prompt, lens, keys, sampling: SamplingParams,
                         budget: Budget, *, draft_length: int, cache_len: int, out_len: int, stamp: bool = True,
                         mesh=None):
    dcfg = drafter.config
    layer_ids = dcfg.target_layer_ids
    bs, D = dcfg.block_size, draft_length
    B = prompt.shape[0]

    last_logits, feats, tcache, dcache = prefill(target, prompt, lens, cache_len, drafter=drafter, mesh=mesh)
    first, keys = sample_tokens(last_logits, keys, sampling)
    pending = jnp.zeros((B, D + 1, feats.shape[-1]), feats.dtype)
    state = _init_state(first, tcache, lens, keys, budget, out_len, D + 1, stamp, dcache=dcache, pending=pending,
                        n_pending=jnp.zeros((B,), jnp.int32))

    def cond(s: LoopState):
        return (s.step < budget.max_steps) & ~jnp.all(s.done)

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        dcache = append_context(drafter, s.pending, s.n_pending, s.dcache)
        block = jnp.full((B, bs), dcfg.mask_token_id, jnp.int32).at[:, 0].set(s.last)
        # drafts [B, D]; d_logits [B, D, V]; d_probs: the DFlash2 selector's q (None for DFlash)
        drafts, d_logits, d_probs, keys = draft_step(drafter, target, block, dcache, D, s.key, sampling)
        verify_in = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B, D+1]
        v_logits, v_feats, tcache = forward_with_cache(target, verify_in, s.tcache, layer_ids)
        q_kw = {} if d_probs is None else {"draft_probs": d_probs}
        n_acc, committed, keys = accept_block(d_logits, drafts, v_logits, keys, sampling, **q_kw)  # [B], [B, D+1]
        chex.assert_shape(committed, (B, D + 1))
        out, n_out, done = _commit(s, committed, n_acc + 1, budget)
        new_start = jnp.where(active, s.start + n_acc + 1, s.start)
        bonus = jnp.take_along_axis(committed, n_acc[:, None], axis=1)[:, 0]
        return s.replace(
            step=s.step + 1, out=out, n_out=n_out, done=done,
            last=jnp.where(active, bonus, s.last), start=new_start,
            # rollback: drop rejected slots by length
            tcache=shd.constrain_cache(tcache.replace(lengths=new_start), target.config, mesh),
            dcache=shd.constrain_cache(dcache, dcfg.model, mesh), pending=v_feats,
            n_pending=jnp.where(active, n_acc + 1, 0),
            acc=s.acc.at[:, s.step].set(jnp.where(active, n_acc + 1, 0)), key=keys)

    return _results(jax.lax.while_loop(cond, body, state), mesh)


def _autoregressive_program(target: Target, prompt, lens, keys, sampling: SamplingParams, budget: Budget, *,
                            cache_len: int, out_len: int, stamp: bool = True, mesh=None):
    B = prompt.shape[0]
    last_logits, _, tcache, _ = prefill(target, prompt, lens, cache_len, mesh=mesh)
    first, keys = sample_tokens(last_logits, keys, sampling)
    state = _init_state(first, tcache, lens, keys, budget, out_len, 1, stamp)

    def cond(s: LoopState):
        return (s.step < budget.max_steps) & ~jnp.all(s.done)

    def body(s: LoopState) -> LoopState:
        active = ~s.done
        logits, _, tcache = forward_with_cache(target, s.last[:, None], s.tcache)
        nxt, keys = sample_tokens(logits[:, 0], s.key, sampling)
        out, n_out, done = _commit(s, nxt[:, None], jnp.ones((B,), jnp.int32), budget)
        new_start = jnp.where(active, s.start + 1, s.start)
        return s.replace(step=s.step + 1, out=out, n_out=n_out, done=done, last=jnp.where(active, nxt, s.last),
                         start=new_start, tcache=shd.constrain_cache(tcache.replace(lengths=new_start),
                                                                     target.config, mesh),
                         acc=s.acc.at[:, s.step].set(active.astype(jnp.int32)), key=keys)

    return _results(jax.lax.while_loop(cond, body, state), mesh)


# -- compiled programs ---------------------------------------------------------------------------------------------

TRACE_COUNTS: dict[str, int] = {"speculative": 0, "autoregressive": 0}


def _jit_program(name: str, program, static: tuple[str, ...]):
    """`program` under jax.jit: static `static` arguments plus `backend`, the NVFP4 backend the program is traced
    under. Each trace (= each compile) bumps TRACE_COUNTS[name]."""
    def traced(*args, backend, **kwargs):
        TRACE_COUNTS[name] += 1
        with backend_scope(backend), shd.mesh_scope(kwargs.get("mesh")):
            return program(*args, **kwargs)

    traced.__name__ = traced.__qualname__ = f"dflash_{name}"
    return jax.jit(traced, static_argnames=("backend", *static))


SPECULATIVE_STATIC = ("draft_length", "cache_len", "out_len", "stamp", "mesh")
AUTOREGRESSIVE_STATIC = ("cache_len", "out_len", "stamp", "mesh")
_SPECULATIVE = _jit_program("speculative", _speculative_program, SPECULATIVE_STATIC)
_AUTOREGRESSIVE = _jit_program("autoregressive", _autoregressive_program, AUTOREGRESSIVE_STATIC)


# Seconds spent tracing, lowering and compiling our programs, as JAX reports them (jax.monitoring): a call's
# compile time is reported apart from its run time without a compile cache of our own.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_clock = threading.local()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS and "dflash_" in str(kwargs.get("fun_name", "")):
        _compile_clock.seconds = getattr(_compile_clock, "seconds", 0.0) + duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


# -- host side: validation, padding, buckets -----------------------------------------------------------------------

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


PROMPT_BUCKET_MIN = 16
# Budgets share one program up to this many tokens: a bigger output buffer and cache cost only memory (attention
# visits live slots only), while a new bucket costs a compile.
BUDGET_BUCKET_MIN = 256


def bucket(n: int, minimum: int = PROMPT_BUCKET_MIN) -> int:
    """The power of two >= n (at least `minimum`): prompt lengths and token budgets are padded to these, so a
    range of lengths 1..L needs log2(L) programs at most."""
    return max(int(minimum), 1 << (max(int(n), 1) - 1).bit_length())


def prepare_prompt(prompt, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int [B, T] array or list of token lists -> (right-padded [B, Tp] int32, lengths [B]); validates ids.

    Tp is the length bucket of the longest row (`bucket`)."""
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
    Tp = bucket(int(lens.max()))
    padded = np.zeros((len(rows), Tp), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = np.asarray(r, np.int64)
    return padded, lens


def _check_budget(target: Target, lens: np.ndarray, max_new_tokens: int, max_cache_len) -> int:
    """Validates the budget; returns the context limit (max positions, or max_cache_len when smaller)."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    need = int(lens.max()) + int(max_new_tokens)
    limit = target.config.max_position_embeddings
    if max_cache_len is not None:
        limit = min(limit, int(max_cache_len))
    if need > limit:
        raise ValueError(f"context overflow: prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = "
                         f"{need} exceeds the context limit of {limit} tokens")
    return limit


def _cache_len(prompt_bucket: int, out_len: int, extra: int, limit: int) -> int:
    """Cache slots for a program: the prompt bucket + the budget bucket + the `extra` slots the last verify writes
    past the committed text, capped by the context limit; a function of buckets only, so it adds no programs.
    (The scatter drops out-of-range writes, so the extra room only keeps those slots, never decides correctness.)"""
    return min(_round_up(prompt_bucket + out_len + extra, 64), _round_up(limit + extra, 64))


def _warn_short_drafter_context(drafter: Drafter, longest: int) -> None:
    limit = drafter.config.model.max_position_embeddings
    if longest > limit:
        warnings.warn(f"context of up to {longest} tokens exceeds the drafter's max_position_embeddings ({limit}): "
                      "acceptance may degrade (output stays exact)", stacklevel=3)


EOS_WIDTH = 8  # EOS ids are padded to this many (more ids: the next power of two), so EOS sets share a program


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


def _eos_array(eos: tuple[int, ...]) -> np.ndarray:
    arr = np.full((bucket(len(eos), EOS_WIDTH),), PAD, np.int32)
    arr[:len(eos)] = eos
    return arr


def _row_keys(seed: int, batch: int) -> np.ndarray:
    # One independent stream per row (fold_in of the row index): a row's samples do not depend on the batch.
    base = jax.random.key(seed)
    return np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))(jnp.arange(batch)))


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One call of a compiled generation program, as `generate` prepares it on the host."""

    name: str  # "speculative" | "autoregressive"
    args: tuple  # (target, [drafter,] prompt [B, Tp], lens [B], keys [B, 2], SamplingParams, Budget)
    static: dict  # static keyword arguments: buckets, draft length, backend, stamp
    max_new: int
    draft_length: int
    eos: tuple[int, ...]
    batch: int = 0  # rows the caller gave (the program may run more: inert padding rows to the mesh's data axis)

    @property
    def program(self):
        return _SPECULATIVE if self.name == "speculative" else _AUTOREGRESSIVE

    @property
    def unjitted(self):
        """The plain program function with the static arguments bound (to inspect its jaxpr)."""
        import functools
        fn = _speculative_program if self.name == "speculative" else _autoregressive_program
        return functools.partial(fn, **{k: v for k, v in self.static.items() if k != "backend"})

    def __call__(self, *args):
        return self.program(*(args or self.args), **self.static)


def _prepare(name, target, drafter, prompt, *, max_new_tokens, draft_length, temperature, eos_ids, seed, top_k,
             top_p, p_min, draft_sampling, max_cache_len, nvfp4_backend, prefill_timing) -> ProgramCall:
    if prefill_timing not in ("stamp", "rerun"):
        raise ValueError(f"prefill_timing must be 'stamp' or 'rerun', got {prefill_timing!r}")
    sampling = SamplingParams.make(temperature, top_k, top_p, p_min, draft_sampling)
    models = (target,) if drafter is None else (target, drafter)
    mesh = shd.models_mesh(*models)  # refuses a pair on different meshes, or a mesh that cannot split a model
    padded, lens = prepare_prompt(prompt, target.config.vocab_size)
    limit = _check_budget(target, lens, max_new_tokens, max_cache_len)
    eos = _eos_tuple(eos_ids, target.config.vocab_size)
    out_len = bucket(int(max_new_tokens), BUDGET_BUCKET_MIN)
    # A host callback in a program spanning several processes would run in each of them: time prefill by a rerun.
    stamp = prefill_timing == "stamp" and (mesh is None or jax.process_count() == 1)
    static = dict(out_len=out_len, stamp=stamp,
                  backend=program_backend(*models, backend=nvfp4_backend), mesh=mesh,
                  cache_len=_cache_len(padded.shape[1], out_len, 1 if drafter is None else draft_length + 1, limit))
    if drafter is not None:
        static["draft_length"] = int(draft_length)
    budget = Budget(max_new=np.int32(max_new_tokens), max_steps=np.int32(int(max_new_tokens) - 1),
                    eos=_eos_array(eos))
    batch = len(lens)
    keys = _row_keys(seed, batch)
    sampling = sampling.as_arrays()
    if mesh is not None:
        # The batch goes along "data": pad it to a multiple of the axis with inert rows (length 0: done from the
        # start, see `_init_state`); their keys come from the same per-row streams, so real rows draw the same.
        rows = _round_up(batch, int(mesh.shape["data"]))
        padded = np.concatenate([padded, np.zeros((rows - batch, padded.shape[1]), np.int32)])
        lens = np.concatenate([lens, np.zeros((rows - batch,), np.int32)])
        keys = _row_keys(seed, rows)
        padded, lens, keys = (shd.place(x, shd.batch_sharding(mesh, x.ndim)) for x in (padded, lens, keys))
        sampling, budget = shd.place_tree((sampling, budget), shd.replicated(mesh))
    args = (*models, padded, lens, keys, sampling, budget)
    return ProgramCall(name, args, static, int(max_new_tokens), 0 if drafter is None else int(draft_length), eos,
                       batch)


def _host(x) -> np.ndarray:
    """A program result on the host; with several processes, results are replicated and read from a local copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))


def _run(call: ProgramCall) -> GenerationResult:
    _compile_clock.seconds = 0.0
    _STAMPS["prefill_done"] = None
    t0 = time.perf_counter()
    out, n_out, acc, steps = jax.block_until_ready(call())
    t1 = time.perf_counter()
    compile_s = _compile_clock.seconds
    t_start = min(t0 + compile_s, t1)  # the run itself starts once the program is traced and compiled
    if call.static["stamp"]:
        t_prefill = _STAMPS["prefill_done"] if _STAMPS["prefill_done"] is not None else t_start
    else:  # the same program, traced budget of 0 loop steps: prefill (and the first token) only
        *rest, budget = call.args
        zero = np.int32(0)
        if call.static.get("mesh") is not None:
            zero = shd.place(zero, shd.replicated(call.static["mesh"]))
        r0 = time.perf_counter()
        jax.block_until_ready(call(*rest, budget.replace(max_steps=zero)))
        t_prefill = t_start + (time.perf_counter() - r0)
    out, n_out, acc, steps = map(_host, (out, n_out, acc, steps))
    steps = int(steps)
    B = call.batch or out.shape[0]  # padding rows (to the mesh's data axis) never reach the result
    out, n_out, acc = out[:B, :call.max_new], n_out[:B], acc[:B, :steps]
    reasons = tuple("eos" if n > 0 and int(row[n - 1]) in call.eos else "length" for row, n in zip(out, n_out))
    timings = {"prefill_s": t_prefill - t_start, "decode_s": t1 - t_prefill, "total_s": t1 - t_start,
               "compile_s": compile_s}
    return GenerationResult(tokens=out, num_tokens=n_out, acceptance_lengths=acc, finish_reason=reasons,
                            num_steps=steps, draft_length=call.draft_length, timings=timings)


def _draft_length(drafter: Drafter, draft_length) -> int:
    bs = drafter.config.block_size
    D = bs - 1 if draft_length is None else draft_length
    if not isinstance(D, (int, np.integer)) or isinstance(D, bool) or not 1 <= D <= bs - 1:
        raise ValueError(f"draft_length must be in 1..block_size-1 = 1..{bs - 1}, got {draft_length!r}")
    return int(D)


def speculative_call(target: Target, drafter: Drafter, prompt, *, max_new_tokens: int,
                     draft_length: int | None = None, temperature: float = 0.0, eos_ids: Sequence[int] = (),
                     seed: int = 0, top_k: int = 0, top_p: float = 1.0, p_min: float = 0.0,
                     draft_sampling: str = "sample", max_cache_len: int | None = None,
                     nvfp4_backend: str | None = None, prefill_timing: str = "stamp") -> ProgramCall:
    """What `generate` runs, prepared and validated on the host but not run (tests, benchmarks, inspection)."""
    check_pair(drafter.config, target.config)
    D = _draft_length(drafter, draft_length)
    call = _prepare("speculative", target, drafter, prompt, max_new_tokens=max_new_tokens, draft_length=D,
                    temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p, p_min=p_min,
                    draft_sampling=draft_sampling, max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                    prefill_timing=prefill_timing)
    _warn_short_drafter_context(drafter, int(call.args[3].max()) + int(max_new_tokens))
    return call


def autoregressive_call(target: Target, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                        eos_ids: Sequence[int] = (), seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                        max_cache_len: int | None = None, nvfp4_backend: str | None = None,
                        prefill_timing: str = "stamp") -> ProgramCall:
    """What `generate_autoregressive` runs, prepared on the host but not run."""
    return _prepare("autoregressive", target, None, prompt, max_new_tokens=max_new_tokens, draft_length=0,
                    temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p, p_min=0.0,
                    draft_sampling="sample", max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                    prefill_timing=prefill_timing)


def generate(target: Target, drafter: Drafter, prompt, *, max_new_tokens: int, draft_length: int | None = None,
             temperature: float = 0.0, eos_ids: Sequence[int] = (), seed: int = 0, top_k: int = 0,
             top_p: float = 1.0, p_min: float = 0.0, draft_sampling: str = "sample",
             max_cache_len: int | None = None, nvfp4_backend: str | None = None,
             prefill_timing: str = "stamp") -> GenerationResult:
    """DFlash speculative generation: one compiled program (prefill + one `lax.while_loop`).

    prompt: int [B, T] or a list of token lists (rows may differ in length). Greedy (temperature 0) output equals
    `generate_autoregressive` token for token; at temperature > 0 rejection sampling keeps the target's distribution.
    nvfp4_backend: for NVFP4 weights (`dflash_jax.quant.linear`); None = the current default, resolved now, per call.
    prefill_timing: "stamp" = one host callback marks the end of prefill (such a program never enters JAX's
    persistent compilation cache); "rerun" = no callback, prefill is timed by a second, prefill-only run of the same
    compiled program (what the CLI and benchmarks use, with the persistent cache on; also what a mesh spanning several
    processes gets).

    Sharded models (`dflash_jax.parallel.sharding.shard`, or `load_target(..., mesh=)`): the prompt batch goes along the mesh's
    "data" axis (padded with inert rows when the axis does not divide it); the tokens are those of one device.
    """
    return _run(speculative_call(target, drafter, prompt, max_new_tokens=max_new_tokens, draft_length=draft_length,
                                 temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p,
                                 p_min=p_min, draft_sampling=draft_sampling, max_cache_len=max_cache_len,
                                 nvfp4_backend=nvfp4_backend, prefill_timing=prefill_timing))


def generate_autoregressive(target: Target, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                            eos_ids: Sequence[int] = (), seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                            max_cache_len: int | None = None, nvfp4_backend: str | None = None,
                            prefill_timing: str = "stamp") -> GenerationResult:
    """Plain decoding with the same target, stopping rules and result type; also one `lax.while_loop`."""
    return _run(autoregressive_call(target, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                    eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p,
                                    max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                                    prefill_timing=prefill_timing))
