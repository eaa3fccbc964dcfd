"""The planted bugs of tests/mutants.py still apply to today's code, so the mutation check cannot quietly turn into
a list of STALE patches after a refactoring (running the mutants themselves takes minutes: `python tests/mutants.py`).
"""
import shutil

import pytest

import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_planted_bug_applies_to_current_code(mutant, tmp_path):
    pkg = tmp_path / "dflash_jax"
    shutil.copytree(mutants.REPO / "dflash_jax", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = (pkg / mutant.file).read_text()
    why = mutants.apply(mutant, pkg)
    assert why is None, f"mutant {mutant.name} is stale: {why}"
    changed = [f for f in {mutant.file, *(a[0] for a in mutant.alt)} if (pkg / f).read_text() != (
        before if f == mutant.file else (mutants.REPO / "dflash_jax" / f).read_text())]
    assert changed, f"mutant {mutant.name} applied but changed nothing"
