"""DFlash2 through the command line and the default-models loader."""

import jax
import pytest

import dflash_jax as dj
from dflash_jax import cli
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


def test_bench_nvfp4_prints_dflash2_rows_and_the_draft_cost_ratio(tmp_path, capsys):
    target, _, tok = dj.load_default()
    d2 = dj.init_drafter(shipped_drafter2_config(target.config, tok.mask_id), jax.random.key(0))
    dj.save(tmp_path / "d2", d2)
    cli.main(["bench", "--nvfp4", "--new-tokens", "24", "--prompts", "1", "--dflash2", str(tmp_path / "d2")])
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
    assert "greedy output identical to autoregressive: 7/7 runs over 7 drafters" in out
