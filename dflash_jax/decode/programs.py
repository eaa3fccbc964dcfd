"""Speculative generation (draft -> verify -> accept) and the autoregressive baseline: TWO compiled programs each.

Layout of one DFlash step for a row whose last committed token `last` sits at position `start`:
  draft   block [last, M, ..., M] at positions start..start+bs-1 -> drafts d_1..d_D (slot k predicts start+k)
  verify  target over [last, d_1..d_D] at positions start..start+D -> post[j] = target token for start+j+1
  accept  a = number of leading j with d_{j+1} == post[j]  (cumprod)   ->  commit post[0..a] (a drafts + bonus)
  roll    target cache length := start+a+1; drafter context += verify features of rows 0..a; start += a+1
Everything of a step is on device inside one `lax.while_loop`; rows that finish are frozen by masks, not removed.
A DFlash2 drafter proposes d_1..d_D with its candidate selector (a `lax.scan` inside the loop body, draft_step.py).

Programs: `prefill` (prompt -> caches + the logits of each row's last prompt token) and the generation loop
(first token, then the `lax.while_loop`). The handoff is one device-side value (`Prefilled`: caches, lengths, logits),
donated to the loop, so no host sync sits between them and the cache is not held twice. Prefill is keyed on the
prompt bucket; the loop is keyed only on the cache bucket, the batch bucket, the budget bucket and static flags (draft
length, greedy or sampled, the NVFP4 backend resolved on the host, the mesh), so a new prompt bucket recompiles prefill
alone.

Compilation: each program is a `jax.jit` function, so its cache is keyed on everything that changes the program:
shapes, dtypes, shardings and tree structure of the arguments, plus the static arguments. Sampling numbers
(temperature, top-k, top-p, p_min), the EOS ids (padded to a fixed width) and the budgets (tokens, steps) are traced,
so one program serves all their values. Buckets (`prompt_bucket`, `cache_bucket`, `batch_bucket`, `bucket` for the
budget): the output buffer, the caches and the batch are sized by bucket and the loop stops at the exact count on
device, so any request maps to one of a few programs; padding rows of a batch bucket are inert (length 0: done from
the start, they write nothing and never reach the result).

Attention over the caches inside the loop is chosen per platform when the program is built (`live_length`, a static
flag of the loop programs, `uses_live_length_loop`): on accelerators every loop in a step has a static trip count
(attention masks the whole cache bucket), so the device never waits on the host inside a step; on CPU attention
visits only the blocks up to the longest live row (`dflash_jax.models.attention.live_length_loop`), whose
data-dependent trip count costs nothing there, so one large cache bucket serves short and long prompts alike.
"""

from __future__ import annotations

import dataclasses
import itertools
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
from dflash_jax.models.attention import live_length_loop
from dflash_jax.models.drafter import Drafter, append_context, as_compiled, empty_draft_cache
from dflash_jax.quant.linear import backend_scope, dense_kernel_scope, program_backend
from dflash_jax.decode.sampling import SamplingParams, accept_block, sample_tokens
from dflash_jax.models.target import KVCache, Target, commit_states, forward_with_cache
from dflash_jax.params import committed

PAD = -1


# -- results -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] new tokens, -1 after each row's end (return_prompt: see below)
    num_tokens: np.ndarray  # [B] tokens generated per row (new tokens only, with or without return_prompt)
    acceptance_lengths: np.ndarray  # [B, steps] tokens committed per step incl. the bonus; 0 after a row's end
    finish_reason: tuple[str, ...]  # per row: "eos" | "length"
    num_steps: int  # loop iterations (draft+verify steps, or decode steps)
    draft_length: int  # drafted tokens per step (0 for autoregressive)
    timings: dict  # seconds: prefill_s, decode_s, total_s (this run), compile_s (tracing + compiling, apart)
    # [B] real prompt tokens per row. With return_prompt=True (`includes_prompt`), `tokens` is
    # [B, longest prompt + max_new_tokens]: row b = its prompt (no padding) + its new tokens, then -1.
    prompt_lengths: np.ndarray | None = None
    includes_prompt: bool = False

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
        """Per row: its new tokens (with return_prompt: its prompt + its new tokens), no -1 padding."""
        n = self.num_tokens + (self.prompt_lengths if self.includes_prompt else 0)
        return [row[:k].tolist() for row, k in zip(self.tokens, n)]

    def new_token_lists(self) -> list[list[int]]:
        """Per row: the generated tokens only, with or without return_prompt."""
        p = self.prompt_lengths if self.includes_prompt else np.zeros_like(self.num_tokens)
        return [row[a:a + n].tolist() for row, a, n in zip(self.tokens, p, self.num_tokens)]

    def decode(self, tokenizer, **kwargs) -> list[str]:
        """One string per row: `tokenizer.decode` of `token_lists()` (so prompt + completion with return_prompt);
        works with this package's `Tokenizer` and with HF tokenizers (kwargs go to their decode)."""
        return [tokenizer.decode(row, **kwargs) for row in self.token_lists()]


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
    # state_keep: a hybrid target's DeltaNet states absorb each row's real prompt only, not its right padding
    logits, feats, cache = forward_with_cache(target, prompt, cache, layer_ids,
                                              logits_at=jnp.maximum(lens - 1, 0)[:, None], empty_cache=True,
                                              state_keep=lens if target.config.is_hybrid else None)
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


def _prefill_program(target: Target, drafter: Drafter | None, prompt, lens, *, cache_len: int, stamp: bool,
                     mesh=None) -> Prefilled:
    B, _ = prompt.shape
    chex.assert_shape(lens, (B,))
    logits, _, tcache, dcache = prefill(target, prompt, lens, cache_len, drafter=drafter, mesh=mesh)
    step = _mark_prefill_done(logits) if stamp else jnp.zeros((), jnp.int32)
    return Prefilled(logits=logits, lens=lens, tcache=tcache, dcache=dcache, step=step)


def _init_state(pre: Prefilled, keys, sampling: SamplingParams, budget: Budget, out_len: int, width: int,
                pending=None, n_pending=None) -> tuple[LoopState, jax.Array]:
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


def _results(final: LoopState, mesh=None):
    """(out, n_out, acc, steps, caches): the caches come back only so that XLA can alias them to the donated
    prefill handoff (the while loop then updates the prefill's cache in place instead of a copy); callers drop them."""
    res = final.out, final.n_out, final.acc, final.step
    if mesh is not None:  # replicated, so that every process can read the whole result
        res = jax.lax.with_sharding_constraint(res, shd.replicated(mesh))
    return (*res, (final.tcache, final.dcache))


def _speculative_loop(target: Target, drafter: Drafter, pre: Prefilled, keys, sampling: SamplingParams,
                      budget: Budget, *, draft_length: int, out_len: int, mesh=None):
    dcfg = drafter.config
    layer_ids = dcfg.target_layer_ids
    bs, D = dcfg.block_size, draft_length
    B = pre.lens.shape[0]
    feat_dim = len(layer_ids) * target.config.hidden_size
    pending = jnp.zeros((B, D + 1, feat_dim), target.config.dtype)  # the dtype of the target's features
    state = _init_state(pre, keys, sampling, budget, out_len, D + 1, pending=pending,
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
            tcache=shd.constrain_cache(tcache.replace(lengths=new_start), target.config, mesh),
            dcache=shd.constrain_cache(dcache, dcfg.model, mesh), pending=v_feats,
            n_pending=jnp.where(active, n_acc + 1, 0),
            acc=s.acc.at[:, s.step].set(jnp.where(active, n_acc + 1, 0)), key=keys)

    return _results(jax.lax.while_loop(cond, body, state), mesh)


def _autoregressive_loop(target: Target, drafter: None, pre: Prefilled, keys, sampling: SamplingParams,
                         budget: Budget, *, out_len: int, mesh=None):
    B = pre.lens.shape[0]
    state = _init_state(pre, keys, sampling, budget, out_len, 1)

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

# Traces (= compiles) per program: "prefill" (shared by both generators), and the two loop programs.
TRACE_COUNTS: dict[str, int] = {"prefill": 0, "speculative": 0, "autoregressive": 0}


def _jit_program(name: str, program, static: tuple[str, ...], donate: tuple[int, ...] = (),
                 compiler_options: dict | None = None):
    """`program` under jax.jit: static `static` arguments plus `backend`, the NVFP4 backend the program is traced
    under, and `live_length`, the attention rule it is traced under (see `uses_live_length_loop`; prefill never
    attends a cache and takes the default). Each trace (= each compile) bumps TRACE_COUNTS[name]. compiler_options:
    XLA options for these programs only (jax.jit's; the test suite compiles its large-batch programs with more
    optimisation than the rest)."""
    def traced(*args, backend, live_length: bool = False, **kwargs):
        TRACE_COUNTS[name] += 1
        # CPU loop programs (live_length: see `uses_live_length_loop`) also run dense weights through the CPU kernel
        with backend_scope(backend), shd.mesh_scope(kwargs.get("mesh")), live_length_loop(live_length), \
                dense_kernel_scope(live_length):
            return program(*args, **kwargs)

    traced.__name__ = traced.__qualname__ = f"dflash_{name}"
    # The loop takes the prefill handoff (argument 2) as donated: its caches are reused in place, not held twice.
    return jax.jit(traced, static_argnames=("backend", "live_length", *static), donate_argnums=donate,
                   compiler_options=compiler_options)


PREFILL_STATIC = ("cache_len", "stamp", "mesh")
SPECULATIVE_STATIC = ("draft_length", "out_len", "mesh")
AUTOREGRESSIVE_STATIC = ("out_len", "mesh")
_DEFS = {"prefill": (_prefill_program, PREFILL_STATIC, ()),
         "speculative": (_speculative_loop, SPECULATIVE_STATIC, (2,)),
         "autoregressive": (_autoregressive_loop, AUTOREGRESSIVE_STATIC, (2,))}
# The jitted programs, built on first use (a test may swap in an empty dict to trace everything anew).
_COMPILED: dict = {}


def _program(name: str):
    if name not in _COMPILED:
        fn, static, donate = _DEFS[name]
        _COMPILED[name] = _jit_program(name, fn, static, donate)
    return _COMPILED[name]


def compiled_counts() -> dict[str, int]:
    """Executables held per program (jit cache entries): {"prefill": n, "speculative": n, "autoregressive": n}."""
    return {name: (_COMPILED[name]._cache_size() if name in _COMPILED else 0) for name in _DEFS}


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
# Budgets share one program up to this many tokens: a bigger output buffer costs only memory, a new bucket a compile.
BUDGET_BUCKET_MIN = 256
# Cache buckets: powers of two from CACHE_BUCKET_MIN up to FINE_ABOVE slots, then multiples of FINE_STEP. Below 4k
# slots the memory is small and a compile is not, so one coarse bucket serves every prompt up to ~1.7k tokens (with a
# 256-token budget bucket), on every platform. (On accelerators attention reads the whole bucket; on CPU, where that
# cost would dominate a small model's step, the live-length loop reads only the live blocks: `uses_live_length_loop`.)
# Above 4k a power of two could double the KV memory (64 rows x 8.2k tokens of Qwen3-8B would take the 16k bucket),
# so the rule turns linear: the waste is < FINE_STEP slots, i.e. < 25% of the need at 4k+1 and < 12.5% from 8k on
# (8.2k -> 9216 slots, not 16384). Prompt buckets above FINE_ABOVE follow the same step.
CACHE_BUCKET_MIN = 2048
FINE_ABOVE = 4096
FINE_STEP = 1024
# Batch buckets: powers of two up to BATCH_FINE_ABOVE rows, then multiples of it (inert rows fill a bucket).
BATCH_FINE_ABOVE = 16


def bucket(n: int, minimum: int = PROMPT_BUCKET_MIN) -> int:
    """The power of two >= n (at least `minimum`): token budgets (and EOS sets) are padded to these, so a range of
    1..L needs log2(L) programs at most."""
    return max(int(minimum), 1 << (max(int(n), 1) - 1).bit_length())


def prompt_bucket(n: int) -> int:
    """Prompt length bucket (the prefill program's key): a power of two >= n (at least 16) up to 4096, then the
    multiple of 1024 >= n."""
    return bucket(n) if n <= FINE_ABOVE else _round_up(int(n), FINE_STEP)


def cache_bucket(n: int) -> int:
    """Cache slots for a need of n slots (the loop program's key): a power of two >= n, at least CACHE_BUCKET_MIN
    (2048), up to 4096; then the multiple of 1024 >= n (see CACHE_BUCKET_MIN for the worst-case waste)."""
    return bucket(n, CACHE_BUCKET_MIN) if n <= FINE_ABOVE else _round_up(int(n), FINE_STEP)


# Attention over the cache inside a loop program, per platform: True = the live-length loop (only the blocks up to
# the longest live row, a data-dependent trip count: free on CPU), False = static trip counts over the whole bucket
# (an accelerator would copy a data-dependent loop's predicate to the host on every iteration).
LIVE_LENGTH_LOOP = {"cpu": True, "default": False}


def uses_live_length_loop(platform: str | None = None) -> bool:
    """Whether loop programs for `platform` ("cpu", "cuda", "gpu", "tpu", ...; default: JAX's default backend) attend
    their caches with the live-length loop (see LIVE_LENGTH_LOOP). Exports for another platform ask with its name."""
    platform = platform or jax.default_backend()
    return LIVE_LENGTH_LOOP.get(platform, LIVE_LENGTH_LOOP["default"])


def _mesh_platform(mesh) -> str | None:
    """The platform of a mesh's devices (None without a mesh: the default backend's)."""
    return None if mesh is None else mesh.devices.flat[0].platform


def batch_bucket(n: int) -> int:
    """Rows a program runs for a batch of n: a power of two up to 16, then the multiple of 16 >= n (waste < 2x below
    16 rows, < 16 rows above). The extra rows are inert (prompt length 0)."""
    return bucket(n, 1) if n <= BATCH_FINE_ABOVE else _round_up(int(n), BATCH_FINE_ABOVE)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _unpad(prompt, attention_mask, prompt_lengths) -> list:
    """An HF-style padded batch -> a list of token lists (the real tokens of each row), or the prompt unchanged.

    attention_mask [B, T] (1 = real token, 0 = padding; left- or right-padded: each row's ones must be contiguous);
    prompt_lengths [B]: row b is prompt[b, :prompt_lengths[b]] (a right-padded batch)."""
    if attention_mask is None and prompt_lengths is None:
        return prompt
    if attention_mask is not None and prompt_lengths is not None:
        raise ValueError("give attention_mask or prompt_lengths, not both")
    arr = np.asarray(prompt)
    if arr.ndim != 2:
        raise ValueError(f"with attention_mask / prompt_lengths the prompt must be a padded int array [B, T], got "
                         f"shape {arr.shape}")
    B, T = arr.shape
    rows = []
    if attention_mask is not None:
        mask = np.asarray(attention_mask)
        if mask.shape != arr.shape:
            raise ValueError(f"attention_mask shape {mask.shape} does not match the prompt's {arr.shape}")
        if mask.dtype != bool and not np.isin(mask, (0, 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (or booleans)")
        mask = mask.astype(bool)
        for b in range(B):
            idx = np.flatnonzero(mask[b])
            if idx.size == 0:
                raise ValueError(f"attention_mask row {b} has no real token")
            if idx[-1] - idx[0] + 1 != idx.size:
                raise ValueError(f"attention_mask row {b} is not one contiguous run of ones (left or right padding "
                                 "only)")
            rows.append(arr[b, idx[0]:idx[-1] + 1].tolist())
        return rows
    lens = np.asarray(prompt_lengths)
    if lens.shape != (B,) or (lens.size and not np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"prompt_lengths must be {B} integers (one per row), got {lens.dtype}{list(lens.shape)}")
    for b, n in enumerate(lens):
        if not 1 <= int(n) <= T:
            raise ValueError(f"prompt_lengths[{b}] = {int(n)} outside 1..{T} (the padded prompt's width)")
    return [arr[b, :int(n)].tolist() for b, n in enumerate(lens)]


def prepare_prompt(prompt, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int [B, T] array or list of token lists -> (right-padded [B, Tp] int32, lengths [B]); validates ids.

    Tp is the length bucket of the longest row (`prompt_bucket`)."""
    if isinstance(prompt, (np.ndarray, jax.Array)) or (
            isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (list, tuple, np.ndarray))):
        arr = np.asarray(prompt)
        if arr.ndim == 1:
            raise ValueError(f"prompt must be int [B, T] or a list of token lists, got a 1-D array of shape "
                             f"{arr.shape} (wrap a single prompt in a list)")
        if arr.ndim != 2:
            raise ValueError(f"prompt must be int [B, T], got shape {arr.shape}")
        rows = list(arr)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt token ids must be integers, got dtype {arr.dtype}")
    else:
        rows = [r if isinstance(r, np.ndarray) else list(r) for r in prompt]
    if not rows:
        raise ValueError("empty prompt: the batch has no rows")
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    if (lens == 0).any():
        raise ValueError(f"empty prompt: row {int(np.argmax(lens == 0))} has no tokens")
    # Vectorised checks (a 40,000-row batch is validated in milliseconds, not a Python loop per token); the loop in
    # `_first_bad_token` runs only to name the offending token when a check fails.
    ids = _int_token_ids(rows, int(lens.sum()))
    if ids is None or ((ids < 0) | (ids >= vocab_size)).any():
        _first_bad_token(rows, vocab_size)
    B, Tp = len(rows), prompt_bucket(int(lens.max()))
    starts = np.cumsum(lens) - lens
    padded = np.zeros((B, Tp), np.int32)
    padded[np.repeat(np.arange(B), lens), np.arange(ids.size) - np.repeat(starts, lens)] = ids
    return padded, lens.astype(np.int32)


def _int_token_ids(rows, total: int) -> np.ndarray | None:
    """Every row's ids, concatenated, as int64; None when one is not an integer (bools are not) or overflows."""
    types = set(map(type, itertools.chain.from_iterable(rows)))
    if not all(issubclass(t, (int, np.integer)) and not issubclass(t, bool) for t in types):
        return None
    try:
        return np.fromiter(itertools.chain.from_iterable(rows), np.int64, total)
    except OverflowError:
        return None


def _first_bad_token(rows, vocab_size: int) -> None:
    """Raises the error that names the first id that is not an integer or lies outside the vocabulary."""
    for b, r in enumerate(rows):
        for t, tok in enumerate(r):
            if not isinstance(tok, (int, np.integer)) or isinstance(tok, bool):
                raise ValueError(f"token ids must be integers, got {tok!r} at row {b}, position {t}")
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"token id {int(tok)} at row {b}, position {t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    raise AssertionError("no bad token found")  # unreachable: the caller found one


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


def _cache_len(longest: int, out_len: int, extra: int, limit: int) -> int:
    """Cache slots for a program: the `cache_bucket` of the longest prompt + the budget bucket + the `extra` slots
    the last verify writes past the committed text, capped by the context limit; the loop program is keyed on it.
    (The scatter drops out-of-range writes, so the extra room only keeps those slots, never decides correctness.)"""
    return min(cache_bucket(longest + out_len + extra), _round_up(limit + extra, 64))


def _warn_short_drafter_context(drafter: Drafter, longest: int) -> None:
    limit = drafter.config.model.max_position_embeddings
    if longest > limit:
        warnings.warn(f"context of up to {longest} tokens exceeds the drafter's max_position_embeddings ({limit}): "
                      "acceptance may degrade (output stays exact)", stacklevel=3)


EOS_WIDTH = 8  # EOS ids are padded to this many (more ids: the next power of two), so EOS sets share a program


def default_eos_ids(target: Target) -> tuple[int, ...]:
    """The EOS id(s) of the target's config (`eos_token_id`), () when it has none."""
    eos = target.config.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _eos_tuple(eos_ids, vocab_size) -> tuple[int, ...]:
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
    """One generation call as `generate` prepares it on the host: the prefill program, then the loop program."""

    name: str  # "speculative" | "autoregressive" (the loop program)
    args: tuple  # (target, drafter | None, prompt [B, Tp], lens [B], keys [B, 2], SamplingParams, Budget)
    prefill_static: dict  # static keyword arguments of prefill: cache bucket, stamp, backend, mesh
    loop_static: dict  # static keyword arguments of the loop: budget bucket, draft length, backend, mesh, live_length
    max_new: int
    draft_length: int
    eos: tuple[int, ...]
    batch: int = 0  # rows the caller gave (the programs run a batch bucket: inert padding rows after them)
    prompts: tuple = ()  # the caller's rows (real tokens), for return_prompt
    return_prompt: bool = False

    @property
    def static(self) -> dict:
        """Every static argument of both programs (the keys `generate` compiles under, with the shapes)."""
        return {**self.prefill_static, **self.loop_static}

    @property
    def prefill_program(self):
        return _program("prefill")

    @property
    def loop_program(self):
        return _program(self.name)

    @property
    def unjitted(self):
        """Prefill then the loop as one plain function of `args`, static arguments bound (to inspect the jaxpr)."""
        loop_fn = _speculative_loop if self.name == "speculative" else _autoregressive_loop
        pst = {k: v for k, v in self.prefill_static.items() if k != "backend"}
        lst = {k: v for k, v in self.loop_static.items() if k not in ("backend", "live_length")}

        def fn(target, drafter, prompt, lens, keys, sampling, budget):
            pre = _prefill_program(target, drafter, prompt, lens, **pst)
            cpu_loop = self.loop_static.get("live_length", False)
            with live_length_loop(cpu_loop), dense_kernel_scope(cpu_loop):
                return loop_fn(target, drafter, pre, keys, sampling, budget, **lst)
        return fn

    def run_prefill(self, *args):
        target, drafter, prompt, lens = (args or self.args)[:4]
        return self.prefill_program(target, drafter, prompt, lens, **self.prefill_static)

    def run_loop(self, pre, *args):
        """The loop program on prefill's handoff `pre` (donated: `pre` is consumed)."""
        target, drafter, _, _, keys, sampling, budget = args or self.args
        with warnings.catch_warnings():  # logits and lengths have no output to alias (only the caches do)
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self.loop_program(target, drafter, pre, keys, sampling, budget, **self.loop_static)

    def __call__(self, *args):
        """Both programs, dispatched back to back (the handoff stays on device): (out, n_out, acc, steps)."""
        return self.run_loop(self.run_prefill(*args), *args)[:4]

    def lower(self) -> tuple:
        """(prefill, loop) lowered for these arguments (prefill runs once here to give the loop its input)."""
        target, drafter, prompt, lens, keys, sampling, budget = self.args
        pre_low = self.prefill_program.lower(target, drafter, prompt, lens, **self.prefill_static)
        pre = self.run_prefill()
        loop_low = self.loop_program.lower(target, drafter, pre, keys, sampling, budget, **self.loop_static)
        return pre_low, loop_low

    def compiled_text(self) -> str:
        """The optimized HLO of both programs, prefill first."""
        return "\n".join(low.compile().as_text() for low in self.lower())


def _sampling_params(sampling, temperature, top_k, top_p, p_min, draft_sampling) -> SamplingParams:
    """The keywords, or a `SamplingParams` given as `sampling=` (then the keywords must stay at their defaults)."""
    if sampling is None:
        return SamplingParams.make(temperature, top_k, top_p, p_min, draft_sampling)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a dflash_jax.SamplingParams, got {type(sampling).__name__}")
    given = {k: v for k, v, d in (("temperature", temperature, 0.0), ("top_k", top_k, 0), ("top_p", top_p, 1.0),
                                  ("p_min", p_min, 0.0), ("draft_sampling", draft_sampling, "sample")) if v != d}
    if given:
        raise ValueError(f"give sampling settings either as sampling= or as keywords, not both (got sampling= and "
                         f"{sorted(given)})")
    # greedy is derived from the temperature here (a SamplingParams built by hand may carry the default flag)
    return SamplingParams.make(sampling.temperature, sampling.top_k, sampling.top_p, sampling.p_min,
                               sampling.draft_sampling)


def _as_compiled(model):
    """A model as its programs take it (`models.drafter.as_compiled` for a drafter; a target's arrays committed to
    its device), so that equal models compile once whatever way they were built."""
    if model is None:
        return None
    return as_compiled(model) if isinstance(model, Drafter) else committed(model)


def _prepare(name, target, drafter, prompt, *, max_new_tokens, draft_length, temperature, eos_ids, seed, top_k,
             top_p, p_min, draft_sampling, max_cache_len, nvfp4_backend, prefill_timing, sampling=None,
             attention_mask=None, prompt_lengths=None, return_prompt=False) -> ProgramCall:
    if prefill_timing not in ("stamp", "rerun"):
        raise ValueError(f"prefill_timing must be 'stamp' or 'rerun', got {prefill_timing!r}")
    sampling = _sampling_params(sampling, temperature, top_k, top_p, p_min, draft_sampling)
    models = (target,) if drafter is None else (target, drafter)
    mesh = shd.models_mesh(*models)  # refuses a pair on different meshes, or a mesh that cannot split a model
    padded, lens = prepare_prompt(_unpad(prompt, attention_mask, prompt_lengths), target.config.vocab_size)
    limit = _check_budget(target, lens, max_new_tokens, max_cache_len)
    eos = _eos_tuple(default_eos_ids(target) if eos_ids is None else eos_ids, target.config.vocab_size)
    out_len = bucket(int(max_new_tokens), BUDGET_BUCKET_MIN)
    # A host callback in a program spanning several processes would run in each of them: time prefill by a rerun.
    stamp = prefill_timing == "stamp" and (mesh is None or jax.process_count() == 1)
    backend = program_backend(*models, backend=nvfp4_backend)
    extra = 1 if drafter is None else draft_length + 1
    prefill_static = dict(cache_len=_cache_len(int(lens.max()), out_len, extra, limit), stamp=stamp,
                          backend=backend, mesh=mesh)
    loop_static = dict(out_len=out_len, backend=backend, mesh=mesh,
                       live_length=uses_live_length_loop(_mesh_platform(mesh)))
    if drafter is not None:
        loop_static["draft_length"] = int(draft_length)
    budget = Budget(max_new=np.int32(max_new_tokens), max_steps=np.int32(int(max_new_tokens) - 1),
                    eos=_eos_array(eos))
    batch = len(lens)
    # The batch is bucketed, and on a mesh it goes along "data": padded to a multiple of the axis too. Padding rows
    # are inert (length 0: done from the start, see `_init_state`); every row's key comes from its own stream, so
    # real rows draw the same whatever the padding.
    rows = batch_bucket(batch)
    if mesh is not None:
        rows = _round_up(rows, int(mesh.shape["data"]))
    prompts = tuple(tuple(int(t) for t in padded[b, :n]) for b, n in enumerate(lens)) if return_prompt else ()
    padded = np.concatenate([padded, np.zeros((rows - batch, padded.shape[1]), np.int32)])
    lens = np.concatenate([lens, np.zeros((rows - batch,), np.int32)])
    keys = _row_keys(seed, rows)
    sampling = sampling.as_arrays()
    if mesh is not None:
        padded, lens, keys = (shd.place(x, shd.batch_sharding(mesh, x.ndim)) for x in (padded, lens, keys))
        sampling, budget = shd.place_tree((sampling, budget), shd.replicated(mesh))
    args = (_as_compiled(target), _as_compiled(drafter), padded, lens, keys, sampling, budget)
    return ProgramCall(name, args, prefill_static, loop_static, int(max_new_tokens),
                       0 if drafter is None else int(draft_length), eos, batch, prompts, bool(return_prompt))


def _host(x) -> np.ndarray:
    """A program result on the host; with several processes, results are replicated and read from a local copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))


def _with_prompts(prompts, out: np.ndarray, n_out: np.ndarray) -> np.ndarray:
    """[B, longest prompt + N]: each row's prompt, its new tokens, then PAD (HF's `generate` output, unpadded)."""
    N = out.shape[1]
    full = np.full((len(prompts), max(len(p) for p in prompts) + N), PAD, np.int32)
    for b, p in enumerate(prompts):
        full[b, :len(p)] = p
        full[b, len(p):len(p) + int(n_out[b])] = out[b, :int(n_out[b])]
    return full


def _run(call: ProgramCall) -> GenerationResult:
    """Runs both programs and times them. Prefill and the loop are dispatched back to back; each dispatch traces and
    compiles first when needed (synchronously, timed apart by jax.monitoring), while execution is asynchronous, so:
    prefill runs from the end of its compile to the stamp; the loop from the later of the stamp and the end of its
    own dispatch (a compile of the loop may overlap prefill's execution) to the end."""
    _compile_clock.seconds = 0.0
    _STAMPS["prefill_done"] = None
    t0 = time.perf_counter()
    pre = call.run_prefill()
    compile_prefill = _compile_clock.seconds
    out, n_out, acc, steps, _ = call.run_loop(pre)
    t_loop = time.perf_counter()  # the loop is dispatched (and compiled, if it had to be)
    out, n_out, acc, steps = jax.block_until_ready((out, n_out, acc, steps))
    t1 = time.perf_counter()
    compile_s = _compile_clock.seconds
    t_start = min(t0 + compile_prefill, t1)  # prefill execution starts once it is traced and compiled
    if call.prefill_static["stamp"]:
        t_prefill = _STAMPS["prefill_done"] if _STAMPS["prefill_done"] is not None else t_start
    else:  # prefill timed by running the (compiled, callback-free) prefill program once more on its own
        r0 = time.perf_counter()
        jax.block_until_ready(call.run_prefill())
        t_prefill = t_start + (time.perf_counter() - r0)
    t_prefill = min(t_prefill, t1)
    t_decode = min(max(t_prefill, t_loop if compile_s > compile_prefill else t_prefill), t1)
    out, n_out, acc, steps = map(_host, (out, n_out, acc, steps))
    steps = int(steps)
    B = call.batch or out.shape[0]  # padding rows (batch bucket, mesh's data axis) never reach the result
    out, n_out, acc = out[:B, :call.max_new], n_out[:B], acc[:B, :steps]
    last = np.take_along_axis(out, np.maximum(n_out - 1, 0)[:, None].astype(np.int64), axis=1)[:, 0]
    ended = (n_out > 0) & np.isin(last, np.asarray(call.eos, np.int64))
    reasons = tuple(np.where(ended, "eos", "length").tolist())
    timings = {"prefill_s": t_prefill - t_start, "decode_s": t1 - t_decode,
               "total_s": (t_prefill - t_start) + (t1 - t_decode), "compile_s": compile_s}
    lens = np.asarray(call.args[3] if not isinstance(call.args[3], jax.Array) else _host(call.args[3]))[:B]
    if call.return_prompt:
        out = _with_prompts(call.prompts, out, n_out)
    return GenerationResult(tokens=out, num_tokens=n_out, acceptance_lengths=acc, finish_reason=reasons,
                            num_steps=steps, draft_length=call.draft_length, timings=timings,
                            prompt_lengths=lens.astype(np.int32), includes_prompt=call.return_prompt)


def _draft_length(drafter: Drafter, draft_length) -> int:
    bs = drafter.config.block_size
    D = bs - 1 if draft_length is None else draft_length
    if not isinstance(D, (int, np.integer)) or isinstance(D, bool) or not 1 <= D <= bs - 1:
        raise ValueError(f"draft_length must be in 1..block_size-1 = 1..{bs - 1}, got {draft_length!r}")
    return int(D)


def speculative_call(target: Target, drafter: Drafter, prompt, *, max_new_tokens: int,
                     draft_length: int | None = None, temperature: float = 0.0,
                     eos_ids: Sequence[int] | None = None, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                     p_min: float = 0.0, draft_sampling: str = "sample", max_cache_len: int | None = None,
                     nvfp4_backend: str | None = None, prefill_timing: str = "stamp",
                     sampling: SamplingParams | None = None, attention_mask=None, prompt_lengths=None,
                     return_prompt: bool = False) -> ProgramCall:
    """What `generate` runs, prepared and validated on the host but not run (tests, benchmarks, inspection)."""
    check_pair(drafter.config, target.config)
    D = _draft_length(drafter, draft_length)
    call = _prepare("speculative", target, drafter, prompt, max_new_tokens=max_new_tokens, draft_length=D,
                    temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p, p_min=p_min,
                    draft_sampling=draft_sampling, max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                    prefill_timing=prefill_timing, sampling=sampling, attention_mask=attention_mask,
                    prompt_lengths=prompt_lengths, return_prompt=return_prompt)
    _warn_short_drafter_context(drafter, int(np.max(_host(call.args[3]))) + int(max_new_tokens))
    return call


def autoregressive_call(target: Target, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                        eos_ids: Sequence[int] | None = None, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                        max_cache_len: int | None = None, nvfp4_backend: str | None = None,
                        prefill_timing: str = "stamp", sampling: SamplingParams | None = None,
                        attention_mask=None, prompt_lengths=None, return_prompt: bool = False) -> ProgramCall:
    """What `generate_autoregressive` runs, prepared on the host but not run."""
    if sampling is not None and (sampling.p_min != 0.0 or sampling.draft_sampling != "sample"):
        raise ValueError("p_min and draft_sampling are speculative settings: autoregressive decoding takes neither")
    return _prepare("autoregressive", target, None, prompt, max_new_tokens=max_new_tokens, draft_length=0,
                    temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p, p_min=0.0,
                    draft_sampling="sample", max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                    prefill_timing=prefill_timing, sampling=sampling, attention_mask=attention_mask,
                    prompt_lengths=prompt_lengths, return_prompt=return_prompt)


_CONVENTIONS_DOC = """
    Calling conventions (both generators):
      eos_ids: None (default) = the target config's `eos_token_id`; () = no EOS; or an id / ids. Generation of a row
        stops after its first EOS (the EOS is emitted).
      attention_mask: with a padded int prompt [B, T], HF-style [B, T] 0/1 (left- or right-padded rows); or
        prompt_lengths [B] for a right-padded batch. Padding is never read as tokens: each row's result is the one
        it gets alone (greedy). A list of token lists needs neither.
      sampling: a `SamplingParams` (`SamplingParams(temperature=0.7, top_p=0.9)`) instead of the keywords.
      return_prompt: `tokens` holds prompt + new tokens per row (HF-like, no padding before the new tokens);
        `result.decode(tokenizer)` gives one string per row.
      Batches run in a batch bucket (`batch_bucket`) with inert padding rows; prefill and the loop are two compiled
      programs (a new prompt-length bucket recompiles prefill only).
"""


def generate(target: Target, drafter: Drafter, prompt, *, max_new_tokens: int, draft_length: int | None = None,
             temperature: float = 0.0, eos_ids: Sequence[int] | None = None, seed: int = 0, top_k: int = 0,
             top_p: float = 1.0, p_min: float = 0.0, draft_sampling: str = "sample",
             max_cache_len: int | None = None, nvfp4_backend: str | None = None,
             prefill_timing: str = "stamp", sampling: SamplingParams | None = None, attention_mask=None,
             prompt_lengths=None, return_prompt: bool = False) -> GenerationResult:
    """DFlash speculative generation: a prefill program, then one `lax.while_loop` program.

    prompt: int [B, T] or a list of token lists (rows may differ in length). Greedy (temperature 0) output equals
    `generate_autoregressive` token for token; at temperature > 0 rejection sampling keeps the target's distribution.
    nvfp4_backend: for NVFP4 weights (`dflash_jax.quant.linear`); None = the current default, resolved now, per call.
    prefill_timing: "stamp" = one host callback marks the end of prefill (such a prefill program never enters JAX's
    persistent compilation cache); "rerun" = no callback, prefill is timed by running the compiled prefill program
    once more (what the CLI and benchmarks use, with the persistent cache on; also what a mesh spanning several
    processes gets).

    Sharded models (`dflash_jax.parallel.sharding.shard`, or `load_target(..., mesh=)`): the prompt batch goes along the mesh's
    "data" axis (padded with inert rows when the axis does not divide it); the tokens are those of one device.
    """
    return _run(speculative_call(target, drafter, prompt, max_new_tokens=max_new_tokens, draft_length=draft_length,
                                 temperature=temperature, eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p,
                                 p_min=p_min, draft_sampling=draft_sampling, max_cache_len=max_cache_len,
                                 nvfp4_backend=nvfp4_backend, prefill_timing=prefill_timing, sampling=sampling,
                                 attention_mask=attention_mask, prompt_lengths=prompt_lengths,
                                 return_prompt=return_prompt))


def generate_autoregressive(target: Target, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                            eos_ids: Sequence[int] | None = None, seed: int = 0, top_k: int = 0,
                            top_p: float = 1.0, max_cache_len: int | None = None, nvfp4_backend: str | None = None,
                            prefill_timing: str = "stamp", sampling: SamplingParams | None = None,
                            attention_mask=None, prompt_lengths=None, return_prompt: bool = False
                            ) -> GenerationResult:
    """Plain decoding with the same target, stopping rules, conventions and result type (prefill + one loop)."""
    return _run(autoregressive_call(target, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                    eos_ids=eos_ids, seed=seed, top_k=top_k, top_p=top_p,
                                    max_cache_len=max_cache_len, nvfp4_backend=nvfp4_backend,
                                    prefill_timing=prefill_timing, sampling=sampling,
                                    attention_mask=attention_mask, prompt_lengths=prompt_lengths,
                                    return_prompt=return_prompt))


generate.__doc__ += _CONVENTIONS_DOC
generate_autoregressive.__doc__ += _CONVENTIONS_DOC
