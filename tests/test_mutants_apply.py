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
    files = {mutant.file, *(file for file, _, _ in mutant.alt)}
    before = {f: (pkg / f).read_text() for f in files}
    why = mutants.apply(mutant, pkg)
    assert why is None, f"mutant {mutant.name} is stale: {why}"
    assert any((pkg / f).read_text() != before[f] for f in files), f"mutant {mutant.name} applied but changed nothing"
