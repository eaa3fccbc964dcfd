"""The research notebooks: committed executed, with their figures, and kept fresh.

Cheap checks read the committed notebooks and their key-number files (notebooks/<name>.json); the expensive one
re-executes each notebook (acceptance_vs_length at its quick size) and compares the key numbers it shows with the
committed ones. When any fails after the models, the decoding or a notebook changed: run
`python notebooks/make_notebooks.py --execute` and commit the result.
"""

import json
import math
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "notebooks"))
import make_notebooks as mk  # noqa: E402

NAMES = list(mk.NOTEBOOKS)
RERUN = "run `python notebooks/make_notebooks.py --execute` and commit the notebooks and their .json files"
QUICK_SUBSET = {"acceptance_vs_length", "draft_trees"}  # executed at a smaller size in tests: keys a subset


def committed(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    rec = json.loads((ROOT / "notebooks" / f"{name}.json").read_text())
    return nb, rec


def test_the_notebooks_exist():
    assert set(NAMES) == {"quickstart", "nvfp4_drafter", "acceptance_vs_length", "draft_trees", "training",
                          "sharding"}
    assert {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")} == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_executed_with_its_figures(name):
    nb, rec = committed(name)
    path = ROOT / "notebooks" / f"{name}.ipynb"
    assert path.stat().st_size < 1_000_000
    assert [c.source for c in nb.cells] == [c.source for c in mk.build(name).cells], \
        f"{name}.ipynb differs from make_notebooks.py: {RERUN}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{name}.ipynb is not executed: {RERUN}"
    assert not mk.errors(nb)
    promised = mk.NOTEBOOKS[name]["figures"]
    assert mk.figure_count(nb) == rec["figures"] == nb.metadata["dflash_jax"]["figures"] == promised
    assert nb.cells[-1].cell_type == "code" and "image/png" in nb.cells[-1].outputs[-1].get("data", {}), \
        "each notebook ends in a figure"
    shown = mk.key_numbers(nb)
    assert shown and shown == {k: rec[k] for k in mk.KINDS if k in rec}, "key numbers differ from the .json"


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_ran_on_the_shipped_models(name):
    _, rec = committed(name)
    assert rec["models"] == mk.fingerprint(mk.NOTEBOOKS[name]["models"]), \
        f"the shipped models or logs changed since {name} ran: {RERUN}"


def test_committed_acceptance_vs_length_is_the_full_grid():
    _, rec = committed("acceptance_vs_length")
    for drafter in ("dense", "nvfp4"):
        for L in (128, 256, 512, 1024):
            assert f"tau_{drafter}_T0.0_L{L}" in rec["numbers"]
            for T in (0.7, 1.0):
                assert f"tau_{drafter}_T{T}_L{L}" in rec["sampled"]
                assert f"speedup_{drafter}_T{T}_L{L}" in rec["timings"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_reproduces_its_committed_numbers(name):
    _, rec = committed(name)
    nb = mk.execute(mk.build(name), timeout=900, env={mk.QUICK_ENV: "1"})
    assert not mk.errors(nb)
    assert mk.figure_count(nb) == mk.NOTEBOOKS[name]["figures"]
    fresh = mk.key_numbers(nb)
    for kind in ("numbers", "sampled"):
        names, old = set(fresh.get(kind, {})), set(rec.get(kind, {}))
        assert names <= old, f"{kind} not in the committed {name}.json: {sorted(names - old)}; {RERUN}"
        if name not in QUICK_SUBSET:
            assert names == old, f"committed {kind} no longer shown: {sorted(old - names)}; {RERUN}"
    assert fresh.get("numbers"), "nothing compared"
    diffs = mk.differences(rec, fresh)
    assert not diffs, f"{name}: committed numbers are stale:\n  " + "\n  ".join(diffs) + f"\n{RERUN}"


def test_differences_flag_what_matters_and_only_that():
    old = {"numbers": {"tokens": [128, 96], "tau": 5.0, "missing": ["a.v_proj"], "fit": {"alpha": 0.5}},
           "sampled": {"tau_T1": 4.0}, "timings": {"speedup": 2.0}}
    same = json.loads(json.dumps(old))
    same["numbers"]["tau"] += 1e-5
    same["sampled"]["tau_T1"] += 0.2
    same["timings"]["speedup"] = 0.5  # timings are never compared
    assert mk.differences(old, same) == []
    for kind, key, value in [("numbers", "tokens", [128, 97]), ("numbers", "tau", 5.05),
                             ("numbers", "missing", ["a.o_proj"]), ("numbers", "fit", {"alpha": 0.6}),
                             ("sampled", "tau_T1", 4.5), ("numbers", "tokens", [128])]:
        bad = json.loads(json.dumps(old))
        bad[kind][key] = value
        assert len(mk.differences(old, bad)) == 1, (key, value)


def test_training_notebook_reads_logs_and_fits_the_loss(tmp_path):
    """On a synthetic run: resumed steps (the last write wins) and a known power law, recovered by the fit."""
    root = tmp_path / "checkpoints"
    for kind in ("target", "drafter"):
        (root / kind).mkdir(parents=True)
    (root / "tokenizer.json").write_text("{}")
    E, A, alpha, per_step = 2.0, 3.0, 0.5, 4096
    law = lambda step: E + A * ((step + 1) * per_step / 1e6) ** -alpha
    recs = []
    for s in range(0, 2400, 10):
        r = {"step": s, "elapsed_s": float(s), "loss": law(s) - 0.1, "grad_norm": 1.0}
        if s and s % 300 == 0 or s == 2390:
            r["heldout_loss"] = law(s)
        recs.append(r)
    # a crash after step 1500, resumed from the step-1200 checkpoint: steps 1200..1500 are logged twice
    lost = [dict(r, loss=99.0, **({"heldout_loss": 99.0} if "heldout_loss" in r else {})) for r in recs[120:151]]
    lines = recs[:120] + lost + recs[120:]
    (root / "target" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (root / "target" / "train_report.json").write_text(json.dumps(
        {"steps": 2400, "tokens_seen": 2400 * per_step, "params": 1, "train_loss": recs[-1]["loss"],
         "heldout_loss": law(2399)}))
    (root / "drafter" / "train_report.json").write_text(json.dumps({"steps": 10, "params": 1, "train_loss": 0.5}))
    nb = mk.execute(mk.build("training"), timeout=300, env={"DFLASH_JAX_CHECKPOINTS": str(root)})
    assert not mk.errors(nb) and mk.figure_count(nb) == mk.NOTEBOOKS["training"]["figures"]
    keys = mk.key_numbers(nb)["numbers"]
    assert keys["target_log_records"] == 240 and keys["drafter_log_records"] == 0
    assert all(loss != 99.0 for _, loss in keys["heldout_curve"])
    fit = keys["fit"]
    assert math.isclose(fit["alpha"], alpha, abs_tol=0.02) and math.isclose(fit["E"], E, abs_tol=0.05)
    D_now = 2391 * per_step  # the last held-out evaluation
    assert math.isclose(keys["predicted_heldout_loss"]["x10"], E + A * (10 * D_now / 1e6) ** -alpha, abs_tol=0.03)
