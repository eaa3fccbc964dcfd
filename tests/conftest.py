"""Test-session settings."""

import os

# The CLI switches JAX's persistent compilation cache on by default; tests that call it in-process must not write
# into the user's cache (tests/test_compile.py checks the cache itself, in subprocesses with their own folders).
os.environ.setdefault("DFLASH_JAX_NO_COMPILE_CACHE", "1")


def pytest_terminal_summary(terminalreporter):
    """The figures the tests recorded (tests/report.py): parity errors, tau, timings, after the pass/fail lines."""
    import report  # tests/report.py; the tests folder is on sys.path (rootdir-relative conftest)

    figures = report.lines()
    if figures:
        terminalreporter.section("dflash-jax figures")
        for line in figures:
            terminalreporter.write_line(line)
