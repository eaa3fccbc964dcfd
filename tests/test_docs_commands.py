"""Every command line printed in README.md, docs/*.md and checkpoints/README.md runs, in-process, on a tiny budget,
on the model a user gets by default.

The commands are collected from those files (fenced code blocks and inline code spans; pieces joined by `&&`, `;` or
`|` are separate commands), so a newly documented command is tested by construction. A command line is one that
starts with `dflash-jax <something>` or `python -m dflash_jax...`.

A command runs as documented, on its own defaults: the suite's `$DFLASH_JAX_DEFAULT_MODEL=code-5m` (tests/conftest.py)
is removed for it, so a command that names no model runs the default SmolLM2 pair, and everything that follows from
the drafter (draft lengths, block sizes) is the drafter's. Only sizes shrink, generically: the command's own `--help`
says which options it takes; every option named in TINY (prompts, tokens, steps, repetitions, batch and sequence
sizes, the shape of a model a trainer builds) gets its tiny value (replacing the documented one, or added), every
flag in TINY_FLAGS it takes is set (a command's own small mode where its hardware is missing: the GPU report's and
the mesh bench's CPU `--smoke`), every option in OUTPUTS is sent to a fresh temporary folder, and the command runs
with that folder as the working directory (relative default paths such as `.train/` land there too; an argument
naming a path of the repository, such as `checkpoints/target_v3`, is given as that path). A command that takes
`--no-packages` runs with it when the `[corpus]` extra is not installed, rather than being skipped. The shipped
models are loaded once for all the commands (`load_default`'s result is shared, as its loaders have tests of their
own); the compiled programs are dropped after each command (a later one loads those it shares from the suite's
persistent cache). The `dflash-jax bench` commands run from tests/test_docs_bench_commands.py (the other worker).
"""

from __future__ import annotations

import contextlib
import gc
import functools
import importlib
import importlib.util
import importlib.metadata as md
import inspect
import io
import re
import shlex
from pathlib import Path

import jax
import pytest

from dflash_jax.io import shipped

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "checkpoints" / "README.md")

# Options that set how much work a command does -> the tiny value used here. Sizes only: nothing that picks a model,
# a drafter, a draft length or a mode (a draft length the test chose once hid a default that crashed on the default
# pair: `bench --tau-table` asked its block-8 drafter for D = 15).
TINY = {
    "--max-new-tokens": "6", "--new-tokens": "6", "--prompts": "2", "--steps": "2", "--batch": "2",
    "--seq-len": "32", "--long-seq-len": "48", "--max-prompt-tokens": "16", "--anchors": "4", "--reps": "2",
    "--warmup": "1", "--budget-s": "30", "--windows": "4", "--rows": "2",
    "--eval-prompts": "1", "--eval-tokens": "6", "--calibration-anchors": "1",
    # Model shape, where a command builds the model it trains: the same code paths at a fraction of the compile and
    # evaluation cost (train-target's held-out evaluation alone, 64 + 16 long windows at the shipped 6-layer shape,
    # was minutes on CI's cores). head_dim is fixed at 64, so --hidden 64 with one head.
    "--layers": "1", "--hidden": "64", "--intermediate": "128", "--heads": "1", "--kv-heads": "1",
    "--block-size": "4",
    "--batches": "1",  # the step table's batch rows (each needs that many prompts)
    "--tree-budgets": "4",  # one draft-tree row of the step table
}
# TINY options that only one mode reads: set only when the command runs that mode (other runs stay as other tests
# make them, argument for argument).
MODE_ONLY = {"--batches": "--step-table", "--tree-budgets": "--step-table", "--save-table": "--step-table"}
# TINY options a command keeps at its documented value: a chat prompt cannot be cut to fit (datagen refuses a limit
# no request of the split fits, and SmolLM2's chat template alone takes 44 tokens).
KEEP = {"python -m dflash_jax.train.datagen": ("--max-prompt-tokens",)}
# Flags that switch a command to its own small configuration (e.g. the GPU report's CPU smoke run).
TINY_FLAGS = ("--smoke",)
# Options that name where a command writes -> a fresh temporary path.
OUTPUTS = ("--out", "--work-dir", "--out-dir", "--output", "--output-dir", "--save-table")


def _code_texts(markdown: str) -> list[str]:
    texts = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", markdown, flags=re.S):
        texts += re.sub(r"\\\n\s*", " ", block).splitlines()  # a command continued over lines is one command
    prose = re.sub(r"```[^\n]*\n.*?```", "", markdown, flags=re.S)
    texts += re.findall(r"`([^`\n]+)`", prose)
    return texts


def documented_commands() -> list[str]:
    out: list[str] = []
    for doc in DOCS:
        for text in _code_texts(doc.read_text()):
            for piece in re.split(r"&&|;|\|", text):
                piece = re.sub(r"\s+#.*$", "", piece).strip()
                if re.match(r"(dflash-jax\s+\S|python3? -m dflash_jax)", piece) and piece not in out:
                    out.append(piece)
    return out


def _entry(argv: list[str]):
    """(main function, its argv) for `dflash-jax ...` or `python -m <module> ...`."""
    if argv[0] == "dflash-jax":
        from dflash_jax import cli
        return cli.main, argv[1:]
    assert argv[:2] in (["python", "-m"], ["python3", "-m"]), argv
    module = importlib.import_module(argv[2])
    assert callable(getattr(module, "main", None)), f"{argv[2]} has no main(argv)"
    return module.main, argv[3:]


def _help(main, args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main(list(args) + ["--help"])
    return buf.getvalue()


def _options(help_text: str) -> set[str]:
    """The options the command accepts, read from its own --help."""
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", help_text))


def _multi_valued(help_text: str) -> set[str]:
    """The options that take several values (argparse's usage shows them as `--name X [X ...]` or `--name [X ...]`)."""
    return {m.group(1) for m in re.finditer(r"(--[a-z][\w-]*) (?:\w+ )?\[\w+ \.\.\.\]", " ".join(help_text.split()))}


def _set_option(args: list[str], name: str, value: str, multi: bool = False) -> list[str]:
    """Replace the value of `name` in args (all its values when it takes several), or append it. A single-valued
    option's one value is replaced, so a positional argument written after it (a prompt) stays."""
    if name not in args:
        return args + [name, value]
    i = args.index(name)
    j = i + 1
    if multi:
        while j < len(args) and not args[j].startswith("-"):
            j += 1
    elif j < len(args) and not args[j].startswith("-"):
        j += 1
    return args[:i + 1] + [value] + args[j:]


def _corpus_extra_installed() -> bool:
    from dflash_jax.train.corpus import CORPUS_PACKAGES
    try:
        return all(md.version(name) == version for name, version in CORPUS_PACKAGES.items())
    except md.PackageNotFoundError:
        return False


def tiny(command: str, tmp: Path) -> tuple[object, list[str]]:
    main, args = _entry(shlex.split(command))
    help_text = _help(main, args)
    accepted, multi = _options(help_text), _multi_valued(help_text)
    kept = next((names for prefix, names in KEEP.items() if command.startswith(prefix)), ())
    for name, value in TINY.items():
        if name in accepted and MODE_ONLY.get(name, name) in args + [name] and name not in kept:
            args = _set_option(args, name, value, name in multi)
    args = args + [f for f in TINY_FLAGS if f in accepted and f not in args]
    for name in OUTPUTS:
        if name in accepted and MODE_ONLY.get(name, name) in args + [name]:
            args = _set_option(args, name, str(tmp / name.strip("-")), name in multi)
    if "--no-packages" in accepted and "--no-packages" not in args and not _corpus_extra_installed():
        args = args + ["--no-packages"]
    # The command runs in a temporary folder: an input that names a path of the repository (checkpoints/target_v3)
    # is given as that path.
    args = [str(ROOT / a) if not a.startswith("-") and not Path(a).is_absolute() and (ROOT / a).exists() else a
            for a in args]
    return main, args


COMMANDS = documented_commands()

# Documented commands whose shrunk run another test makes anyway, with a larger budget and stronger checks: run there,
# not twice (on CI's two cores each is tens of seconds of compiles). prefix -> (test file, test, the call it makes).
RUN_ELSEWHERE = {
    "python -m dflash_jax.bench.device_report": (
        "test_pallas_nvfp4.py", "test_device_report_smoke", 'device_report.main(["--smoke", "--out", str(tmp_path)'),
    # the same script at its first documented path (dflash_jax/device_report.py runs bench.device_report.main)
    "python -m dflash_jax.device_report": (
        "test_pallas_nvfp4.py", "test_device_report_smoke", 'device_report.main(["--smoke", "--out", str(tmp_path)'),
}


# Documented commands whose shrunk run, argument for argument, another test makes and checks in detail: exact command
# -> (test file, test, the name of the argument list it runs, which it completes with `--out` (a temporary folder)).
RUN_ELSEWHERE_EXACT = {
    "dflash-jax bench --nvfp4 --prompts 8 --model code-5m": (
        "test_dflash2_cli.py", "test_bench_nvfp4_prints_dflash2_rows_and_the_draft_cost_ratio", "BENCH_NVFP4_SHRUNK"),
    # the same DFlash rows, the DFlash2 folder missing: run there right after the one above (its programs, warm)
    "dflash-jax bench --nvfp4 --dflash2 PATH --model code-5m": (
        "test_dflash2_cli.py", "test_bench_nvfp4_prints_dflash2_rows_and_the_draft_cost_ratio",
        "BENCH_NVFP4_DFLASH2_PATH_SHRUNK"),
    "dflash-jax bench --nvfp4 --prompts 1 --new-tokens 32 --dflash2 /tmp/d2/out --model code-5m": (
        "test_dflash2_cli.py", "test_bench_nvfp4_prints_dflash2_rows_and_the_draft_cost_ratio",
        "BENCH_NVFP4_DFLASH2_D2_OUT_SHRUNK"),
}


def _run_elsewhere(command: str):
    if command in RUN_ELSEWHERE_EXACT:
        return RUN_ELSEWHERE_EXACT[command][:2]
    return next((v for k, v in RUN_ELSEWHERE.items() if command.startswith(k)), None)


# Documented commands that, shrunk, are another documented command's shrunk run plus options whose code path another
# test runs: prefix -> (the other command, the extra options, the test running them, what that test passes).
# README's DFlash2 example adds only `--eval-every 0` (no evaluation) to `train-drafter --kind dflash2`.
SAME_RUN_PLUS = {
    "dflash-jax train-drafter --kind dflash2 --work-dir /tmp/d2": (
        "dflash-jax train-drafter --kind dflash2", ("--eval-every", "0"),
        "test_train_dflash2.py::test_cli_trains_end_to_end_and_resumes", '"--eval-every", "0"'),
}


# Documented commands whose shrunk run is a part of another documented command's, which runs here: command -> (the
# other command, the options it adds). `--draft-passes` defaults to the whole block ("block"): `bench --step-table
# --draft-passes block drafted` prints every row `bench --step-table` prints, and its "drafted" rows besides.
COVERED_BY = {
    "dflash-jax bench --step-table --prompts 4 --new-tokens 128": (
        "dflash-jax bench --step-table --draft-passes block drafted", ("--draft-passes", "block", "drafted")),
}


def _covered_by(command: str):
    return COVERED_BY.get(command)


def _same_run_plus(command: str):
    return next((v for k, v in SAME_RUN_PLUS.items() if command.startswith(k)), None)


def test_every_docs_page_is_linked_and_every_link_resolves():
    """The README is the front page: every page of docs/ is linked from it, and every relative link of the README and
    the pages names a file of the repository (a moved section leaves no dead link)."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "no docs/ pages"
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in pages if f"(docs/{p.name})" not in readme] == []
    dead = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                dead.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert dead == []


def test_the_shrink_changes_sizes_only():
    """No shrink picks what a user's run depends on: a model, a drafter kind, a draft length, a temperature."""
    assert not {"--model", "--kind", "--draft-length", "--draft-vocab", "--temperature", "--target"} & set(TINY)


def test_the_docs_document_commands():
    """The collector finds the commands it must (a parsing regression would otherwise pass silently)."""
    assert any(c.startswith("dflash-jax generate") for c in COMMANDS), COMMANDS
    assert any(c.startswith("dflash-jax bench --tau-table") for c in COMMANDS), COMMANDS
    assert any(c.startswith("dflash-jax train-drafter") for c in COMMANDS), COMMANDS


def test_commands_that_shrink_to_the_same_run_run_once():
    assert _same_tiny_run("dflash-jax train-target --out checkpoints/target_v2") == "dflash-jax train-target"
    assert _same_tiny_run("dflash-jax train-target") is None
    assert _same_tiny_run("dflash-jax quality") is None


def test_commands_run_elsewhere_are_run_there_as_documented(tmp_path):
    """A documented command skipped here is documented (so the skip is not stale), its shrunk form takes nothing
    beyond the tiny flags, the output folder and the budget, and the named test makes that very call."""
    for prefix, (file, test, call) in RUN_ELSEWHERE.items():
        commands = [c for c in COMMANDS if c.startswith(prefix)]
        assert commands, f"{prefix!r} is no longer documented: drop it from RUN_ELSEWHERE"
        for command in commands:
            main, args = tiny(command, tmp_path)
            rest = [a for a in args if a not in TINY_FLAGS]
            options = {rest[i] for i in range(0, len(rest), 2)}
            assert len(rest) % 2 == 0 and options <= {"--budget-s", *OUTPUTS}, (command, args)
        source = (ROOT / "tests" / file).read_text()
        assert f"def {test}(" in source and call in source, (file, test, call)


def test_commands_run_exactly_elsewhere_are_that_very_run(tmp_path):
    """The other test's argument list plus `--out` is the documented command's shrunk form, and the test runs it."""
    for command, (file, test, name) in RUN_ELSEWHERE_EXACT.items():
        assert command in COMMANDS, f"{command!r} is no longer documented: drop it from RUN_ELSEWHERE_EXACT"
        module = importlib.import_module(Path(file).stem)  # the tests folder is on sys.path
        main, args = tiny(command, tmp_path)
        assert main is importlib.import_module("dflash_jax.cli").main
        assert args == getattr(module, name) + ["--out", str(tmp_path / "out")], (command, args)
        source = (ROOT / "tests" / file).read_text()
        body = source[source.index(f"def {test}("):].split("\ndef ")[0]
        assert f"cli.main({name} + [\"--out\", str(tmp_path / \"out\")])" in body, (file, test)


def test_commands_that_add_options_run_elsewhere_are_the_same_run_plus_those():
    """The skipped command's shrunk form is exactly the other documented command's plus the named options (order
    aside), the other command runs here, and the named test passes those options."""
    def groups(command):
        return set(_tiny_run_key(command)[2])  # option groups, output paths already sent to one temporary folder
    for prefix, (other, extra, test, passes) in SAME_RUN_PLUS.items():
        commands = [c for c in COMMANDS if c.startswith(prefix)]
        assert commands and other in COMMANDS, (prefix, other)
        assert _same_tiny_run(other) is None and _run_elsewhere(other) is None and _same_run_plus(other) is None
        for command in commands:
            assert _tiny_run_key(command)[:2] == _tiny_run_key(other)[:2], (command, other)  # same entry, subcommand
            assert groups(command) - groups(other) == {tuple(extra)}, (command, other)
            assert groups(other) - groups(command) == set(), (command, other)
        file, name = test.split("::")
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source and passes in source, test


def test_commands_covered_by_a_larger_run_are_part_of_it():
    """The skipped command's shrunk form is exactly the other's minus the named options, the other runs here (skipped
    by no rule), and those options' default is what the skipped command runs (the whole block)."""
    from dflash_jax import cli
    from dflash_jax.bench import speculative

    def groups(command):
        return set(_tiny_run_key(command)[2])
    for command, (other, extra) in COVERED_BY.items():
        assert command in COMMANDS and other in COMMANDS, (command, other)
        assert _tiny_run_key(command)[:2] == _tiny_run_key(other)[:2], (command, other)
        assert groups(other) - groups(command) == {tuple(extra)} and groups(command) <= groups(other), (command, other)
        assert (_same_tiny_run(other), _covered_by(other), _run_elsewhere(other), _same_run_plus(other)) == (None,) * 4
        assert is_bench(command) == is_bench(other)  # run by the same file
    # without --draft-passes a table measures the drafter's own pass, "block" where its config names none (the
    # default pair's does not)
    assert "--draft-passes" in _options(_help(cli.main, ["bench"]))
    assert 'passes = (drafter.config.draft_pass or "block",) if draft_passes is None' in inspect.getsource(
        speculative._variants)
    assert "draft_pass" not in (ROOT / "checkpoints" / "smollm2" / "drafter" / "dflash_jax.json").read_text()


def test_budget_overrides_are_generic():
    args = _set_option(["bench", "--new-tokens", "128", "512", "--nvfp4"], "--new-tokens", "6", multi=True)
    assert args == ["bench", "--new-tokens", "6", "--nvfp4"]
    assert _set_option(["x"], "--steps", "2") == ["x", "--steps", "2"]
    # a single-valued option keeps the positional written after it (the prompt of `generate --max-new-tokens 64 P`)
    args = _set_option(["generate", "--max-new-tokens", "64", "a prompt"], "--max-new-tokens", "4")
    assert args == ["generate", "--max-new-tokens", "4", "a prompt"]
    from dflash_jax import cli
    text = _help(cli.main, ["bench"])
    assert {"--new-tokens", "--batches", "--tree-budgets"} <= _multi_valued(text)
    assert not {"--prompts", "--draft-length", "--seed"} & _multi_valued(text)


@functools.cache
def _tiny_run_key(command: str):
    """What a documented command runs once shrunk, with options in any order ([--x 1 --y 2] == [--y 2 --x 1])."""
    main, args = tiny(command, Path("/documented-command-tmp"))
    groups, head = [], []
    for a in args:
        if a.startswith("--"):
            groups.append([a])
        elif groups:
            groups[-1].append(a)
        else:
            head.append(a)
    return main, tuple(head), tuple(sorted(map(tuple, groups)))


def _same_tiny_run(command: str) -> str | None:
    """An earlier documented command that runs exactly as this one once shrunk (e.g. `train-target` and
    `train-target --out X`: --out goes to the temporary folder in both), or None."""
    mine = _tiny_run_key(command)
    return next((c for c in COMMANDS[:COMMANDS.index(command)] if _tiny_run_key(c) == mine), None)


_LOAD_DEFAULT = shipped.load_default  # the loader itself (the tests below replace the module's name with a cache)


@functools.cache
def _load_default_once(model: str, compute_dtype, param_dtype, drafter: str):
    return _LOAD_DEFAULT(model=model, compute_dtype=compute_dtype, param_dtype=param_dtype, drafter=drafter)


def _shared_load_default(*, model=None, compute_dtype=None, param_dtype=None, drafter="dflash"):
    """`load_default`, each (model, dtypes, drafter) loaded once for every command of this file."""
    return _load_default_once(model or shipped.default_model(), compute_dtype, param_dtype, drafter)


def _as_a_user_runs_it(monkeypatch):
    """The environment a documented command runs in: the user's default model (not the suite's code-5m), the shipped
    models loaded once for all the commands."""
    from dflash_jax.bench import command as bench_command

    monkeypatch.delenv(shipped.MODEL_ENV_VAR, raising=False)
    monkeypatch.setattr(shipped, "load_default", _shared_load_default)
    monkeypatch.setattr(bench_command, "load_default", _shared_load_default)
    assert shipped.default_model() == "smollm2"


# What a documented command must print beyond something (prefix -> texts). The README's first command, on the default
# model: the request goes through the chat template, the answer is identical to plain greedy decoding, and tau and the
# speedup are printed (tests/test_smollm2.py ran it once more in a subprocess; this run is the one now).
PROMISES = {
    'dflash-jax generate "Write a Python function': ("user: Write a Python function", "assistant: ",
                                                      "identical to autoregressive output", "tau ", "x  (prefill"),
}


def is_bench(command: str) -> bool:
    """`dflash-jax bench ...`: run by tests/test_docs_bench_commands.py, every other documented command here."""
    return command.startswith("dflash-jax bench")


def run_documented(command: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """Run one documented command as a user would (shrunk), or skip it with the reason it runs elsewhere."""
    same = _same_tiny_run(command)
    if same is not None:
        cover = _covered_by(same)
        via = "" if cover is None else f", part of the run of {cover[0]!r}"
        pytest.skip(f"shrunk, it is the same run as {same!r}{via}")
    covered = _covered_by(command)
    if covered is not None:
        pytest.skip(f"shrunk, its rows are part of the run of {covered[0]!r} (which adds {' '.join(covered[1])})")
    elsewhere = _run_elsewhere(command)
    if elsewhere is not None:
        how = "argument for argument" if command in RUN_ELSEWHERE_EXACT else "with a full budget"
        pytest.skip(f"shrunk, it is the run tests/{elsewhere[0]}::{elsewhere[1]} makes ({how})")
    plus = _same_run_plus(command)
    if plus is not None:
        pytest.skip(f"shrunk, it is the run of {plus[0]!r} plus {' '.join(plus[1])} (run by tests/{plus[2]})")
    if command.startswith("python -m dflash_jax.bench.llamacpp") and importlib.util.find_spec("llama_cpp") is None:
        # llama.cpp is the outside reference this command runs (from another interpreter: --llama-python), never a
        # dependency of the project; tests/test_llamacpp_bench.py runs the same command with a stand-in child.
        pytest.skip("runs llama.cpp (llama-cpp-python), which is not installed here")
    if "--target smollm2" in command:
        # Shrunk, it still compiles every program of the 30-layer, 49k-vocabulary SmolLM2 (generation, features,
        # training, tau) on CPU: over 10 minutes. tests/test_smollm2.py runs the SmolLM2 default end to end instead.
        pytest.skip("trains against the 135M SmolLM2 target: minutes of compiles even when shrunk")
    main, args = tiny(command, tmp_path)
    monkeypatch.chdir(tmp_path)
    _as_a_user_runs_it(monkeypatch)
    try:
        main(args)
    finally:
        # Each command compiles dozens of SmolLM2 programs; kept for the whole file they piled up in one xdist worker
        # until an XLA call of a later command crashed it (a segfault writing the persistent cache, twice on CI, in
        # the last bench command of the file; the command alone passes). Programs a later command shares come back
        # from the persistent cache (tests/conftest.py) in a fraction of their compile time.
        jax.clear_caches()
        gc.collect()
    out = capsys.readouterr().out
    assert out.strip(), f"{command!r} (run as {args}) printed nothing"
    for prefix, texts in PROMISES.items():
        if command.startswith(prefix):
            assert all(text in out for text in texts), (command, texts, out[-2000:])


@pytest.mark.parametrize("command", [c for c in COMMANDS if not is_bench(c)])
def test_documented_command_runs(command, tmp_path, monkeypatch, capsys):
    run_documented(command, tmp_path, monkeypatch, capsys)


def test_ci_runs_exactly_the_readme_test_command():
    """`.ci/run` runs the test command the README's first lines give a new user, not a drifted copy of it."""
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    readme = [re.sub(r"\s+#.*$", "", p).strip() for line in first_block.splitlines() for p in line.split("&&")]
    readme = [p for p in readme if p.startswith("python -m pytest")]
    assert len(readme) == 1, first_block
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme[0] in ci, (readme[0], ci)
