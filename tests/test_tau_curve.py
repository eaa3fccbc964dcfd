"""The drafter curve file (`train.tau_curve collect`): variants from report files or out dirs, and a long run in legs
whose steps, CPU time and tokens read continue across legs."""

import json

from dflash_jax.train import tau_curve


def _report(step, cpu_s, seen, tau3, tau7):
    return {"step": step, "cpu_s": cpu_s, "answer_tokens_seen": seen, "data_answer_tokens": 1000, "train_loss": 3.0,
            "train_acc_slot1": 0.5, "heldout_tau_D3": tau3, "heldout_tau": tau7, "layers": 1, "block_size": 8}


def test_collect_variants_and_legs(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "train_report.json").write_text(json.dumps(_report(200, 480.0, 100, 1.2, 1.3)))
    (tmp_path / "kept.json").write_text(json.dumps(_report(200, 500.0, 90, 1.1, 1.15)))
    legs = [tmp_path / "leg1", tmp_path / "leg2"]
    for d in legs:
        d.mkdir()
    for step, cpu, seen, t in ((300, 500.0, 1000, 1.4), (600, 1000.0, 2000, 1.5)):
        (legs[0] / f"report_{step}.json").write_text(json.dumps(_report(step, cpu, seen, t, t)))
    (legs[1] / "report_600.json").write_text(json.dumps(_report(600, 900.0, 1500, 1.7, 1.8)))
    out = tau_curve.collect({"exp": tmp_path / "exp", "kept": tmp_path / "kept.json"}, legs, {"tau_D7": 1.0})
    assert [v["name"] for v in out["variants"]] == ["exp", "kept"] and out["variants"][1]["tau_D7"] == 1.15
    assert [(r["step"], r["cpu_s"], r["answer_tokens_seen"], r["leg"]) for r in out["long"]] == [
        (300, 500.0, 1000, 1), (600, 1000.0, 2000, 1), (1200, 1900.0, 3500, 2)]
    assert out["long"][-1]["tau_D7"] == 1.8 and out["long"][-1]["name"] == "long@1200"
    assert out["baseline"] == {"tau_D7": 1.0}


def test_branches_continue_from_the_leg_before_the_last(tmp_path):
    """A branch (another recipe from the same point, e.g. the drafter grown to 2 layers beside a third 1-layer leg)
    starts where the leg before the last ended, not after the last leg; a leg that does not exist is refused."""
    legs = [tmp_path / f"leg{i}" for i in (1, 2)]
    for d in legs + [tmp_path / "grow"]:
        d.mkdir()
    (legs[0] / "report_600.json").write_text(json.dumps(_report(600, 1000.0, 2000, 1.5, 1.5)))
    (legs[1] / "report_300.json").write_text(json.dumps(_report(300, 400.0, 700, 1.6, 1.6)))
    (tmp_path / "grow" / "report_300.json").write_text(json.dumps(_report(300, 700.0, 700, 1.7, 1.75)))
    out = tau_curve.collect({}, legs, None, {"grow2": tmp_path / "grow"})
    assert [(r["step"], r["cpu_s"], r["answer_tokens_seen"]) for r in out["long"]] == [(600, 1000.0, 2000),
                                                                                       (900, 1400.0, 2700)]
    (b,) = out["branches"]
    assert (b["name"], b["step"], b["cpu_s"], b["answer_tokens_seen"], b["tau_D7"]) == ("grow2@300", 900, 1700.0,
                                                                                        2700, 1.75)
    assert tau_curve.collect({}, legs, None, {"g": tmp_path / "grow"}, branch_after=2)["branches"][0]["step"] == 1200
    import pytest
    with pytest.raises(ValueError, match="--branch-after 5"):
        tau_curve.collect({}, legs, None, {"g": tmp_path / "grow"}, branch_after=5)
