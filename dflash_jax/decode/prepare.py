"""Host-side preparation of a generation call: prompts validated and padded to their bucket (HF-style padded
batches unpadded first), the budget checked against the context limit, the draft length checked against the block,
one key stream per row.
"""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decode.buckets import prompt_bucket
from dflash_jax.decode.lookup import DEFAULT_MIN_MATCH, MAX_MATCH
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


def unpad(prompt, attention_mask, prompt_lengths) -> list:
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


def check_budget(target: Target, lens: np.ndarray, max_new_tokens: int, max_cache_len) -> int:
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


def check_draft_length(drafter: Drafter, draft_length) -> int:
    """Drafted tokens per step: draft_length (None: block_size - 1), checked against the drafter's block."""
    bs = drafter.config.block_size
    D = bs - 1 if draft_length is None else draft_length
    if not isinstance(D, (int, np.integer)) or isinstance(D, bool) or not 1 <= D <= bs - 1:
        raise ValueError(f"draft_length must be in 1..block_size-1 = 1..{bs - 1}, got {draft_length!r}")
    return int(D)


def check_tree(drafter: Drafter, tree_budget, draft_length, sampling) -> int:
    """A draft tree's settings against the drafter and the sampling rule; returns the tree's depth (the draft
    positions a step needs), min(tree_budget, block_size - 1)."""
    if not isinstance(tree_budget, (int, np.integer)) or isinstance(tree_budget, bool) or tree_budget < 1:
        raise ValueError(f"tree_budget must be an integer >= 1 (draft nodes per step besides the root), got "
                         f"{tree_budget!r}")
    if draft_length is not None:
        raise ValueError("tree_budget and draft_length are one choice: a draft tree's depth follows from its budget "
                         "and the drafter's block (min(tree_budget, block_size - 1)); give one of them")
    cfg = drafter.config
    if cfg.is_dflash2:
        raise ValueError("tree_budget: a DFlash2 drafter cannot draft a tree: its candidate selector drafts "
                         "sequentially (each slot's choice conditions the next slot's scores), so its block has no "
                         "independent per-position distributions to build a tree from; use draft_length (a chain)")
    depth = min(int(tree_budget), cfg.block_size - 1)
    if depth < 1:  # a block of one slot proposes nothing
        raise ValueError(f"tree_budget: a draft tree needs depth >= 1, but the drafter's block of {cfg.block_size} "
                         f"proposes block_size - 1 = {cfg.block_size - 1} positions")
    if sampling.use_p_min:
        raise ValueError("p_min cuts a chain of drafts at its first unsure slot; a draft tree has no such cut (leave "
                         "p_min at 0 with tree_budget)")
    if sampling.draft_sampling != "sample":
        raise ValueError("draft_sampling chooses how chain drafts are drawn; a draft tree takes each position's most "
                         "probable tokens (leave draft_sampling at its default with tree_budget)")
    return depth


def check_context_lookup(context_lookup, tree_budget: int | None, dflash2: bool = False) -> int:
    """The shortest repeat a step copies from (`decode.lookup`): None -> the default with a tree (0 with a chain,
    unless the step table's chain row named its own: `decode.draft_length.default_choice`); 0 = off; 1..MAX_MATCH.
    A DFlash2 chain takes none."""
    if context_lookup is None:
        return DEFAULT_MIN_MATCH if tree_budget is not None else 0
    if (not isinstance(context_lookup, (int, np.integer)) or isinstance(context_lookup, bool)
            or not 0 <= context_lookup <= MAX_MATCH):
        raise ValueError(f"context_lookup must be an integer in 0..{MAX_MATCH} (the shortest repeat of the row's "
                         f"last tokens, in its prompt and output, a step copies from; 0: off), got "
                         f"{context_lookup!r}")
    if context_lookup and tree_budget is None and dflash2:
        raise ValueError(f"context_lookup={context_lookup}: a chain's copied drafts are verified against a point-mass "
                         "q, and a DFlash2 drafter's q lives on its selector's candidates (use a DFlash drafter, or "
                         "leave context_lookup at None)")
    return int(context_lookup)


def check_tree_fits(tree_budget: int, cache_slots: int) -> None:
    """The verify of root + tree_budget nodes must fit in the cache bucket of the call (its fresh K/V and mask are
    sized by the tree, its scratch never outgrows the cache it extends)."""
    if int(tree_budget) + 1 > cache_slots:
        raise ValueError(f"tree_budget {tree_budget}: the verify of the root + {tree_budget} nodes needs "
                         f"{int(tree_budget) + 1} slots, more than the cache bucket of this call holds "
                         f"({cache_slots} slots)")


def warn_short_drafter_context(drafter: Drafter, longest: int) -> None:
    """Warns (pointing at the caller of `generate` / `speculative_call`) when a context of `longest` tokens runs past
    the positions the drafter was built for."""
    limit = drafter.config.model.max_position_embeddings
    if longest > limit:
        warnings.warn(f"context of up to {longest} tokens exceeds the drafter's max_position_embeddings ({limit}): "
                      "acceptance may degrade (output stays exact)", stacklevel=3)


def row_keys(seed: int, batch: int) -> np.ndarray:
    """[batch, 2] uint32 raw key data: one independent stream per row (fold_in of the row index), so a row's samples
    do not depend on the batch."""
    base = jax.random.key(seed)
    return np.asarray(jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))(jnp.arange(batch)))


__all__ = ["check_budget", "check_context_lookup", "check_draft_length", "check_tree", "check_tree_fits",
           "prepare_prompt", "row_keys", "unpad", "warn_short_drafter_context"]
