"""A drafter's measured step table: what a draft + verify step costs and buys on one platform, for one target.

A row holds, for one draft length D and draft vocabulary, the held-out acceptance tau (tokens committed per step)
and the step's cost in decode steps: r = verify (D + 1 tokens) / decode, c = draft / decode. A step commits tau
tokens for r + c decode steps' time, so tau / (r + c) is the speedup it predicts, and `generate`'s default draft
length (or draft tree, for a tree row: N nodes verified in one pass) is the row that maximises it for the drafter's
own draft vocabulary (`decode.draft_length`), rows within NOISE_MARGIN of the top counting as a tie that the
narrowest verify wins (`StepTable.best`). A row also names the draft pass it was measured with (the whole block or
the drafted slots only: `DrafterConfig.draft_pass`), and `generate` runs the best row's. The table is
measured by `dflash-jax bench --step-table --save-table` and ships as `step_table.json` beside the drafter's
weights; it names the platform and the target it was measured with, and a table that does not match the pair being
run is ignored with a warning, never silently applied.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.frozen import Replaceable

NOISE_MARGIN = 0.05  # predicted speedups this close (relative) are a tie on a shared CPU (`StepTable.best`)


@dataclasses.dataclass(frozen=True)
class StepRow(Replaceable):
    draft_length: int
    draft_vocab: int | None  # the drafter's draft_vocab_size (None: the whole vocabulary)
    tau: float  # held-out tokens committed per step (drafts accepted + the bonus)
    r: float  # verify of D + 1 tokens / one decode step
    c: float  # one draft / one decode step
    batch: int = 1
    tree_budget: int | None = None  # a draft tree of this many nodes (draft_length = its depth); None: a chain
    draft_pass: str = "block"  # the block the draft pass read (`DrafterConfig.draft_pass`): "block" or "drafted"
    # the row's context lookup as measured (`decode.lookup`; 0: off, as in tables saved before it existed). It moves
    # tau only (a step verifies the same tokens either way): generate runs a chain row with it, and a tree row with
    # its own default (`decode.draft_length.default_choice`).
    context_lookup: int = 0
    # the temperature tau and the measured speedup were taken at (0: greedy). Rejection sampling accepts other drafts
    # than greedy matching does, by amounts that differ between layouts (the SmolLM2 pair, 8 held-out requests: the
    # chain of 1 tau 1.60 greedy, 1.38 at T 0.7; the tree of 2 1.96 and 1.66), so `generate` ranks a sampled run's
    # choices by the rows measured sampled, where the table has them (`StepTable.best`).
    temperature: float = 0.0

    @property
    def predicted_speedup(self) -> float:
        return self.tau / (self.r + self.c)

    @property
    def verify_width(self) -> int:
        """Tokens per row in one target pass: the tree's nodes or the chain's drafts, plus the last committed one."""
        return (self.tree_budget or self.draft_length) + 1


@dataclasses.dataclass(frozen=True)
class StepTable(Replaceable):
    platform: str  # jax.default_backend() where it was measured ("cpu", "gpu", "tpu")
    target: str  # `decode.draft_length.target_signature` of the target it was measured with
    rows: tuple[StepRow, ...]
    note: str = ""  # how it was measured (command, prompts, date)
    # on "cpu": the CPU matmul kernel's build it was measured with ("avx512", "avx2", "portable"; "" unknown): a
    # verify's cost against a decode's differs between them (r at D 7: 2.15 with AVX-512, 3.06 with AVX2)
    cpu_kernel: str = ""

    def best(self, draft_vocab: int | None, batch: int = 1, trees: bool = True,
             margin: float = NOISE_MARGIN, draft_pass: str | None = None, sampled: bool = False) -> StepRow | None:
        """The row to run for this draft vocabulary and batch (chains only unless `trees`), or None: among the rows
        whose predicted speedup is within `margin` (relative) of the highest, the one with the narrowest verify
        (fewest tokens per target pass), then the highest prediction. Why the margin: r and c come from one run on a
        shared machine, and two re-measurements of the SmolLM2 table ten minutes apart ranked a tree of 4 (predicted
        1.04x, measured 0.85x) and a tree of 2 (1.12x, measured 1.10x) first; rows a few percent apart are a tie, and
        the narrower verify is the cheaper bet. draft_pass: rows measured with that draft pass only (None: any; at
        equal verify width the higher prediction wins, so of two passes the one that pays). sampled: rank the rows
        measured at a temperature > 0 (`StepRow.temperature`) for a sampled run, the greedy ones otherwise; a table
        holding rows of one kind only ranks those for both."""
        rows = [r for r in self.rows if r.draft_vocab == draft_vocab and r.batch == batch
                and (trees or r.tree_budget is None) and draft_pass in (None, r.draft_pass)]
        rows = [r for r in rows if (r.temperature > 0) == sampled] or rows
        if not rows:
            return None
        top = max(r.predicted_speedup for r in rows)
        tied = [r for r in rows if r.predicted_speedup >= top * (1.0 - margin)]
        return min(tied, key=lambda r: (r.verify_width, -r.predicted_speedup))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepTable":
        try:
            rows = tuple(StepRow(**{k: v for k, v in r.items() if k in StepRow.__dataclass_fields__})
                         for r in d["rows"])
            return cls(platform=str(d["platform"]), target=str(d["target"]), rows=rows, note=str(d.get("note", "")),
                       cpu_kernel=str(d.get("cpu_kernel", "")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"step table: malformed ({type(e).__name__}: {e}); expected keys platform, target, rows "
                             "(each with draft_length, draft_vocab, tau, r, c)") from None


__all__ = ["StepRow", "StepTable", "NOISE_MARGIN"]
