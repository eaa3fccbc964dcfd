"""Training data at the machine's rate: a batch of rows decodes the target's answers, and a row that finishes is
refilled with the next prompt while the others keep decoding; the tapped target features come out of the same
forward passes (no second pass over the finished sequences).

Programs (each jitted once per shape bucket; the state is donated, so the caches are updated in place):
  refill  r rows (r a power of two <= max_refill) get new prompts: the prompts [r, Tp] (Tp a multiple of
          `prompt_multiple`) are prefilled into a fresh r-row cache of Tp slots, whose K/V are then written into
          those rows' slots 0..Tp-1 of the batch cache; the prompt features go to the rows' feature buffers, the first
          answer token is chosen from the last prompt token's logits. Lengths are explicit per row, so a refilled row
          never sees the old row's entries (attention reads only slots below the row's length).
  decode  a `lax.while_loop` of up to K steps: every live row runs its last token through the target (writing its
          K/V and its features at its own position) and chooses the next one (greedy, or sampled at the row's
          temperature). It returns to the host after K steps, or as soon as `exit_after` rows have finished during
          the call (so finished rows idle at most until the next refill), or when no row is live.
  gather  the token and feature buffers of finished rows, for the host.

A row's answer ends at an EOS id or at the token budget; that last token is still run through the target once (one
extra row-step per answer), so every position of prompt + answer has its features, as `target_features` gives them.
Randomness is per prompt (its own key, `prompt_key`), so an answer does not depend on the row or the batch it ran in.
Dense targets only (a hybrid's DeltaNet states cannot be reset by a length).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Iterator

import chex
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.sampling import SamplingParams, sample_tokens
from dflash_jax.models.layers import first_argmax, write_kv
from dflash_jax.models.target import KVCache, Target, forward_with_cache


@dataclasses.dataclass(frozen=True)
class RefillSettings:
    """How answers are generated (`max_new_tokens`, `eos_ids`, `layer_ids` decide the data) and how the batch runs
    (the rest only changes speed)."""

    layer_ids: tuple[int, ...]  # target layers whose outputs are the features (the drafter's taps)
    eos_ids: tuple[int, ...]  # an answer ends after the first of these
    max_new_tokens: int = 256  # answer budget (tokens, EOS included)
    max_prompt_tokens: int = 96  # longest prompt accepted; the cache holds max_prompt_tokens + max_new_tokens slots
    rows: int = 64  # rows decoding together
    steps: int = 32  # K: decode steps per program call at most (a host return at least every K steps)
    refill_min: int = 4  # the decode call returns once this many rows finished (while prompts remain)
    max_refill: int = 16  # rows per refill program call at most (bigger refills are split)
    prompt_multiple: int = 32  # refill prompts are padded to a multiple of this (few buckets: few compiles)
    feature_dtype: str = "float16"

    def __post_init__(self):
        for name in ("max_new_tokens", "max_prompt_tokens", "rows", "steps", "refill_min", "max_refill",
                     "prompt_multiple"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"RefillSettings.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.layer_ids:
            raise ValueError("RefillSettings.layer_ids: at least one tap layer is needed (the features)")

    @property
    def seq_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens

    def replace(self, **changes) -> "RefillSettings":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Job:
    """One prompt of the queue: its index in the prompt source, ids, temperature (0 = greedy) and key [2] uint32."""

    index: int
    ids: tuple[int, ...]
    temperature: float
    key: np.ndarray


@dataclasses.dataclass(frozen=True)
class Answer:
    index: int  # the job's index
    tokens: np.ndarray  # [L] int32 prompt + answer
    prompt_len: int
    features: np.ndarray  # [L, K*H] feature_dtype, every position


@dataclasses.dataclass
class RefillStats:
    """Counters of one `generate_answers` run (mutable, filled as it goes)."""

    decode_calls: int = 0
    refill_calls: int = 0
    steps: int = 0  # decode steps run
    row_steps: int = 0  # rows x steps
    live_row_steps: int = 0  # of those, rows that were live (ran a token of an unfinished answer)
    answers: int = 0
    answer_tokens: int = 0


def prompt_keys(seed: int, indices) -> np.ndarray:
    """[n, 2] uint32: prompt i's stream is fold_in(key(seed), i) (as `generate_autoregressive` gives row i)."""
    base = jax.random.key(seed)
    idx = jnp.asarray(np.asarray(indices, np.int64).astype(np.uint32))
    return np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))(idx))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowState:
    cache: KVCache  # lengths == pos for live rows
    tokens: jax.Array  # [B, S] int32 prompt + answer so far (valid below pos + 1)
    feats: jax.Array  # [B, S, F] features (valid below pos; at pos too once the row is done)
    pos: jax.Array  # [B] int32 position of `last` (tokens before it are in the cache)
    last: jax.Array  # [B] int32 token to run next
    n_new: jax.Array  # [B] int32 answer tokens chosen so far (last included)
    final: jax.Array  # [B] bool: `last` ends the answer (EOS or budget); the row is done once it has run
    done: jax.Array  # [B] bool: nothing to run (finished, or never filled)
    temp: jax.Array  # [B] f32 temperature, 0 = greedy
    keys: jax.Array  # [B, 2] uint32

    def replace(self, **changes) -> "RowState":
        return dataclasses.replace(self, **changes)


def empty_state(target: Target, settings: RefillSettings) -> RowState:
    cfg = target.config
    if cfg.is_hybrid:
        raise ValueError("refill generation: hybrid targets (DeltaNet layers) are not supported: their recurrent "
                         "states cannot be reset by a length")
    B, S = settings.rows, settings.seq_len
    F = len(settings.layer_ids) * cfg.hidden_size
    z = functools.partial(jnp.zeros, (B,))
    return RowState(cache=KVCache.empty(cfg, B, S), tokens=jnp.zeros((B, S), jnp.int32),
                    feats=jnp.zeros((B, S, F), settings.feature_dtype), pos=z(dtype=jnp.int32),
                    last=z(dtype=jnp.int32), n_new=z(dtype=jnp.int32), final=z(dtype=bool),
                    done=jnp.ones((B,), bool), temp=z(dtype=jnp.float32), keys=jnp.zeros((B, 2), jnp.uint32))


def choose(logits: jax.Array, keys: jax.Array, temp: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [n, V], keys [n, 2], temp [n] -> (tokens [n], keys): argmax where temp == 0, else a sample at the
    row's temperature (`sample_tokens`, one draw per row: a greedy row's key does not move)."""
    sampled = temp > 0
    sp = SamplingParams(temperature=jnp.where(sampled, temp, 1.0)[:, None], greedy=False)
    drawn, new_keys = sample_tokens(logits, keys, sp)
    tokens = jnp.where(sampled, drawn, first_argmax(logits))
    return tokens, jnp.where(sampled[:, None], new_keys, keys)


def _ends(tokens: jax.Array, n_new: jax.Array, eos: tuple[int, ...], max_new: int) -> jax.Array:
    is_eos = jnp.isin(tokens, jnp.asarray(eos, jnp.int32)) if eos else jnp.zeros(tokens.shape, bool)
    return is_eos | (n_new >= max_new)


def _scatter_rows(big: KVCache, small: KVCache, rows: jax.Array) -> KVCache:
    """`big` with rows[i] slots 0..Tp-1 replaced by row i of `small` (every layer's keys and values, head-major
    [B, nKV, S, hd]); rows == B are dropped (padding of the refill set)."""

    def put(b, s):  # b [B, nKV, S, hd], s [r, nKV, Tp, hd]
        chex.assert_equal((b.shape[1], b.shape[3]), (s.shape[1], s.shape[3]))
        r, _, Tp, _ = s.shape
        cols = jnp.broadcast_to(jnp.arange(Tp, dtype=jnp.int32)[None, :], (r, Tp))
        return write_kv(b, jnp.swapaxes(s, 1, 2), cols, rows=rows[:, None])

    return big.replace(layers=tuple(e.replace(k=put(e.k, n.k), v=put(e.v, n.v))
                                    for e, n in zip(big.layers, small.layers)))


def _refill(target: Target, s: RowState, rows, prompts, plens, temps, keys, *, layer_ids, eos, max_new) -> RowState:
    """rows [r] (B = padding), prompts [r, Tp] right-padded, plens [r], temps [r], keys [r, 2]."""
    r, Tp = prompts.shape
    chex.assert_shape([rows, plens, temps], (r,))
    small = KVCache.empty(target.config, r, Tp)
    logits, f, small = forward_with_cache(target, prompts, small, layer_ids,
                                          logits_at=jnp.maximum(plens - 1, 0)[:, None], empty_cache=True)
    chex.assert_shape(f, (r, Tp, s.feats.shape[-1]))
    first, keys = choose(logits[:, 0], keys, temps)
    cols = jnp.arange(Tp, dtype=jnp.int32)[None, :]
    tokens = s.tokens.at[rows[:, None], cols].set(prompts, mode="drop").at[rows, plens].set(first, mode="drop")
    one = jnp.ones((r,), jnp.int32)

    def put(x, v):
        return x.at[rows].set(v, mode="drop")

    pos = put(s.pos, plens)
    return s.replace(cache=_scatter_rows(s.cache, small, rows).replace(lengths=pos), tokens=tokens,
                     feats=s.feats.at[rows[:, None], cols].set(f.astype(s.feats.dtype), mode="drop"), pos=pos,
                     last=put(s.last, first), n_new=put(s.n_new, one),
                     final=put(s.final, _ends(first, one, eos, max_new)),
                     done=put(s.done, jnp.zeros((r,), bool)), temp=put(s.temp, temps), keys=put(s.keys, keys))


def _step(target: Target, s: RowState, *, layer_ids, eos, max_new) -> RowState:
    """One token per live row: run `last` (K/V and features at `pos`), then choose the next one unless it was final."""
    B, S = s.tokens.shape
    rows = jnp.arange(B)
    live = ~s.done
    at = jnp.where(live, s.pos, S)  # rows with nothing to run write nowhere (out of range: dropped)
    logits, f, cache = forward_with_cache(target, s.last[:, None], s.cache.replace(lengths=s.pos), layer_ids,
                                          positions=at[:, None])
    feats = s.feats.at[rows, at].set(f[:, 0].astype(s.feats.dtype), mode="drop")
    nxt, keys = choose(logits[:, 0], s.keys, s.temp)
    grow = live & ~s.final  # rows that take a new token
    n_new = s.n_new + grow
    pos = jnp.where(grow, s.pos + 1, s.pos)
    return s.replace(cache=cache.replace(lengths=pos), feats=feats,
                     tokens=s.tokens.at[rows, jnp.where(grow, pos, S)].set(nxt, mode="drop"), pos=pos,
                     last=jnp.where(grow, nxt, s.last), n_new=n_new,
                     final=jnp.where(grow, _ends(nxt, n_new, eos, max_new), s.final), done=s.done | (live & s.final),
                     keys=jnp.where(grow[:, None], keys, s.keys))


def _decode(target: Target, s: RowState, max_steps, exit_after, *, layer_ids, eos, max_new):
    """Up to max_steps steps; stops early once exit_after rows finished in this call, or when none is live.
    Returns (state, steps run, live row-steps)."""
    done0 = jnp.sum(s.done)

    def cond(c):
        st, i, _ = c
        return (i < max_steps) & (jnp.sum(st.done) - done0 < exit_after) & ~jnp.all(st.done)

    def body(c):
        st, i, live = c
        return _step(target, st, layer_ids=layer_ids, eos=eos, max_new=max_new), i + 1, live + jnp.sum(~st.done)

    return jax.lax.while_loop(cond, body, (s, jnp.int32(0), jnp.int32(0)))


def _gather(s: RowState, rows):
    return jnp.take(s.tokens, rows, axis=0, mode="clip"), jnp.take(s.feats, rows, axis=0, mode="clip")


_STATIC = ("layer_ids", "eos", "max_new")
refill_program = jax.jit(_refill, static_argnames=_STATIC, donate_argnums=(1,))
decode_program = jax.jit(_decode, static_argnames=_STATIC, donate_argnums=(1,))
gather_program = jax.jit(_gather)


def _pow2_chunks(n: int, cap: int) -> list[int]:
    """n as a sum of powers of two <= cap, largest first (each a refill program shape, none padded)."""
    out = []
    while n:
        c = min(cap, 1 << (n.bit_length() - 1))
        out.append(c)
        n -= c
    return out


def _refill_rows(target, state, rows: list[int], jobs: list[Job], settings: RefillSettings, static: dict):
    """Refill `rows` with `jobs`: jobs sorted by length, split in power-of-two chunks, each padded to its bucket."""
    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i].ids))
    rows, jobs = [rows[i] for i in order], [jobs[i] for i in order]
    at = 0
    for r in _pow2_chunks(len(jobs), settings.max_refill):
        chunk, crow = jobs[at:at + r], rows[at:at + r]
        at += r
        m = settings.prompt_multiple
        Tp = min(-(-max(len(j.ids) for j in chunk) // m) * m, settings.seq_len)
        prompts = np.zeros((r, Tp), np.int32)
        for i, j in enumerate(chunk):
            prompts[i, :len(j.ids)] = j.ids
        state = refill_program(
            target, state, np.asarray(crow, np.int32), prompts, np.asarray([len(j.ids) for j in chunk], np.int32),
            np.asarray([j.temperature for j in chunk], np.float32), np.stack([j.key for j in chunk]).astype(np.uint32),
            **static)
    return state


def _check_job(job: Job, settings: RefillSettings, vocab: int) -> None:
    if not 1 <= len(job.ids) <= settings.max_prompt_tokens:
        raise ValueError(f"prompt {job.index}: {len(job.ids)} tokens, outside 1..{settings.max_prompt_tokens} "
                         "(max_prompt_tokens)")
    if min(job.ids) < 0 or max(job.ids) >= vocab:
        raise ValueError(f"prompt {job.index}: a token id outside the vocabulary [0, {vocab})")


def generate_answers(target: Target, jobs: Iterable[Job], settings: RefillSettings,
                     stats: RefillStats | None = None) -> Iterator[Answer]:
    """The target's answers to `jobs`, with their features, in the order they finish.

    Per round the host reads two [B] vectors (done, pos), gathers the finished rows, dispatches their refill and
    the next decode call, and only then hands the finished answers to the caller, so the device decodes while the
    caller writes them (programs run asynchronously)."""
    stats = RefillStats() if stats is None else stats
    static = dict(layer_ids=tuple(int(i) for i in settings.layer_ids), eos=tuple(sorted(set(settings.eos_ids))),
                  max_new=int(settings.max_new_tokens))
    B = settings.rows
    state = empty_state(target, settings)
    queue = iter(jobs)
    occupant: list[Job | None] = [None] * B
    exhausted = False

    def refill(state, free: list[int]):
        nonlocal exhausted
        take = []
        while len(take) < len(free) and not exhausted:
            job = next(queue, None)
            if job is None:
                exhausted = True
            else:
                _check_job(job, settings, target.config.vocab_size)
                take.append(job)
        for b, job in zip(free, take):
            occupant[b] = job
        if take:
            stats.refill_calls += len(_pow2_chunks(len(take), settings.max_refill))
            state = _refill_rows(target, state, free[:len(take)], take, settings, static)
        return state

    state = refill(state, list(range(B)))
    ready: list[Answer] = []
    while any(o is not None for o in occupant):
        exit_after = B + 1 if exhausted else min(settings.refill_min, B)
        state, n_steps, live = decode_program(target, state, np.int32(settings.steps), np.int32(exit_after), **static)
        yield from ready  # the caller takes the last round's answers while this call runs
        done, pos = np.asarray(state.done), np.asarray(state.pos)
        n_steps = int(n_steps)
        stats.decode_calls += 1
        stats.steps += n_steps
        stats.row_steps += n_steps * B
        stats.live_row_steps += int(live)
        finished = [b for b in range(B) if occupant[b] is not None and done[b]]
        ready = []
        if not finished:
            continue
        r = 1 << (len(finished) - 1).bit_length()  # gather in power-of-two shapes (padding rows clip, dropped)
        got = gather_program(state, np.asarray(finished + [B] * (r - len(finished)), np.int32))
        jobs_done = [occupant[b] for b in finished]
        lengths = [int(pos[b]) + 1 for b in finished]
        for b in finished:
            occupant[b] = None
        state = refill(state, finished)
        tokens, feats = (np.asarray(x) for x in got)
        for i, (job, n) in enumerate(zip(jobs_done, lengths)):
            stats.answers += 1
            stats.answer_tokens += n - len(job.ids)
            ready.append(Answer(index=job.index, tokens=tokens[i, :n].copy(), prompt_len=len(job.ids),
                                features=feats[i, :n].copy()))
    yield from ready
