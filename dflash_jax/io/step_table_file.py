"""`step_table.json` beside a drafter's weights (`dflash_jax.step_table`): read when the drafter is loaded, written
by `dflash-jax bench --step-table --save-table` and by `save` when the drafter carries one.

A folder may also hold CPU tables for other builds of the CPU kernel, `step_table.<build>.json` (build: "avx512",
"avx2", "portable", each with "-q8" where GGML products took Q8 activations or "-bf16" where they took bfloat16
products): a verify's cost against a decode's differs between them, so on a CPU the table of the build that runs here
is read first (for "avx2-q8", then "avx2"). `write_step_table` writes `step_table.json` unless that file holds a table
of another build.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from dflash_jax.decode.draft_length import running_cpu_kernel
from dflash_jax.models.drafter import Drafter
from dflash_jax.step_table import StepTable

FILE_NAME = "step_table.json"


def build_file_name(build: str) -> str:
    return f"step_table.{build}.json"


def read_step_table(folder: Path) -> StepTable | None:
    """The folder's step table (on a CPU, the one for the kernel build that runs here when the folder has one), or
    None when it has none; a malformed file is ignored with a warning (a drafter without a table decodes as well,
    only with the default draft length)."""
    build = running_cpu_kernel()  # e.g. "avx2-q8", then "avx2" (the same build's float products), then the folder's
    names = [build_file_name(b) for b in dict.fromkeys((build, build.split("-")[0])) if b] if build else []
    f = next((Path(folder) / n for n in names if (Path(folder) / n).is_file()), Path(folder) / FILE_NAME)
    if not f.is_file():
        return None
    table, why = _parse(f)
    if why is not None:
        warnings.warn(f"{f}: ignored ({why})", stacklevel=3)
    return table


def _parse(f: Path) -> tuple[StepTable | None, str | None]:
    """(the file's table, None), or (None, why it is not one)."""
    try:
        return StepTable.from_dict(json.loads(f.read_text())), None
    except (ValueError, json.JSONDecodeError) as e:
        return None, str(e)


def write_step_table(folder: Path, table: StepTable) -> Path:
    """Writes `step_table.json`, or `step_table.<build>.json` where `step_table.json` holds another CPU kernel
    build's table (each build keeps its own). Where the file already holds a table of the same platform, target and
    build, its rows measured at temperatures this table has none of stay (`StepRow.temperature`): a greedy run
    replaces the greedy rows and keeps the sampled ones, and the other way round."""
    f = Path(folder) / FILE_NAME
    old = _parse(f)[0] if f.is_file() else None  # a malformed file is overwritten
    if table.cpu_kernel and old is not None and old.cpu_kernel and old.cpu_kernel != table.cpu_kernel:
        f = Path(folder) / build_file_name(table.cpu_kernel)
        old = _parse(f)[0] if f.is_file() else None
    if old is not None and (old.platform, old.target, old.cpu_kernel) == (table.platform, table.target,
                                                                         table.cpu_kernel):
        measured = {r.temperature for r in table.rows}
        kept = tuple(r for r in old.rows if r.temperature not in measured)
        if kept:
            temps = " / ".join(f"{t:g}" for t in sorted({r.temperature for r in kept}))
            table = table.replace(rows=table.rows + kept, note=f"{table.note}; the rows at T {temps}: an earlier run's")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(table.to_dict(), indent=1) + "\n")
    return f


def with_step_table(drafter: Drafter, folder: Path) -> Drafter:
    """The drafter carrying its folder's step table (as it is when the folder has none)."""
    table = read_step_table(folder)
    return drafter if table is None else drafter.replace(config=drafter.config.replace(step_table=table))


__all__ = ["FILE_NAME", "build_file_name", "read_step_table", "write_step_table", "with_step_table"]
