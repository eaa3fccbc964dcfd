"""What a generation program is keyed on besides the models: buckets for the prompt, the cache, the batch and the
budget, the EOS set's fixed width, and the attention rule of each platform.

The output buffer, the caches and the batch are sized by bucket and the loop stops at the exact count on device, so
any request maps to one of a few programs; padding rows of a batch bucket are inert (length 0: done from the start,
they write nothing and never reach the result).
"""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax.models.target import Target

PAD = -1  # never a token: fills the output buffer after each row's end, and an EOS set's unused slots

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
EOS_WIDTH = 8  # EOS ids are padded to this many (more ids: the next power of two), so EOS sets share a program


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(n: int, minimum: int = PROMPT_BUCKET_MIN) -> int:
    """The power of two >= n (at least `minimum`): token budgets (and EOS sets) are padded to these, so a range of
    1..L needs log2(L) programs at most."""
    return max(int(minimum), 1 << (max(int(n), 1) - 1).bit_length())


def budget_bucket(max_new_tokens: int) -> int:
    """The loop program's budget bucket (its `out_len`): the budget itself is a traced value, so every budget of one
    bucket runs the same program."""
    return bucket(max_new_tokens, BUDGET_BUCKET_MIN)


def prompt_bucket(n: int) -> int:
    """Prompt length bucket (the prefill program's key): a power of two >= n (at least 16) up to 4096, then the
    multiple of 1024 >= n."""
    return bucket(n) if n <= FINE_ABOVE else round_up(int(n), FINE_STEP)


def cache_bucket(n: int) -> int:
    """Cache slots for a need of n slots (the loop program's key): a power of two >= n, at least CACHE_BUCKET_MIN
    (2048), up to 4096; then the multiple of 1024 >= n (see CACHE_BUCKET_MIN for the worst-case waste)."""
    return bucket(n, CACHE_BUCKET_MIN) if n <= FINE_ABOVE else round_up(int(n), FINE_STEP)


def batch_bucket(n: int) -> int:
    """Rows a program runs for a batch of n: a power of two up to 16, then the multiple of 16 >= n (waste < 2x below
    16 rows, < 16 rows above). The extra rows are inert (prompt length 0)."""
    return bucket(n, 1) if n <= BATCH_FINE_ABOVE else round_up(int(n), BATCH_FINE_ABOVE)


def cache_slots(longest: int, out_len: int, extra: int, limit: int) -> int:
    """Cache slots for a program: the `cache_bucket` of the longest prompt + the budget bucket + the `extra` slots
    the last verify writes past the committed text, capped by the context limit; the loop program is keyed on it.
    (The scatter drops out-of-range writes, so the extra room only keeps those slots, never decides correctness.)"""
    return min(cache_bucket(longest + out_len + extra), round_up(limit + extra, 64))


# Attention over the cache inside a loop program, per platform: True = the live-length loop (only the blocks up to
# the longest live row, a data-dependent trip count: free on CPU), False = static trip counts over the whole bucket
# (an accelerator would copy a data-dependent loop's predicate to the host on every iteration).
LIVE_LENGTH_LOOP = {"cpu": True, "default": False}


def uses_live_length_loop(platform: str | None = None) -> bool:
    """Whether loop programs for `platform` ("cpu", "cuda", "gpu", "tpu", ...; default: JAX's default backend) attend
    their caches with the live-length loop (see LIVE_LENGTH_LOOP). Exports for another platform ask with its name."""
    platform = platform or jax.default_backend()
    return LIVE_LENGTH_LOOP.get(platform, LIVE_LENGTH_LOOP["default"])


def mesh_platform(mesh) -> str | None:
    """The platform of a mesh's devices (None without a mesh: the default backend's)."""
    return None if mesh is None else mesh.devices.flat[0].platform


# -- EOS sets ------------------------------------------------------------------------------------------------------

def default_eos_ids(target: Target) -> tuple[int, ...]:
    """The EOS id(s) of the target's config (`eos_token_id`), () when it has none."""
    eos = target.config.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def eos_set(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """An id or ids -> the sorted distinct ids, each checked against the vocabulary."""
    if isinstance(eos_ids, (int, np.integer)):
        eos_ids = (eos_ids,)
    out = tuple(sorted({int(e) for e in eos_ids}))
    bad = [e for e in out if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"eos_ids {bad} outside the vocabulary [0, {vocab_size})")
    return out


def padded_eos(eos: tuple[int, ...]) -> np.ndarray:
    """The EOS set as the loop takes it: [E] int32, E = its width bucket, padded with PAD."""
    arr = np.full((bucket(len(eos), EOS_WIDTH),), PAD, np.int32)
    arr[:len(eos)] = eos
    return arr


__all__ = ["PAD", "PROMPT_BUCKET_MIN", "BUDGET_BUCKET_MIN", "CACHE_BUCKET_MIN", "FINE_ABOVE", "FINE_STEP",
           "BATCH_FINE_ABOVE", "EOS_WIDTH", "LIVE_LENGTH_LOOP", "batch_bucket", "bucket", "budget_bucket",
           "cache_bucket", "cache_slots", "default_eos_ids", "eos_set", "mesh_platform", "padded_eos", "prompt_bucket",
           "round_up", "uses_live_length_loop"]
