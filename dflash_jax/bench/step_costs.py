"""What one step of the speculative loop costs, piece by piece: ms of one decode step (1 token), one verify (D+1
tokens) and one drafter call, timed in turns on donated caches, giving r = verify / decode and c = draft / decode
(the predicted speedup is tau / (r + c); next to the loop's measured ms per step, the rest is bookkeeping:
acceptance, commits, rollback). Each piece runs as generate's loop program runs it on this platform (NVFP4 backend,
attention rule), and `repeat` times inside one program (`repeated`), as the loop runs it: a program call of its own
pays a launch (flattening ~700 weight and cache buffers, ~1.7 ms on a 2-core CPU: a decode step timed alone read
6.0 ms, 4.3 ms a step when 16 ran in one program) that the loop pays once per request, and that launch had made
r and c the ratios of launch + step (a verify and a decode alike one launch: r too low; a draft one launch of its
own: c too high). Timings are never asserted anywhere: these machines are noisy, so read the medians.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dflash_jax.decode.buckets import uses_live_length_loop
from dflash_jax.decode.draft_step import draft_step
from dflash_jax.decode.prefill import prefill
from dflash_jax.decode.sampling import SamplingParams
from dflash_jax.models.attention import live_length_loop
from dflash_jax.models.drafter import Drafter, append_context, draft_block, empty_draft_cache
from dflash_jax.models.layers import first_argmax
from dflash_jax.models.target import KVCache, Target, commit_states, forward_with_cache
from dflash_jax.quant.linear import backend_scope, bf16_products_scope, cpu_kernel_scope, program_backend
from dflash_jax.quant.products import generation_bf16_products


def interleaved_ms(steps: dict, reps: int) -> dict:
    """{name: (step, state)} -> {name: median ms of state = step(state)}, the steps taking turns in each round, so a
    change of machine load during the run hits all of them alike (state threaded: steps may donate buffers). A `Step`
    that runs its piece `repeat` times in one program counts ms per piece."""
    states = {k: jax.block_until_ready(step(state)) for k, (step, state) in steps.items()}  # compile + warm up
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, (step, _) in steps.items():
            t0 = time.perf_counter()
            states[k] = jax.block_until_ready(step(states[k]))
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) / getattr(steps[k][0], "repeat", 1) for k, v in times.items()}


def repeated(one, state, inputs: tuple, repeat: int):
    """`one(state, *inputs)` -> (result, next state), run `repeat` times in one program (a `lax.fori_loop`, the last
    result returned), as generate's while loop runs a step. The inputs pass through an optimization barrier with the
    carried state every time, so XLA cannot hoist what depends on them alone (the embedding of the verified tokens,
    the drafter's context projection) out of the loop; the weights are loop-invariant here as in generate's loop."""
    if repeat == 1:
        return one(state, *inputs)

    def body(_, carry):
        state, inputs, _ = lax.optimization_barrier(carry)
        result, state = one(state, *inputs)
        return state, inputs, result

    shapes = jax.eval_shape(one, state, *inputs)[0]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    state, _, result = lax.fori_loop(0, repeat, body, (state, tuple(inputs), zeros))
    return result, state


@dataclasses.dataclass(frozen=True)
class Step:
    """One step program on its state: `step(state)` -> the next state (the state, a cache, is donated);
    `compiled_text(state)` -> its optimized HLO (what `bench.profile` reads). The program runs its piece `repeat`
    times (its last static argument, `repeated`)."""

    program: object  # a jitted function: program(*before, state, *after, repeat) -> (result, next state)
    before: tuple
    after: tuple
    repeat: int = 1

    def __call__(self, state):
        return self.program(*self.before, state, *self.after, self.repeat)[1]

    def compiled_text(self, state) -> str:
        return self.program.lower(*self.before, state, *self.after, self.repeat).compile().as_text()


def step_functions(target: Target, drafter: Drafter, *, context_len: int = 64, draft_length: int | None = None,
                   batch: int = 1, seed: int = 0, cache_len: int | None = None, repeat: int = 1) -> dict:
    """{"decode_ms" | "verify_ms" | "draft_ms": (step, state)}: one decode step (1 token), one verify (D+1 tokens)
    and one drafter call on caches holding `context_len` live tokens in `cache_len` slots (default: just enough),
    each `repeat` times in one program (`repeated`). Each step runs on donated caches and rolls its lengths back, as
    a rejected step does, so every repetition sees the same context."""
    dcfg = drafter.config
    D = dcfg.block_size - 1 if draft_length is None else draft_length
    tcfg = target.config
    cache_len = context_len + dcfg.block_size + 64 if cache_len is None else cache_len
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, tcfg.vocab_size, (batch, context_len)), jnp.int32)
    lens = jnp.full((batch,), context_len, jnp.int32)
    layer_ids = dcfg.target_layer_ids
    fill = jax.jit(prefill, static_argnums=(3,))

    _, feats, tcache, dcache = fill(target, prompt, lens, cache_len, drafter=drafter)
    pending = feats[:, :D + 1]

    tok = prompt[:, -1:]
    toks = prompt[:, -(D + 1):]
    block = draft_block(drafter, prompt[:, -1], D)  # as generate's loop drafts
    _, _, tcache2, _ = fill(target, prompt, lens, cache_len, drafter=drafter)  # decode and verify donate theirs
    tb, db = program_backend(target), program_backend(drafter, target)
    return {"decode_ms": (Step(_decode_rolled_back, (target,), (tok, tb), repeat), tcache),
            "verify_ms": (Step(_verify_rolled_back, (target,), (toks, layer_ids, tb), repeat), tcache2),
            "draft_ms": (Step(_draft_rolled_back, (drafter, target), (pending, block, D, db), repeat), dcache),
            "_meta": dict(context_len=context_len, draft_length=D, batch=batch, cache_len=cache_len, repeat=repeat,
                          state_bytes_per_row=tcache.state_bytes_per_row())}  # a hybrid target's DeltaNet states


STEPS_PER_PROGRAM = 16  # pieces per timed program in the step table (`repeated`): launch / 16 is ~0.1 ms


def step_costs(target: Target, drafter: Drafter, *, context_len: int = 64, draft_length: int | None = None,
               batch: int = 1, reps: int = 30, seed: int = 0, cache_len: int | None = None,
               repeat: int = STEPS_PER_PROGRAM) -> dict:
    """ms per decode step, verify and draft at a given context length (see `step_functions`; each piece `repeat`
    times in one program), and r, c."""
    fns = step_functions(target, drafter, context_len=context_len, draft_length=draft_length, batch=batch, seed=seed,
                         cache_len=cache_len, repeat=repeat)
    meta = fns.pop("_meta")
    out = interleaved_ms(fns, reps)
    out["r"] = out["verify_ms"] / out["decode_ms"]
    out["c"] = out["draft_ms"] / out["decode_ms"]
    out.update(meta)
    return out


def greedy_draft(drafter: Drafter, target: Target, dcache: KVCache, pending: jax.Array, block: jax.Array, D: int):
    """One greedy draft call as generate's loop makes it: append the D+1 pending context features [B, D+1, K*H],
    then the loop's own `draft_step` (one block pass; DFlash: argmax of the logits, DFlash2: the selector walk).
    -> (drafts [B, D] int32, the draft cache after the append). Callers return only the drafts, so XLA drops what
    the loop would also build for verification (the DFlash2 selector's q on the vocabulary)."""
    B = block.shape[0]
    dc = append_context(drafter, pending, jnp.full((B,), D + 1, jnp.int32), dcache)
    keys = jnp.zeros((B, 2), jnp.uint32)  # greedy: no draw is made
    drafts, _, _, _ = draft_step(drafter, target, block, dc, D, keys, SamplingParams())
    return drafts, dc


@contextlib.contextmanager
def _as_in_the_loop(backend):
    """What generate's loop program is traced under on this platform: the NVFP4 backend, the attention rule (the
    live-length loop on CPU, static trip counts on accelerators) and the products (generation's default bfloat16
    ones where the CPU has them), so a step costs here what it costs there."""
    cpu = uses_live_length_loop()
    with (backend_scope(backend), live_length_loop(cpu), cpu_kernel_scope(cpu),
          bf16_products_scope(generation_bf16_products())):
        yield


# The step programs are module-level, so every `step_functions` / `draft_costs` call with the same shapes shares them
# (the target's decode and verify across drafters, e.g.); the NVFP4 backend is a static argument, as in generate.


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=(1,))
def _decode_rolled_back(target, tcache, tok, backend, repeat=1):
    """One decode step (1 token) on a donated cache whose lengths are rolled back, as a rejected step does."""
    def one(c, tok):
        with _as_in_the_loop(backend):
            logits, _, c2 = forward_with_cache(target, tok, c)
        return first_argmax(logits), c2.replace(lengths=c.lengths)

    return repeated(one, tcache, (tok,), repeat)


@functools.partial(jax.jit, static_argnums=(3, 4, 5), donate_argnums=(1,))
def _verify_rolled_back(target, tcache, toks, layer_ids, backend, repeat=1):
    """One verify (D+1 tokens, tapped features) on a donated cache whose lengths are rolled back. A hybrid target's
    DeltaNet states are deferred and committed as the loop does (here keeping one token: a rejection at slot 1)."""
    def one(c, toks):
        with _as_in_the_loop(backend):
            hybrid = target.config.is_hybrid
            logits, feats, c2 = forward_with_cache(target, toks, c, layer_ids, defer_states=hybrid)
            if hybrid:
                c2 = commit_states(c2, jnp.ones(toks.shape[:1], jnp.int32), target.config)
        return (first_argmax(logits), feats), c2.replace(lengths=c.lengths)

    return repeated(one, tcache, (toks,), repeat)


@functools.partial(jax.jit, static_argnums=(5, 6, 7), donate_argnums=(2,))
def _draft_rolled_back(drafter, target, dcache, pending, block, D, backend, repeat=1):
    """`greedy_draft` on a donated draft cache whose lengths are rolled back."""
    def one(dc, pending, block):
        with _as_in_the_loop(backend):
            tokens, dc2 = greedy_draft(drafter, target, dc, pending, block, D)
        return tokens, dc2.replace(lengths=dc.lengths)

    return repeated(one, dcache, (pending, block), repeat)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _draft_only(drafter, target, dcache, pending, block, D, backend):
    """`greedy_draft`'s drafts alone (the cache is not donated: `draft_costs` reuses it every repetition)."""
    with _as_in_the_loop(backend):
        return greedy_draft(drafter, target, dcache, pending, block, D)[0]


def draft_costs(target: Target, drafters: dict, *, context_len: int = 64, draft_length: int = 7, batch: int = 1,
                reps: int = 30, seed: int = 0, clock: str = "wall") -> dict:
    """ms of one drafter call for each drafter and of one target decode step, timed interleaved (A, B, A, B, ...)
    so that load changes hit every drafter alike; c = draft / decode per drafter. Drafters may differ in kind,
    block size and layers, but must share the target's taps (the first drafter's are used for the context).
    clock="cpu" times this process's CPU seconds instead of wall seconds (steadier on a shared machine)."""
    now = {"wall": time.perf_counter, "cpu": time.process_time}[clock]
    first = next(iter(drafters.values()))
    tcfg, D = target.config, draft_length
    cache_len = context_len + max(d.config.block_size for d in drafters.values()) + 64
    prompt = jnp.asarray(np.random.default_rng(seed).integers(0, tcfg.vocab_size, (batch, context_len)), jnp.int32)
    taps = first.config.target_layer_ids
    if any(d.config.target_layer_ids != taps for d in drafters.values()):
        raise ValueError("draft_costs: all drafters must tap the same target layers")
    _, feats, tcache = jax.jit(lambda t, p: forward_with_cache(t, p, KVCache.empty(tcfg, batch, cache_len), taps))(
        target, prompt)

    @jax.jit
    def decode(target, tcache, tok):
        with _as_in_the_loop(program_backend(target)):
            logits, _, c = forward_with_cache(target, tok, tcache)
        return first_argmax(logits), c.lengths

    calls = {"decode": (decode, (target, tcache, prompt[:, -1:]))}
    for name, d in drafters.items():
        dcache = jax.jit(lambda d, f: append_context(d, f, jnp.full((batch,), context_len, jnp.int32),
                                                     empty_draft_cache(d.config, batch, cache_len)))(d, feats)
        block = draft_block(d, prompt[:, -1], D)
        calls[name] = (_draft_only, (d, target, dcache, feats[:, :D + 1], block, D, program_backend(d, target)))
    for fn, args in calls.values():  # compile + warm up
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, (fn, args) in calls.items():
            t0 = now()
            jax.block_until_ready(fn(*args))
            times[name].append(now() - t0)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    out = {"decode_ms": ms.pop("decode"), "context_len": context_len, "draft_length": D, "batch": batch,
           "clock": clock}
    out["draft_ms"] = ms
    out["c"] = {name: v / out["decode_ms"] for name, v in ms.items()}
    return out


def format_step_costs(c: dict, tau: float | None = None, measured_step_ms: float | None = None) -> str:
    s = (f"context {c['context_len']}, batch {c['batch']}, draft length {c['draft_length']}: "
         f"decode(1 tok) {c['decode_ms']:.2f} ms | verify({c['draft_length'] + 1} tok) {c['verify_ms']:.2f} ms | "
         f"draft {c['draft_ms']:.2f} ms | r = {c['r']:.2f}, c = {c['c']:.2f}")
    if measured_step_ms is not None:
        book = measured_step_ms - c["verify_ms"] - c["draft_ms"]
        s += f"\nloop: {measured_step_ms:.2f} ms/step = draft + verify + bookkeeping {book:.2f} ms"
    if tau is not None:
        s += f"\ntau {tau:.2f}: predicted speedup tau/(r+c) = {tau / (c['r'] + c['c']):.2f}x"
    return s


def format_draft_costs(c: dict) -> str:
    names = list(c["draft_ms"])
    s = (f"draft cost at context {c['context_len']}, draft length {c['draft_length']}, batch {c['batch']} "
         f"(decode(1 tok) {c['decode_ms']:.2f} ms; interleaved medians of {c.get('clock', 'wall')} time): "
         + ", ".join(f"{n} {c['draft_ms'][n]:.2f} ms (c = {c['c'][n]:.3f})" for n in names))
    if len(names) == 2:
        a, b = names
        s += f"\n{b} / {a} draft cost c ratio: {c['c'][b] / c['c'][a]:.3f}"
    return s


__all__ = ["interleaved_ms", "repeated", "STEPS_PER_PROGRAM", "step_functions", "step_costs", "greedy_draft",
           "draft_costs", "format_step_costs",
           "format_draft_costs"]
