"""The dflash-jax command on the embedded models."""

import re

from dflash_jax import cli
from dflash_jax.decode import programs


def test_generate_command(capsys, monkeypatch):
    monkeypatch.setattr(programs, "_COMPILED", {})  # trace everything anew: count this command's programs
    before = dict(programs.TRACE_COUNTS)
    cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "24", "--draft-length", "3"])
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):")
    assert "identical to autoregressive" in out and "tau" in out and "tokens/s" in out
    # The untimed first runs (2 new tokens) are the timed runs' programs: one prefill per pair of models, one loop each
    traced = {k: programs.TRACE_COUNTS[k] - before[k] for k in before}
    assert traced == {"prefill": 2, "speculative": 1, "autoregressive": 1}, traced


def test_a_plain_run_prints_no_speedup_ratio():
    """Where generate decoded plainly (draft_length 0: the step table predicts no speedup), the first command's two
    runs are the same program: it prints both speeds and no ratio (a "0.92x" there was noise); a drafting run prints
    the ratio."""
    plain = types.SimpleNamespace(draft_length=0, decode_tokens_per_second=275.5)
    spec = types.SimpleNamespace(draft_length=2, decode_tokens_per_second=330.0)
    ar = types.SimpleNamespace(decode_tokens_per_second=300.0)
    line = cli._speed_line(plain, ar)
    assert "275.5, plain decoding" in line and "300.0" in line and "->" not in line
    assert cli._speed_line(spec, ar) == "decode tokens/s: DFlash 330.0 vs autoregressive 300.0 -> 1.10x"
    # alternated runs: the median of each side (an even count: the mean of the middle two), and their ratio
    speeds = [(330.0, 310.0), (280.0, 290.0), (360.0, 300.0)]
    assert cli._speed_line(spec, ar, speeds) == "decode tokens/s: DFlash 330.0 vs autoregressive 300.0 -> 1.10x"
    assert cli._speed_line(spec, ar, speeds[1:]) == "decode tokens/s: DFlash 320.0 vs autoregressive 295.0 -> 1.08x"
    assert "312.5" in cli._speed_line(plain, ar, [(300.0, 310.0), (325.0, 315.0)])


def test_the_untimed_first_run_is_short_only_where_it_runs_the_same_program():
    assert [cli._same_program_budget(n) for n in (1, 2, 24, 256, 257, 1000)] == [1, 2, 2, 2, 257, 1000]


def test_bench_command_small(capsys):
    cli.main(["bench", "--new-tokens", "32", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "AR tok/s" in out and "speedup" in out and "r =" in out


# -- help lines: every subcommand and every option says what it does -----------------------------------------------

import argparse
import types
from pathlib import Path

import gguf
import numpy as np
import pytest

from dflash_jax import execution
from dflash_jax.quant import cpu_kernel, ggml


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(monkeypatch, main, argv):
    """The ArgumentParser a `main(argv)` builds, captured at its parse_args (nothing runs)."""
    def capture(self, *a, **k):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as e:
        main(argv)
    monkeypatch.undo()
    return e.value.parser


def _undocumented(parser, prefix):
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help and a.help != argparse.SUPPRESS}
            for cmd, sub in action.choices.items():
                if cmd not in helped:
                    missing.append(f"{prefix} {cmd} (subcommand)")
                missing += _undocumented(sub, f"{prefix} {cmd}")
        elif not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS:
            missing.append(f"{prefix} {name}")
    return missing


def test_every_subcommand_and_option_has_help(monkeypatch):
    from dflash_jax.bench import device_report
    from dflash_jax.train import drafter_run as train_drafter, target as train_target, tokenizer_train

    parsers = {"dflash-jax": _parser_of(monkeypatch, cli.main, ["generate", "x"]),
               "dflash-jax train-target": _parser_of(monkeypatch, train_target.main, []),
               "dflash-jax train-drafter": _parser_of(monkeypatch, train_drafter.main, []),
               "python -m dflash_jax.train.tokenizer_train": _parser_of(monkeypatch, tokenizer_train.main, []),
               "dflash-jax bench --device-report": _parser_of(monkeypatch, device_report.main, [])}
    subcommands = parsers["dflash-jax"]._subparsers._group_actions[0].choices
    assert {"generate", "bench", "quality", "train-target", "train-drafter"} <= set(subcommands)
    missing = [m for prefix, p in parsers.items() for m in _undocumented(p, prefix)]
    assert not missing, "options without a help line:\n  " + "\n  ".join(missing)


def test_the_help_walker_catches_a_missing_line():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("run", help="runs")
    s.add_argument("--fast", action="store_true")
    sub.add_parser("quiet")
    assert _undocumented(ap, "x") == ["x run --fast", "x quiet (subcommand)"]


def test_generate_no_compare(capsys, monkeypatch):
    import dflash_jax
    from dflash_jax.decode import programs as decoding

    def no_autoregressive(*a, **k):
        raise AssertionError("--no-compare ran the autoregressive baseline")

    for module in (dflash_jax, decoding):
        monkeypatch.setattr(module, "generate_autoregressive", no_autoregressive)
    cli.main(["generate", "def fibonacci(n):", "--max-new-tokens", "24", "--no-compare"])
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and "tau" in out and "tokens/s" not in out


def test_pair_goals_read_the_right_cells():
    """`bench --pair-table`'s summary: the tau ratio, speedups and exactness come from the cells they name."""
    from dflash_jax.bench import speculative as bench

    def row(T, D, n, tau, speedup, exact="4/4"):
        cell = {"tau": tau, "speedup": speedup, "exact_match": exact}
        return {"temperature": T, "draft_length": D, "max_new_tokens": n, "ar_tokens_per_s": 100.0,
                "dense": dict(cell), "nvfp4": dict(cell)}

    rows = [row(0.0, 7, 128, 4.0, 1.5), row(0.0, 7, 1024, 3.0, 1.2, "3/4"), row(0.0, 15, 128, 9.0, 9.0),
            row(0.7, 7, 128, 2.0, 1.1, "0/4"), row(0.7, 7, 1024, 1.0, 0.5, "0/4")]
    out = bench.format_pair_goals(rows)
    assert "tau at 1024 / tau at 128 tokens, greedy, D 7: 0.75" in out
    assert "speedup, greedy, D 7: 1.50x / 1.20x at 128 / 1024 tokens" in out
    assert "speedup at T 0.7, D 7: 1.10x / 0.50x at 128 / 1024 tokens" in out
    assert "identical to autoregressive: 22/24 runs" in out  # greedy rows only: 4+3+4 per drafter, 2 drafters
    table = bench.format_pair_table(rows, ("dense", "nvfp4"))
    assert len(table.splitlines()) == 2 + len(rows) and " - " in table.splitlines()[-1] + " "
    trees = [dict(row(0.0, 2, n, 1.8, s), tree_budget=2) for n, s in ((128, 1.4), (1024, 1.25))]
    out = bench.format_pair_goals(rows + trees)
    assert "speedup, greedy, tree 2: 1.40x / 1.25x at 128 / 1024 tokens" in out  # not read as the chain D 2
    assert "speedup, greedy, D 7: 1.50x / 1.20x" in out
    assert "tree 2" in bench.format_pair_table(trees, ("dense", "nvfp4")).splitlines()[-1]


def test_gguf_goals_quote_the_acceptance_rate_beside_tau():
    """`bench --gguf-roundtrip`'s replay line on made-up results: tau counts the bonus token, so a broken drafter
    that never gets a draft accepted still scores tau 1 (0.81x of an intact tau 1.24, above the 0.3x goal); the
    acceptance rate (accepted drafts / drafted tokens) is the figure that collapses, and its counts are shown."""
    from dflash_jax.bench import gguf_replay as bench

    def cell(accepted, steps, D=7):  # a compare() cell from its counts: tau = tokens per step incl. the bonus
        return {"tau": 1 + accepted / steps, "acceptance_rate": accepted / (steps * D), "accepted": accepted,
                "drafted": steps * D, "tokens_per_s": 1.0, "speedup": 1.0, "exact_match": "3/3"}

    intact, never = cell(24, 100), cell(0, 128)
    r = {"max_new_tokens": 128, "draft_length": 7, "nvfp4": intact, "nvfp4 gguf": intact,
         "nvfp4 gguf attn scale=1": never}
    fig = bench.replay_figures(r, "nvfp4 gguf", "nvfp4 gguf attn scale=1")
    assert fig["tau"] == (1.24, 1.0) and abs(fig["tau_floor"] - 1 / 1.24) < 1e-12
    assert fig["tau_ratio"] > bench.REPLAY_GOAL and fig["acceptance_ratio"] == 0.0
    line = bench.format_replay(fig)
    assert "acceptance rate 3.43% (24/700) -> 0.00% (0/896) = 0.00x (goal <= 0.3x: met)" in line
    assert "tau 1.240 -> 1.000 = 0.81x (floor 1/tau 0.81x)" in line
    half = dict(r, **{"nvfp4 gguf attn scale=1": cell(12, 100)})  # half the acceptance: not a collapse
    assert "= 0.50x (goal <= 0.3x: NOT met)" in bench.format_replay(
        bench.replay_figures(half, "nvfp4 gguf", "nvfp4 gguf attn scale=1"))
    # DFlash2 rows get their own line; the in-memory vs read-back tau is quoted for each kind
    both = dict(r, **{"dflash2 nvfp4": intact, "dflash2 nvfp4 gguf": intact, "dflash2 nvfp4 gguf attn scale=1":
                      cell(1, 100)})
    out = bench.format_gguf_goals([both], {"nvfp4 -> GGUF -> nvfp4": True})
    assert out.count("attention .scale = 1 vs intact GGUF: acceptance rate") == 2
    assert "dflash2 nvfp4: tau 1.240 in memory vs 1.240 read back" in out and "(1/700) = 0.04x" in out
    assert "nvfp4 -> GGUF -> nvfp4: greedy tokens identical to the in-memory drafter's on every prompt: True" in out


def test_calibration_anchors_below_one_is_a_clear_error(capsys):
    # checked before any model loads (the tests' shrunk tau table takes 2; 0 would calibrate nothing)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--tau-table", "--nvfp4", "--calibration-anchors", "0"])
    assert "--calibration-anchors must be >= 1, got 0" in capsys.readouterr().err


# -- defaults follow the loaded drafter ------------------------------------------------------------------------------

def _tiny_pair_with_block(block_size: int):
    """A random tiny pair whose drafter's block is `block_size` tokens, with the code-5m tokenizer (its vocabulary)."""
    import jax

    import dflash_jax as dj
    from dflash_jax.io.shipped import checkpoints_dir

    tok = dj.Tokenizer.from_file(checkpoints_dir() / "tokenizer.json")
    cfg = dj.TargetConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    dcfg = dj.DrafterConfig(model=cfg.replace(num_hidden_layers=1), block_size=block_size, mask_token_id=tok.mask_id,
                            target_layer_ids=(1, 2), num_target_layers=4)
    return dj.init_target(cfg, jax.random.key(0)), dj.init_drafter(dcfg, jax.random.key(1)), tok


def test_draft_lengths_are_those_the_block_holds():
    from dflash_jax.bench.command import draft_lengths

    class D:  # a drafter as draft_lengths sees one
        def __init__(self, block_size):
            self.config = argparse.Namespace(block_size=block_size)

    assert draft_lengths([D(16)], (3, 7, 15)) == (3, 7, 15)
    assert draft_lengths([D(8)], (3, 7, 15)) == (3, 7)  # the shipped SmolLM2 drafter
    assert draft_lengths([D(8), D(16)], (7, 15)) == (7,)  # every drafter of a table must hold it
    assert draft_lengths([D(4)], (7, 15)) == (3,)  # none fits: the longest the block holds
    assert draft_lengths([D(2)], (1, 3, 7)) == (1,)


def test_bench_tables_take_their_draft_lengths_from_the_drafter(monkeypatch, tmp_path, capsys):
    """`bench --tau-table --nvfp4` once asked a block-8 drafter for D = 15 (`draft_length must be in 1..7`): every
    table's draft lengths now come from the loaded drafter's block. A block-4 drafter runs the tau table and the pair
    table at D = 3 (the only length of 3/7/15 it holds; the pair table: generate's own choice, without a step table
    the longest it holds) and the --nvfp4 bench at D = 3 (not the report's 7); an explicit length beyond the block
    is refused before anything runs. (The documented commands themselves run on the default pair, whose block is 8,
    in tests/test_docs_commands.py.)"""
    from dflash_jax.bench import command

    pair = _tiny_pair_with_block(4)
    monkeypatch.setattr(command, "load_default", lambda **kw: pair)
    small = ["--prompts", "1", "--new-tokens", "4", "--dflash2", str(tmp_path / "none")]  # no DFlash2 rows
    cli.main(["bench", "--tau-table"] + small)
    table = capsys.readouterr().out.split("-" * 100 + "\n")[1].splitlines()
    assert [(line[:16].strip(), int(line[16:20])) for line in table] == [("dense", 3)], table
    cli.main(["bench", "--pair-table", "--temperature", "0", "--prompts", "1", "--new-tokens", "4"])
    out = capsys.readouterr().out  # no setting named: generate's own (no step table here: block_size - 1)
    assert [line.split()[:4] for line in out.splitlines() if line.startswith(" 0.0 ")] == [
        ["0.0", "default:", "D", "3"]], out
    cli.main(["bench", "--pair-table", "--temperature", "0", "--prompts", "1", "--new-tokens", "4",
              "--tree-budgets", "2"])
    out = capsys.readouterr().out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith(" 0.0 ")] == [["0.0", "tree", "2"]], out
    cli.main(["bench", "--nvfp4"] + small)
    assert "draft length 3 (block 4)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--draft-length 7: the drafter's block holds 4 tokens .*so 1\.\.3"):
        cli.main(["bench", "--pair-table", "--draft-length", "7", "--prompts", "1", "--new-tokens", "4"])


@pytest.mark.parametrize("bad,message", [(["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
                                         (["--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
                                         (["--top-k", "-1"], r"--top-k must be >= 0 \(0: off\), got -1")])
@pytest.mark.parametrize("command", [["generate", "def f():"], ["bench", "--pair-table"]])
def test_bad_sampling_filters_are_refused_before_anything_loads(command, bad, message, capsys, monkeypatch):
    from dflash_jax.io import shipped

    monkeypatch.setattr(shipped, "load_default", lambda **kw: pytest.fail("loaded the models"))
    with pytest.raises(SystemExit):
        cli.main(command + bad)
    assert re.search(message, capsys.readouterr().err)


def test_the_sampling_filters_reach_both_runs(monkeypatch, tmp_path, capsys):
    """`--top-p` / `--top-k` go to the speculative and the autoregressive run alike (what the table compares), and
    the header names them."""
    from dflash_jax.bench import command, speculative

    pair = _tiny_pair_with_block(4)
    monkeypatch.setattr(command, "load_default", lambda **kw: pair)
    seen = []
    for name in ("generate", "generate_autoregressive"):
        real = getattr(speculative, name)

        def spy(*a, _real=real, _name=name, **k):
            seen.append((_name, k.get("temperature"), k.get("top_p"), k.get("top_k")))
            return _real(*a, **k)
        monkeypatch.setattr(speculative, name, spy)
    cli.main(["bench", "--pair-table", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--prompts", "1",
              "--new-tokens", "4"])
    assert "rejection sampling with top-p 0.9, top-k 20" in capsys.readouterr().out
    assert {n for n, *_ in seen} == {"generate", "generate_autoregressive"}
    assert {tuple(x) for _, *x in seen} == {(0.7, 0.9, 20)}, seen


def test_the_acceptance_line_of_plain_decoding_has_no_rate():
    """Where generate decodes plainly (the step table predicts no speedup), nothing was drafted: the line says so and
    gives tau 1.00, never an acceptance rate of 0 / 0 ('nan%')."""
    import types

    from dflash_jax.cli import _acceptance

    plain = types.SimpleNamespace(draft_length=0, tree_budget=None, tau=1.0, acceptance_rate=float("nan"),
                                  draft_pass=None, context_lookup=0)
    line = _acceptance(plain)
    assert line.startswith("tau 1.00 (no drafts: none (plain decoding") and "nan" not in line, line
    chain = types.SimpleNamespace(draft_length=3, tree_budget=None, tau=2.5, acceptance_rate=0.5, draft_pass="block",
                                  context_lookup=0)
    assert _acceptance(chain).startswith("tau 2.50 (tokens per draft+verify step, incl. bonus), acceptance rate 50.0%")
    assert _acceptance(chain).endswith("of 3 drafted per step")
    short = types.SimpleNamespace(**{**vars(chain), "draft_pass": "drafted"})
    assert _acceptance(short).endswith("of 3 drafted (a draft pass over the drafted slots only) per step")
    copying = types.SimpleNamespace(**{**vars(short), "context_lookup": 2})
    assert _acceptance(copying).endswith("of 3 drafted (a draft pass over the drafted slots only; the first copied "
                                         "from the continuation of a 2+ token repeat in the text, where one exists) "
                                         "per step")


def test_help_and_the_package_import_load_no_jax():
    """`import dflash_jax` and the command's parser load no JAX (the package's names load on first use): `--help`
    answers at once; reading a public name then loads it."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "import dflash_jax, dflash_jax.cli as cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    cli.main(['generate', '--help'])\n"
            "print('jax' in sys.modules)\n"
            "dflash_jax.generate\n"
            "print('jax' in sys.modules, sorted(set(dflash_jax.__all__) - set(dir(dflash_jax))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["False", "True []"], out


def test_the_package_names_static_tools_see_are_the_names_it_loads():
    """The package lists its public names twice: `_WHERE` (what `__getattr__` loads on first use) and the
    `TYPE_CHECKING` imports (what type checkers and IDEs read). Both name the same modules, and every name loads the
    very object the eager import gives (`dflash_jax.audit_file` is the function, not its module of the same name)."""
    import ast
    import importlib

    import dflash_jax

    tree = ast.parse(Path(dflash_jax.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    static = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname is None, ast.unparse(node)
            static[alias.name] = node.module
            eager = getattr(importlib.import_module(node.module), alias.name, None)
            if eager is None:  # `from package import module`, the module not imported yet
                eager = importlib.import_module(f"{node.module}.{alias.name}")
            assert getattr(dflash_jax, alias.name) is eager, alias.name
            assert (alias.name in dflash_jax._MODULES) == (type(eager) is type(dflash_jax)), alias.name
    where = {n: m.rsplit(".", 1)[0] if n in dflash_jax._MODULES else m for n, m in dflash_jax._WHERE.items()}
    assert static == where
    assert callable(dflash_jax.audit_file) and callable(dflash_jax.generate)


def test_the_kernel_note_points_at_q8_activations_where_they_decode_faster(monkeypatch):
    """A GGUF target's blocks with float32 activations: the note names --q8-activations on an AVX2 build (~2x) and on
    an AVX-512 CPU with VNNI on 256-bit units (~1.3x, a Zen 4 EPYC), not on one without VNNI or with full-width units
    (a Zen 5), where they bought nothing; on a full-width AVX-512 CPU with AVX512-BF16 generation takes bfloat16
    products by default (a verify's rows cheaper) and the note says so and names --f32-products; asked for by name
    (--bf16-products, --f32-products) the note states the products without a hint."""
    if not cpu_kernel.available():
        pytest.skip(f"CPU kernel: {cpu_kernel.unavailable_reason()}")
    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    blocks = ggml.from_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), "Q4_1", w.shape)
    target = types.SimpleNamespace(params={"w": blocks})
    notes = {}
    for build, flags, family in (("avx2", "flags : fpu avx2", 23), ("avx512", "flags : avx512f avx512vl", 25),
                                 ("avx512", "flags : avx512f avx512vl avx512_vnni", 25),
                                 ("avx512", "flags : avx512f avx512vl avx512_vnni", 26),
                                 ("avx512", "flags : avx512f avx512vl avx512_vnni avx512_bf16", 26)):
        monkeypatch.setattr(cpu_kernel, "isa", lambda build=build: build)
        monkeypatch.setattr(cpu_kernel, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(cpu_kernel, "_cpu_vendor_family", lambda family=family: ("AuthenticAMD", family))
        notes[build, "vnni" in flags, family] = cli._kernel_note(target)
        notes[build, "vnni" in flags, family, "bf16" in flags] = notes[build, "vnni" in flags, family]
    assert notes["avx2", False, 23].endswith("avx2 build (--q8-activations: llama.cpp's integer dot, ~2x the decode "
                                             "speed on this build)")
    assert notes["avx512", False, 25] == "; CPU kernel: avx512 build"
    assert "--q8-activations" in notes["avx512", True, 25] and "VNNI" in notes["avx512", True, 25]
    assert notes["avx512", True, 26, False] == "; CPU kernel: avx512 build"
    assert notes["avx512", True, 26, True] == ("; CPU kernel: avx512 build, bfloat16 products (AVX512-BF16's dot "
                                               "product, this CPU's default; --f32-products for float32 ones)")
    with execution.changed(bf16_products=True):
        assert cli._kernel_note(target) == "; CPU kernel: avx512 build, bfloat16 products"
    with execution.changed(bf16_products=False):
        assert cli._kernel_note(target) == "; CPU kernel: avx512 build"
    assert cli._kernel_note(types.SimpleNamespace(params={"w": np.ones((2, 2), np.float32)})).count("q8") == 0
