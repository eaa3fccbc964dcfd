"""DFlash2 through the command line and the default-models loader."""

import jax
import pytest

import dflash_jax as dj
from dflash_jax import cli
from dflash_jax.bench import command
from dflash_jax.io.shipped import checkpoints_dir
from dflash_jax.train.drafter2 import shipped_drafter2_config


def test_load_default_dflash2_says_what_to_do_until_one_is_shipped():
    if (checkpoints_dir() / "drafter2").exists():
        target, drafter, tok = dj.load_default(drafter="dflash2")
        assert drafter.config.kind == "dflash2" and drafter.config.mask_token_id == tok.mask_id
        return
    with pytest.raises(FileNotFoundError, match=r"no shipped DFlash2 drafter.*train-drafter --kind dflash2"):
        dj.load_default(drafter="dflash2")
    with pytest.raises(ValueError, match="drafter must be one of"):
        dj.load_default(drafter="eagle")
    assert dj.load_default()[1].config.kind == "dflash"  # unchanged


# docs/training.md's `dflash-jax bench --nvfp4 --prompts 8 --model code-5m`, exactly as tests/test_docs_commands.py
# shrinks it: that test does not run it again (RUN_ELSEWHERE_EXACT there checks each call below is its shrunk command,
# argument for argument). (--calibration-anchors, --reps and --smoke are taken by every bench and used only by
# --tau-table / --step-table / --device-report)
BENCH_NVFP4_SHRUNK = ["bench", "--nvfp4", "--prompts", "2", "--model", "code-5m", "--new-tokens", "6", "--reps", "2",
                      "--calibration-anchors", "1", "--smoke"]
# docs/training.md's `bench --nvfp4 --dflash2 PATH --model code-5m` and `... --dflash2 /tmp/d2/out --model code-5m`,
# shrunk: the same DFlash rows with a DFlash2 folder that is not there (rows skipped with a note), run right after the
# bench above, whose programs they reuse.
BENCH_NVFP4_DFLASH2_PATH_SHRUNK = ["bench", "--nvfp4", "--dflash2", "PATH", "--model", "code-5m", "--new-tokens", "6",
                                   "--prompts", "2", "--reps", "2", "--calibration-anchors", "1", "--smoke"]
BENCH_NVFP4_DFLASH2_D2_OUT_SHRUNK = ["bench", "--nvfp4", "--prompts", "2", "--new-tokens", "6", "--dflash2",
                                     "/tmp/d2/out", "--model", "code-5m", "--reps", "2", "--calibration-anchors", "1",
                                     "--smoke"]


def test_bench_nvfp4_prints_dflash2_rows_and_the_draft_cost_ratio(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli.main(BENCH_NVFP4_SHRUNK + ["--out", str(tmp_path / "out")])  # the shipped DFlash2 drafter
    out = capsys.readouterr().out
    assert "nvfp4 no-scale tok/s" in out and "nvfp4 tok/s" in out  # the DFlash rows
    assert "DFlash2 drafter (same prompts, same run):" in out
    for row in ("dflash2 tok/s", "dflash2 nvfp4 tok/s", "dflash2 nvfp4 no-scale tok/s",
                "dflash2 nvfp4 no conv/sel scale tok/s"):
        assert row in out, row
    assert "dflash2 / dflash draft cost c ratio:" in out
    # the DFlash2 goal figures, computed from the same run (greedy: every row of both kinds is exact)
    assert "DFlash2/DFlash tau, NVFP4 both" in out and "NVFP4/dense DFlash2 tau" in out
    assert "draft cost c DFlash2/DFlash" in out
    assert "greedy output identical to autoregressive: 14/14 runs over 7 drafters" in out  # 7 drafters x 2 prompts

    cli.main(BENCH_NVFP4_DFLASH2_PATH_SHRUNK + ["--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "nvfp4 no-scale tok/s" in out and "nvfp4 tok/s" in out and "dflash2 tok/s" not in out
    assert "(no DFlash2 drafter at PATH: DFlash2 rows skipped" in out  # PATH: none in this temporary folder
    cli.main(BENCH_NVFP4_DFLASH2_D2_OUT_SHRUNK + ["--out", str(tmp_path / "out")])
    out = capsys.readouterr().out  # (DFlash2 rows too if docs/training.md's example left a drafter in /tmp/d2/out)
    assert "nvfp4 no-scale tok/s" in out and "nvfp4 tok/s" in out


def test_bench_dflash2_path_loads_that_folder_and_refuses_a_dflash_one(tmp_path):
    """--dflash2 PATH (the bench above takes the shipped drafter2): a saved DFlash2 folder is what the rows use; a
    DFlash folder is refused by name. (A missing folder skips the rows with a note: docs/training.md's
    `--dflash2 PATH`, run here by the test above.)"""
    import argparse

    target, drafter, tok = dj.load_default()
    d2 = dj.init_drafter(shipped_drafter2_config(target.config, tok.mask_id), jax.random.key(0))
    dj.save(tmp_path / "d2", d2)
    dj.save(tmp_path / "d1", drafter)
    got = command.dflash2_drafter(argparse.Namespace(dflash2=str(tmp_path / "d2"), model=None))
    assert got.config == d2.config
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(d2.params)))
    with pytest.raises(SystemExit, match="holds a dflash drafter, not a DFlash2 one"):
        command.dflash2_drafter(argparse.Namespace(dflash2=str(tmp_path / "d1"), model=None))
