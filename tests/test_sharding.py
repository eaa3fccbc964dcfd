"""Target and drafter over a device mesh (dflash_jax.parallel.sharding): rules, placement, generation, multi-process, loading.

Multi-device checks need XLA_FLAGS set before jax starts, so they run in subprocesses (tests/sharded_run.py: one
process with 8 virtual CPU devices, and a 2-process x 4-device jax.distributed job); this module only reads their
JSON. Host-side rules and errors are checked in-process on the one CPU device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.parallel import sharding as S
from dflash_jax.config import TargetConfig
from random_models import make_target
from dflash_jax.bench.mesh import xla_flags_with_devices

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "sharded_run.py"


def _env(devices: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags_with_devices(devices))
    return env


@pytest.fixture(scope="module")
def run8(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded") / "out.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=_env(8), capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(out.read_text())
    print("\n[sharding] " + json.dumps({k: v for k, v in res.items() if "fractions" not in k and "tokens" not in k}))
    return res


# -- on 8 devices (data 2 x model 4) ---------------------------------------------------------------------------------

def test_greedy_and_sampled_tokens_equal_one_device(run8):
    """Batch 8 on data 2 x model 4: greedy tokens identical to one device (dense and NVFP4 drafter, speculative and
    autoregressive), sampled tokens identical for the same seed."""
    assert run8["devices"] == 8
    for name in ("greedy", "nvfp4", "sampled", "autoregressive"):
        assert run8[f"{name}_equal"] == 1.0, name
        assert run8[f"{name}_tau"][0] == pytest.approx(run8[f"{name}_tau"][1]), name


def test_one_program_and_padding_rows(run8):
    """A second call compiles nothing; a batch of 7 (the data axis of 2 does not divide it) runs the batch-8 program
    with an inert padding row that never reaches the result."""
    assert run8["second_call_compile_s"] == 0.0 and run8["second_call_same"]
    assert run8["pad7_shape"] == [7, 10] and run8["pad7_equal"]
    assert run8["pad7_compile_s"] == 0.0


def test_each_device_holds_a_quarter_of_each_tp_weight(run8):
    tp = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
    for fractions in (run8["target_fractions"], run8["drafter_fractions"]):
        for name, f in fractions.items():
            want = 0.25 if name.split(".")[-1] in tp else 1.0  # k/v: 2 KV heads < model axis 4, replicated
            assert f == pytest.approx(want), (name, f)
    assert run8["nvfp4_fractions"]
    for name, (packed, block_scale, global_scale) in run8["nvfp4_fractions"].items():
        want = 0.25 if name.split(".")[-1] in tp else 1.0
        assert (packed, block_scale, global_scale) == (pytest.approx(want), pytest.approx(want), 1.0), name
    assert run8["devices_per_weight"] == 8  # every device holds a shard (replicated over the data axis)


def test_sharded_nvfp4_scales_all_reach_the_output(run8):
    """Audited on the sharded NVFP4 DFlash2 drafter: fc and the 7 linears of its layer (DFlash's NVFP4 leaves, under
    the same rules) plus its conv and selector projections."""
    linears = {f"layers[0].{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert {"fc"} | linears <= set(run8["dflash2_audit_checked"]) and run8["dflash2_audit_missing"] == []
    assert run8["sharded_draft_logits_close"]


def test_dflash2_drafter_shards_like_dflash(run8):
    """A DFlash2 drafter (non-trivial conv and selector) on the same mesh: greedy tokens equal to one device, dense
    and NVFP4; the selector's codebooks split along the vocabulary, the NVFP4 conv / selector projections audited."""
    for name in ("dflash2", "dflash2_nvfp4"):
        assert run8[f"{name}_equal"] == 1.0, name
        assert run8[f"{name}_tau"][0] == pytest.approx(run8[f"{name}_tau"][1]), name
    fr = run8["dflash2_fractions"]
    assert fr["candidate_selector.predecessor_codebook"] == 0.25
    assert fr["candidate_selector.successor_codebook"] == 0.25
    assert "candidate_selector.hidden_projection" in run8["dflash2_audit_checked"]
    assert sum("kernel_projection" in n for n in run8["dflash2_audit_checked"]) == 2
    assert run8["dflash2_audit_missing"] == []


def test_no_weight_all_gathers_in_the_decode_loop(run8):
    for name in ("dense", "nvfp4"):
        hlo = run8[f"hlo_{name}"]
        assert hlo["weight_all_gathers"] == [], (name, hlo)
        # Tensor parallelism does communicate: row-parallel o_proj / down_proj partial sums are all-reduced.
        assert hlo["decode_loop"]["all-reduce"] >= 2 * 3, (name, hlo)


def test_bad_meshes_are_refused_before_compiling(run8):
    e = run8["errors"]
    assert "num_attention_heads 4" in e["model8"] and "model axis of size 8" in e["model8"]
    assert "intermediate_size" not in e["model8"] and "vocab_size" not in e["model8"]  # 128 and 96 do split in 8
    assert "different meshes" in e["two_meshes"] and "{'data': 4, 'model': 2}" in e["two_meshes"]
    assert "not sharded" in e["unsharded_drafter"]
    assert "24 per shard" in e["nvfp4_blocks"] and "down_proj" in e["nvfp4_blocks"]
    assert "('data', 'model')" in e["mesh_axes"]
    assert run8["traces_after_errors"]


def test_checkpoints_load_straight_into_shards(run8):
    """save_hf folders (bf16 target, NVFP4 drafter) loaded with mesh=: the same placement as `shard` and, shard by
    shard, the same values as a one-device load."""
    assert run8["loaded_target_ok"] and run8["loaded_drafter_ok"]
    assert run8["loaded_dtype"] == "bfloat16"


# -- in-process, one device -----------------------------------------------------------------------------------------

def test_rules_replicate_kv_heads_below_the_model_axis():
    import jax
    mesh = S.make_mesh(1, 1)
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    rules = S.rules_for(cfg, mesh)
    assert rules.spec(("q_heads", "embed")) == jax.sharding.PartitionSpec("model", None)
    assert rules.spec(("embed", "mlp")) == jax.sharding.PartitionSpec(None, "model")
    with pytest.raises(S.ShardingError, match="data=3 does not divide"):
        S.make_mesh(data=3)
    with pytest.raises(S.ShardingError, match="2 devices, but 1 are available"):
        S.make_mesh(data=2, model=1)


def test_shard_on_one_device_keeps_generation():
    """A 1 x 1 mesh is a valid mesh: the same tokens as the unplaced models, through the mesh code path."""
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = make_target(cfg, 0)
    placed = S.shard(target, S.make_mesh(1, 1))
    assert S.mesh_of(placed) is not None and S.mesh_of(target) is None
    prompts = [[1, 2, 3], [4, 5]]
    a = dj.generate_autoregressive(target, prompts, max_new_tokens=6)
    b = dj.generate_autoregressive(placed, prompts, max_new_tokens=6)
    np.testing.assert_array_equal(a.tokens, b.tokens)


# -- two processes x 4 devices (jax.distributed, CPU collectives over gloo) ---------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_the_same_tokens(run8, tmp_path):
    """The same generation on 2 processes x 4 CPU devices (mesh data 2 x model 4 over all 8): every process gets the
    whole result, equal to one device's (the one-device tokens of the single-process run: same models, prompts and
    settings, so the processes do not compile the one-device programs again)."""
    port, out = _free_port(), tmp_path / "mp.json"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--devices", "4", "--process-id", str(i),
                               "--num-processes", "2", "--port", str(port)], env=_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        errs.append(err)
        assert p.returncode == 0, err[-6000:]
    results = [json.loads(out.read_text()), json.loads(Path(str(out) + ".1").read_text())]
    for res in results:
        assert res["devices"] == 8 and res["processes"] == 2
        for name in ("greedy", "nvfp4", "sampled"):
            assert res[f"{name}_tokens"] == run8[f"{name}_one_device_tokens"], name
        assert res["pad7_equal"]
        assert res["loaded_target_ok"] and res["loaded_drafter_ok"]
    assert results[0]["greedy_tau"] == results[1]["greedy_tau"]
