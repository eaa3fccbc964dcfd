"""The documented `dflash-jax bench` commands, run exactly as tests/test_docs_commands.py runs every other documented
command (shrunk, on the default pair, as a user runs them; see that file's doc).

A file of their own because the suite distributes whole files over its two workers (`pytest -n 2 --dist loadfile`):
the bench commands on the default SmolLM2 pair are most of the documented commands' compile time, and in one file
with the rest they made the longest file of the suite (~25 min of one worker on CI's cores) and its critical path.
"""

from __future__ import annotations

import pytest

from test_docs_commands import COMMANDS, is_bench, run_documented  # the tests folder is on sys.path


@pytest.mark.parametrize("command", [c for c in COMMANDS if is_bench(c)])
def test_documented_bench_command_runs(command, tmp_path, monkeypatch, capsys):
    run_documented(command, tmp_path, monkeypatch, capsys)


def test_every_documented_command_runs_in_one_of_the_two_files():
    import test_docs_commands

    here = [c for c in COMMANDS if is_bench(c)]
    there = [c for c in COMMANDS if not is_bench(c)]
    assert here and there and sorted(here + there) == sorted(COMMANDS)
    marks = test_docs_commands.test_documented_command_runs.pytestmark
    assert [m.args[1] for m in marks if m.name == "parametrize"] == [there]
