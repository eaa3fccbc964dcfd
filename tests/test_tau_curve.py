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
