"""Test-session settings, and the end-of-run figures section (tests/report.py)."""

import os

import pytest

# The CLI switches JAX's persistent compilation cache on by default; tests that call it in-process must not write
# into the user's cache (tests/test_compile.py checks the cache itself, in subprocesses with their own folders).
os.environ.setdefault("DFLASH_JAX_NO_COMPILE_CACHE", "1")


_WORKER_FIGURES: list[str] = []  # lines sent back by pytest-xdist workers (the figures live in their processes)


def pytest_sessionfinish(session):
    """On a pytest-xdist worker: hand its recorded figures (tests/report.py) to the controller."""
    if hasattr(session.config, "workeroutput"):
        import report

        session.config.workeroutput["dflash_jax_figures"] = report.lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the pytest-xdist controller: collect a finished worker's figures."""
    _WORKER_FIGURES.extend(getattr(node, "workeroutput", {}).get("dflash_jax_figures", []))


def pytest_terminal_summary(terminalreporter):
    """The figures the tests recorded (tests/report.py): parity errors, tau, timings, after the pass/fail lines."""
    import report  # tests/report.py; the tests folder is on sys.path (rootdir-relative conftest)

    figures = report.lines() + _WORKER_FIGURES
    if figures:
        terminalreporter.section("dflash-jax figures")
        for line in figures:
            terminalreporter.write_line(line)
