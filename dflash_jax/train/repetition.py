"""Degenerate repetition of generated text: seq-rep-n (Welleck et al. 2019) and the model's own continuations.

seq-rep-n of a continuation is 1 - (distinct n-grams / all n-grams): 0 for text that never repeats an n-gram, close
to 1 for a loop. The unlikelihood fine-tune lowers it; `bench.quality` reports it.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from dflash_jax.decode.programs import generate_autoregressive


def seq_rep_n(tokens: Sequence[int], n: int = 4) -> float:
    """1 - distinct n-grams / all n-grams of `tokens` (0.0 when there are no n-grams)."""
    toks = [int(t) for t in tokens]
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def continuation_repetition(target, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 256,
                            n: int = 4, temperature: float = 0.0, seed: int = 0) -> dict:
    """Continuations of `prompts` (one batched call; greedy unless temperature > 0): per-prompt seq-rep-n, its
    median, and the texts."""
    ids = [tokenizer.encode(p) for p in prompts]
    res = generate_autoregressive(target, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                 eos_ids=())  # whole budgets: the metric's definition
    reps = [seq_rep_n(toks, n) for toks in res.token_lists()]
    return {"median": float(statistics.median(reps)), "per_prompt": reps,
            "texts": [tokenizer.decode(t) for t in res.token_lists()]}
