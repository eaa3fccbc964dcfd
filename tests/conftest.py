"""Test-session settings."""

import os

# The CLI switches JAX's persistent compilation cache on by default; tests that call it in-process must not write
# into the user's cache (tests/test_compile.py checks the cache itself, in subprocesses with their own folders).
os.environ.setdefault("DFLASH_JAX_NO_COMPILE_CACHE", "1")
