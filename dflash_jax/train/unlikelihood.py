"""Sequence-level unlikelihood fine-tuning of a target (Welleck et al. 2019, "Neural text generation with
unlikelihood training"), so that its greedy output writes code instead of loops.

A small target trained by next-token loss alone decodes greedily into loops (`self._w, self._w, ...`; the shipped
v2 target repeats whole functions): greedy decoding follows the model's most likely token, and once a line has been
written once, writing it again is likely. Lowering the loss further does not cure it (checkpoints/README.md). This
fine-tune does what the paper's sequence-level objective does: at every step the model continues real prefixes
greedily, with its current weights; each continuation token that sits inside an n-gram the row has already written
gets the loss -log(1 - p(token)), which pushes exactly the looping choices down; the ordinary next-token loss on
real text, in the same step, keeps the model a language model of Python.

Speculative decoding stays exact whatever the target learns: this changes which target is shipped, not how it is
verified.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import TargetConfig
from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.decode.programs import generate_autoregressive
from dflash_jax.train.loop import batch_rng, lm_loss
from dflash_jax.train.repetition import continuation_repetition

# 1 - p is clipped here: a token the model is already certain of must not give an infinite loss.
MIN_ONE_MINUS_P = 1e-5


def repeat_mask(rows: np.ndarray, prefix_len: int, n: int = 4) -> np.ndarray:
    """[B, S] bool: positions at or after `prefix_len` that lie inside an n-gram which already occurred earlier in the
    same row (prefix included). These are the tokens sequence-level unlikelihood penalises."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise ValueError(f"rows must be [batch, length], got shape {rows.shape}")
    if n < 1:
        raise ValueError(f"n-gram length must be >= 1, got {n}")
    mask = np.zeros(rows.shape, bool)
    for b, row in enumerate(rows.tolist()):
        seen: set[tuple[int, ...]] = set()
        for i in range(len(row) - n + 1):
            gram = tuple(row[i:i + n])
            if gram in seen and i + n > prefix_len:
                mask[b, max(i, prefix_len):i + n] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(cfg: TargetConfig, weight: float):
    """loss_fn(params, batch) -> (next-token loss on batch["text"] + weight * unlikelihood on batch["generated"],
    metrics). batch["generated"] [B, S] is prefix + greedy continuation, batch["repeated"] [B, S] its repeat mask."""
    next_token_loss = lm_loss(cfg)

    def loss_fn(params, batch):
        model = Target(params=params, config=cfg)
        lm, _ = next_token_loss(params, batch["text"])  # [B, T+1] real text

        rows, repeated = batch["generated"], batch["repeated"]  # [B2, S], [B2, S]
        logits, _, _ = forward_with_cache(model, rows[:, :-1], None)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        p = jnp.exp(jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0])  # [B2, S-1]
        penalised = repeated[:, 1:].astype(jnp.float32)
        generated = batch["generated_positions"][:, 1:].astype(jnp.float32)
        ul = -(jnp.log(jnp.clip(1.0 - p, MIN_ONE_MINUS_P, 1.0)) * penalised).sum() / jnp.maximum(generated.sum(), 1.0)
        return lm + weight * ul, {"lm_loss": lm, "unlikelihood": ul,
                                  "repeated_fraction": penalised.sum() / jnp.maximum(generated.sum(), 1.0)}
    return loss_fn


# Offsets the prefix stream's seed from the text batches' (which use the run's seed as it is).
PREFIX_SEED_OFFSET = 7919


def make_batch_fn(cfg: TargetConfig, text_batch, prefix_windows, *, prefix_len: int, new_tokens: int,
                  ngram: int, seed: int):
    """batch_fn(step, params): real text and the current model's greedy continuations of real prefixes.

    text_batch(step) -> [B, T+1] and prefix_windows(rng) -> [B2, prefix_len] draw from the corpus; both are pure
    functions of the step, and the continuations of the restored weights, so a resumed run sees the batches the
    interrupted one would have."""

    def batch_fn(step: int, params) -> dict:
        text = np.asarray(text_batch(step), np.int32)
        prefixes = np.asarray(prefix_windows(batch_rng(seed + PREFIX_SEED_OFFSET, step)), np.int32)
        if prefixes.ndim != 2 or prefixes.shape[1] != prefix_len:
            raise ValueError(f"prefix windows must be [batch, {prefix_len}], got {prefixes.shape}")
        res = generate_autoregressive(Target(params=params, config=cfg), prefixes.tolist(),
                                      max_new_tokens=new_tokens, eos_ids=())
        conts = np.zeros((prefixes.shape[0], new_tokens), np.int32)
        live = np.zeros((prefixes.shape[0], prefix_len + new_tokens), bool)
        for i, toks in enumerate(res.token_lists()):
            conts[i, :len(toks)] = toks[:new_tokens]
            live[i, prefix_len:prefix_len + len(toks)] = True
        rows = np.concatenate([prefixes, conts], axis=1)  # [B2, P+L]
        repeated = repeat_mask(rows, prefix_len, ngram) & live
        return {"text": jnp.asarray(text), "generated": jnp.asarray(rows), "repeated": jnp.asarray(repeated),
                "generated_positions": jnp.asarray(live)}
    return batch_fn


def median_seq_rep(target: Target, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 256) -> float:
    """Median seq-rep-4 of the target's greedy continuations of `prompts` (the figure this fine-tune lowers)."""
    return continuation_repetition(target, tokenizer, prompts, max_new_tokens=max_new_tokens)["median"]
