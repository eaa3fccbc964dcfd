"""train-drafter data parallel: the same command on a mesh of 8 (virtual CPU) devices in one process, and on 2
processes x 4 devices (`jax.distributed`, CPU collectives over gloo, a coordinator on localhost), trains the same
drafter as one device, to float tolerance (the gradient's sum over the batch is taken in another order).

The device count is fixed when JAX starts, so the mesh runs are subprocesses (`dflash-jax train-drafter` itself);
the one-device run is in this process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.bench.mesh import xla_flags_with_devices
from dflash_jax.train import drafter_run
from train_shards_data import add_shard, make_target, spec_of, train_args

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH = 3, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    spec = spec_of(make_target(tmp / "target"))
    for n in range(2):
        add_shard(tmp / "data", n, spec)
    return tmp


def _args(tmp, name, extra=()):
    return train_args(tmp / "target", tmp / "data", tmp / name, tmp / f"{name}_out", steps=STEPS, batch=BATCH,
                      extra=["--no-final-eval", *extra])


def _env(devices: int) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags_with_devices(devices))


def _cli(args, devices: int, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_jax.cli", "train-drafter", *args], env=_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(procs) -> None:
    for p in procs:
        try:
            _, err = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-6000:]


def _result(tmp, name):
    params = jax.tree.leaves(dj.load_drafter(tmp / f"{name}_out").params)
    log = [json.loads(line) for line in (tmp / name / "log.jsonl").read_text().splitlines()]
    report = json.loads((tmp / f"{name}_out" / "train_report.json").read_text())
    return params, log, report


@pytest.fixture(scope="module")
def one_device(setup):
    drafter_run.main(_args(setup, "one"))
    return _result(setup, "one")


def _assert_same_training(mine, ref):
    params, log, _ = mine
    ref_params, ref_log, _ = ref
    assert [r["step"] for r in log] == [r["step"] for r in ref_log]
    for a, b in zip(log, ref_log):  # the loss of the same batch, and the gradient's norm
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for x, y in zip(params, ref_params):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_eight_devices_train_as_one(setup, one_device):
    """--mesh-data 8: batch 8 split one row per device, the drafter replicated; then --mesh-data 4 --mesh-model 2
    would split heads the drafter does not have in pairs, so the rules' refusal is checked instead."""
    _finish([_cli(_args(setup, "eight", ["--mesh-data", "8"]), 8)])
    mine = _result(setup, "eight")
    assert mine[2]["devices"] == 8 and mine[2]["processes"] == 1
    _assert_same_training(mine, one_device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_as_one(setup, one_device):
    """The same command on 2 processes x 4 devices (a coordinator on localhost), one shared work dir: the same
    drafter as one device."""
    port = _free_port()
    flags = ["--mesh-data", "8", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    _finish([_cli(_args(setup, "two", flags + ["--process-id", str(i)]), 4) for i in range(2)])
    mine = _result(setup, "two")
    assert mine[2]["devices"] == 8 and mine[2]["processes"] == 2
    _assert_same_training(mine, one_device)


def test_a_batch_the_data_axis_does_not_divide_is_refused(setup):
    proc = _cli(_args(setup, "odd", ["--mesh-data", "8", "--batch", "6"]), 8)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "--batch 6 is not divisible by the mesh's data axis (8)" in err
