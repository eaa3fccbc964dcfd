"""The draft length (or draft tree) `generate` uses when neither is given: the best row of the drafter's measured
step table (`dflash_jax.step_table`) for this platform, this target and the batch, else a chain of block_size - 1.

A CPU table measured with another build of the CPU kernel (AVX-512 vs AVX2 vs portable) is applied with a warning:
its ranking may not hold here (`io.step_table_file` reads a folder's table for this build first when it has one).
A table measured on another platform, with another target (or the same model in another weight format: its step
costs differ), or holding no row for the drafter's draft vocabulary is ignored with a warning (once per reason),
never silently applied. Where the table applies and even its best row predicts a slowdown (`slower_than_plain`),
`generate` decodes plainly instead, unless told otherwise (`GenerationOptions.plain_when_slower`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import jax

from dflash_jax import execution
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.products import generation_bf16_products
from dflash_jax.params import named_leaves
from dflash_jax.step_table import NOISE_MARGIN

_WARNED: set[str] = set()


def target_signature(target: Target) -> str:
    """A short name for what a step costs depends on: the target's config and its weights' formats (dtype, or
    NVFP4 / GGML block kind), not their values."""
    formats = sorted({f"{type(x).__name__}:{getattr(x, 'kind', '')}:{getattr(x, 'dtype', '')}"
                      for x in named_leaves(target.params).values()})
    blob = json.dumps([dataclasses.asdict(target.config), formats], sort_keys=True, default=str)
    return f"{target.config.model_type}-{hashlib.sha1(blob.encode()).hexdigest()[:12]}"


def _table_row(drafter: Drafter, target: Target, batch: int, trees: bool, q8: bool | None = None,
               sampled: bool = False, bf16: bool | None = None):
    """(the step table's best row for this pair, platform and batch, None) when the table applies, else (None, why
    it does not). sampled: for a run at temperature > 0 (`StepTable.best`)."""
    cfg = drafter.config
    table = cfg.step_table
    if table is None:
        return None, None
    platform = jax.default_backend()
    batches = sorted({r.batch for r in table.rows if r.batch <= max(int(batch), 1)})
    trees = trees and not cfg.is_dflash2  # DFlash2's selector drafts a chain only
    row = (table.best(cfg.draft_vocab_size, batches[-1], trees=trees, draft_pass=cfg.draft_pass, sampled=sampled)
           if batches else None)
    if table.platform != platform:
        return None, f"it was measured on {table.platform!r} and this runs on {platform!r}"
    kernel = running_cpu_kernel(q8, bf16)
    if platform == "cpu" and table.cpu_kernel and kernel and table.cpu_kernel != kernel:
        _warn_once(f"the drafter's step table was measured with the CPU kernel's {table.cpu_kernel} build and this CPU "
                   f"runs its {kernel} build, where a verify costs a different number of decode steps: its choice is "
                   "applied, but may not be this machine's best (measure one with `dflash-jax bench --step-table "
                   "--save-table`)")
    if table.target != target_signature(target):
        return None, (f"it was measured with target {table.target}, and this target is {target_signature(target)} "
                      "(another model, or the same one in another weight format)")
    if row is None:
        passes = "" if cfg.draft_pass is None else f" and draft pass {cfg.draft_pass!r}"
        return None, f"it has no row for draft vocabulary {cfg.draft_vocab_size}{passes} at batch {batch}"
    if not 1 <= row.draft_length <= cfg.block_size - 1:
        return None, (f"its best draft length {row.draft_length} is outside 1..{cfg.block_size - 1} (the drafter's "
                      "block)")
    return row, None


def default_layout(drafter: Drafter, target: Target, batch: int = 1, trees: bool = True,
                   plain_when_slower: bool = False, q8: bool | None = None,
                   sampled: bool = False, bf16: bool | None = None) -> tuple[int, int | None]:
    """(draft_length, tree_budget) of `default_setting`."""
    return default_setting(drafter, target, batch, trees, plain_when_slower, q8, sampled, bf16)[:2]


def default_setting(drafter: Drafter, target: Target, batch: int = 1, trees: bool = True,
                    plain_when_slower: bool = False, q8: bool | None = None,
                    sampled: bool = False, bf16: bool | None = None) -> tuple[int, int | None, str]:
    """(draft_length, tree_budget, draft_pass) of `default_choice`."""
    c = default_choice(drafter, target, batch, trees, plain_when_slower, q8, sampled, bf16)
    return c.draft_length, c.tree_budget, c.draft_pass


@dataclasses.dataclass(frozen=True)
class DefaultChoice:
    """What `generate` runs when told neither a draft length nor a tree budget (`default_choice`)."""

    draft_length: int  # 0: plain decoding
    tree_budget: int | None
    draft_pass: str
    # a chain row's context lookup as measured (`StepRow.context_lookup`; None: generate's own default, as for a
    # tree row, a table without the field or no table at all)
    context_lookup: int | None = None


def default_choice(drafter: Drafter, target: Target, batch: int = 1, trees: bool = True,
                   plain_when_slower: bool = False, q8: bool | None = None, sampled: bool = False,
                   bf16: bool | None = None) -> DefaultChoice:
    """The step table's best row for this pair on this platform (rows of the largest measured batch <= `batch`, and
    of the drafter's `draft_pass` where it names one; tree rows only when `trees`): a chain of D (with its row's
    context lookup) or a draft tree of N nodes (draft_length = its depth), and the row's draft pass; a chain of
    block_size - 1 with the drafter's pass (or "block") when there is no table or it does not apply (warned).
    plain_when_slower: draft_length 0, plain decoding (warned), where the table applies and even its best row
    predicts no gain beyond the table's noise (tau / (r + c) < 1 + NOISE_MARGIN): where a verify of several rows
    costs more decode steps than the drafts save (the shipped SmolLM2 tables at batch 4, e.g.). q8: whether the
    programs take Q8 activations (None: the execution context's), for the build the table is held to; bf16 likewise
    for bfloat16 products (`GenerationOptions.bf16_products`). sampled:
    the run samples (temperature > 0): the table's rows measured sampled rank its choices, where it has any."""
    fallback = drafter.config.block_size - 1
    own_pass = drafter.config.draft_pass or "block"
    row, why = _table_row(drafter, target, batch, trees, q8, sampled, bf16)
    if plain_when_slower and predicts_no_gain(row):
        layout = (f"a draft tree of {row.tree_budget}" if row.tree_budget else f"draft length {row.draft_length}") + (
            ", over the drafted slots only" if row.draft_pass == "drafted" else "")
        _warn_once(f"generate: the drafter's step table predicts {row.predicted_speedup:.3f}x for its best setting at "
                   f"batch {batch} ({layout}, measured at batch {row.batch}): decoding plainly (a gain under "
                   f"{NOISE_MARGIN:.0%} is within the table's noise; the same tokens at temperature 0, the target's "
                   "law above it). Give draft_length= or tree_budget= to speculate "
                   "anyway, or plain_when_slower=False for the table's best")
        return DefaultChoice(0, None, own_pass)
    if row is not None:
        # a chain's lookup is what its row measured (0 for rows saved before chains took one: z-lab's loop); a tree
        # row leaves it to generate's default, which its tau was measured with
        lookup = None if row.tree_budget else row.context_lookup
        return DefaultChoice(row.draft_length, row.tree_budget, row.draft_pass, lookup)
    if why is not None:
        _warn_once(f"the drafter's step table is ignored: {why}; drafting block_size - 1 = {fallback} tokens per step "
                   "(measure a table for this pair with `dflash-jax bench --step-table --save-table`)")
    return DefaultChoice(fallback, None, own_pass)


def running_cpu_kernel(q8: bool | None = None, bf16: bool | None = None) -> str | None:
    """The CPU kernel's build the programs run with here ("avx512", "avx2", "portable"; "avx2-q8" etc. where GGML
    products take Q8 activations, "avx512-bf16" etc. where they take bfloat16 products: `q8` / `bf16`, None = the
    execution context's and generation's default, as their step costs differ), None off CPU or without the kernel."""
    if jax.default_backend() != "cpu" or not cpu_kernel.available():
        return None
    q8 = execution.current().q8_activations if q8 is None else q8
    bf16 = generation_bf16_products(q8) if bf16 is None else bf16
    return cpu_kernel.isa() + ("-q8" if q8 else "-bf16" if bf16 else "")


def predicts_no_gain(row) -> bool:
    """Whether the best row predicts no gain beyond the table's noise: within NOISE_MARGIN of 1.0 is a tie with plain
    decoding, which then runs (the Zen 4 Q8 table of 2026-12-06 predicted a tree of 2 at 1.02x, measured 0.97x there
    and 0.85-0.90x beside llama.cpp; rows are ranked by the same margin, `StepTable.best`)."""
    return row is not None and row.predicted_speedup < 1.0 + NOISE_MARGIN


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=5)


def slower_than_plain(drafter: Drafter, target: Target, batch: int = 1, trees: bool = True):
    """The step table's best row for this pair, platform and batch when even it predicts no gain over plain decoding
    beyond the table's noise (`predicts_no_gain`), else None (it predicts a speedup, or there is no table that
    applies): where `default_layout` with plain_when_slower gives plain decoding."""
    row, _ = _table_row(drafter, target, batch, trees)
    return row if predicts_no_gain(row) else None


def default_draft_length(drafter: Drafter, target: Target, batch: int = 1) -> int:
    """The step table's best chain D for this pair on this platform and batch, else block_size - 1 (see
    `default_layout`)."""
    return default_layout(drafter, target, batch, trees=False)[0]


__all__ = ["default_draft_length", "default_layout", "default_setting", "slower_than_plain", "target_signature"]
