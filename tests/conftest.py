"""Test-session settings."""

import os
import shutil
import tempfile
from pathlib import Path

# Tests must never write into the user's compilation cache. Within one test run, though, many tests, the documented
# commands and the notebooks (each in its own process) compile the same programs for the shipped models, so the run
# gets one fresh persistent-cache folder of its own, shared by the xdist workers and every process they start, and
# removed when the run ends: each program is compiled once per run, and no test can pass on a stale program.
# DFLASH_JAX_NO_COMPILE_CACHE=1 in the environment turns this off (tests/test_compile.py checks the cache itself, in
# subprocesses with their own folders).
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
_RUN_CACHE = None
if os.environ.get("DFLASH_JAX_NO_COMPILE_CACHE", "").strip() in ("", "0"):
    _owner = os.getppid() if _WORKER else os.getpid()  # xdist workers are children of the controlling process
    _RUN_CACHE = Path(tempfile.gettempdir()) / f"dflash-jax-test-run-{_owner}"
    os.environ["XDG_CACHE_HOME"] = str(_RUN_CACHE)
    import dflash_jax

    dflash_jax.enable_compilation_cache()


def pytest_unconfigure(config):
    if _RUN_CACHE is not None and not _WORKER:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
