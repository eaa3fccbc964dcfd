"""What a generation call returns: the tokens of each row, how it ended, the acceptance per step, and timings."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: np.ndarray  # [B, max_new_tokens] new tokens, -1 after each row's end (return_prompt: see below)
    num_tokens: np.ndarray  # [B] tokens generated per row (new tokens only, with or without return_prompt)
    acceptance_lengths: np.ndarray  # [B, steps] tokens committed per step incl. the bonus; 0 after a row's end
    finish_reason: tuple[str, ...]  # per row: "eos" | "length"
    num_steps: int  # loop iterations (draft+verify steps, or decode steps)
    draft_length: int  # drafted tokens per step (0 for autoregressive; a draft tree's depth)
    timings: dict  # seconds: prefill_s, decode_s, total_s (this run), compile_s (tracing + compiling, apart)
    # [B] real prompt tokens per row. With return_prompt=True (`includes_prompt`), `tokens` is
    # [B, longest prompt + max_new_tokens]: row b = its prompt (no padding) + its new tokens, then -1.
    prompt_lengths: np.ndarray | None = None
    includes_prompt: bool = False
    # Draft-tree nodes per step (None: chains). With a tree, draft_length is its depth: a step commits at most
    # draft_length + 1 tokens, and acceptance_rate / position_acceptance count accepted depths.
    tree_budget: int | None = None
    # The shortest repeat of a row's last tokens whose continuation a step verified instead of the drafter's tree or
    # first drafts (`decode.lookup`; 0: context lookup off).
    context_lookup: int = 0
    # The block each draft pass read: "block" (the whole block) or "drafted" (D + 1 slots); None: nothing drafted.
    draft_pass: str | None = None

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


__all__ = ["GenerationResult"]
