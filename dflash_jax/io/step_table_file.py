"""`step_table.json` beside a drafter's weights (`dflash_jax.step_table`): read when the drafter is loaded, written
by `dflash-jax bench --step-table --save-table` and by `save` when the drafter carries one."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from dflash_jax.models.drafter import Drafter
from dflash_jax.step_table import StepTable

FILE_NAME = "step_table.json"


def read_step_table(folder: Path) -> StepTable | None:
    """The folder's step table, or None when it has none; a malformed file is ignored with a warning (a drafter
    without a table decodes as well, only with the default draft length)."""
    f = Path(folder) / FILE_NAME
    if not f.is_file():
        return None
    try:
        return StepTable.from_dict(json.loads(f.read_text()))
    except (ValueError, json.JSONDecodeError) as e:
        warnings.warn(f"{f}: ignored ({e})", stacklevel=3)
        return None


def write_step_table(folder: Path, table: StepTable) -> Path:
    f = Path(folder) / FILE_NAME
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(table.to_dict(), indent=1) + "\n")
    return f


def with_step_table(drafter: Drafter, folder: Path) -> Drafter:
    """The drafter carrying its folder's step table (as it is when the folder has none)."""
    table = read_step_table(folder)
    return drafter if table is None else drafter.replace(config=drafter.config.replace(step_table=table))


__all__ = ["FILE_NAME", "read_step_table", "write_step_table", "with_step_table"]
