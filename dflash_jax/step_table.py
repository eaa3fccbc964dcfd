"""A drafter's measured step table: what a draft + verify step costs and buys on one platform, for one target.

A row holds, for one draft length D and draft vocabulary, the held-out acceptance tau (tokens committed per step)
and the step's cost in decode steps: r = verify (D + 1 tokens) / decode, c = draft / decode. A step commits tau
tokens for r + c decode steps' time, so tau / (r + c) is the speedup it predicts, and `generate`'s default draft
length (or draft tree, for a tree row: N nodes verified in one pass) is the row that maximises it for the drafter's
own draft vocabulary (`decode.draft_length`). The table is
measured by `dflash-jax bench --step-table --save-table` and ships as `step_table.json` beside the drafter's
weights; it names the platform and the target it was measured with, and a table that does not match the pair being
run is ignored with a warning, never silently applied.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.frozen import Replaceable


@dataclasses.dataclass(frozen=True)
class StepRow(Replaceable):
    draft_length: int
    draft_vocab: int | None  # the drafter's draft_vocab_size (None: the whole vocabulary)
    tau: float  # held-out tokens committed per step (drafts accepted + the bonus)
    r: float  # verify of D + 1 tokens / one decode step
    c: float  # one draft / one decode step
    batch: int = 1
    tree_budget: int | None = None  # a draft tree of this many nodes (draft_length = its depth); None: a chain

    @property
    def predicted_speedup(self) -> float:
        return self.tau / (self.r + self.c)


@dataclasses.dataclass(frozen=True)
class StepTable(Replaceable):
    platform: str  # jax.default_backend() where it was measured ("cpu", "gpu", "tpu")
    target: str  # `decode.draft_length.target_signature` of the target it was measured with
    rows: tuple[StepRow, ...]
    note: str = ""  # how it was measured (command, prompts, date)

    def best(self, draft_vocab: int | None, batch: int = 1, trees: bool = True) -> StepRow | None:
        """The row with the highest predicted speedup for this draft vocabulary and batch (chains only unless
        `trees`), or None."""
        rows = [r for r in self.rows if r.draft_vocab == draft_vocab and r.batch == batch
                and (trees or r.tree_budget is None)]
        return max(rows, key=lambda r: r.predicted_speedup, default=None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTable":
        try:
            rows = tuple(StepRow(**{k: v for k, v in r.items() if k in StepRow.__dataclass_fields__})
                         for r in d["rows"])
            return cls(platform=str(d["platform"]), target=str(d["target"]), rows=rows, note=str(d.get("note", "")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"step table: malformed ({type(e).__name__}: {e}); expected keys platform, target, rows "
                             "(each with draft_length, draft_vocab, tau, r, c)") from None


__all__ = ["StepRow", "StepTable"]
