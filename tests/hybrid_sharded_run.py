"""The multi-device checks of tests/test_hybrid.py, run in a subprocess (XLA_FLAGS must be set before jax starts), on
8 virtual CPU devices:

* (data 2, model 2), the first 4 devices: a hybrid target saved as an HF folder loads straight into shards, placed as
  `shard` places it, and greedy speculative decoding on the mesh gives the one-device tokens;
* (data 2, model 4): a hybrid target with 4 key / 8 value heads, loaded from HF into shards: in_proj_qkv and conv1d
  split along "model" at whole key heads, each device's rows exactly HF's q, k and v rows of its own key heads and
  the value heads whose in_proj_z / a rows it holds; the logits equal one device's;
* the copy target (2 key heads) on (data 2, model 4): q / k / v stay replicated (the model axis does not divide the
  key heads) while its value heads split, and the logits still equal one device's.
(Speculative decoding itself runs once, on the first mesh: its compile on 8 virtual devices is this file's cost.)

`python tests/hybrid_sharded_run.py OUT.json`; the test reads OUT.json."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from dflash_jax.bench.mesh import xla_flags_with_devices  # creates no JAX backend: the flags below still apply

# The suite's XLA flags (tests/conftest.py) are kept; an inherited device count is replaced.
os.environ["XLA_FLAGS"] = xla_flags_with_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
import helpers as H  # noqa: E402
from dflash_jax.io.safetensors_io import read_safetensors  # noqa: E402
from dflash_jax.parallel import sharding as shd  # noqa: E402
from test_hybrid import HCFG, PROMPTS, hybrid_copy_target  # noqa: E402

target = hybrid_copy_target()
_, drafter = H.build_copy_pair(H.FLAW)
one = dj.generate(target, drafter, PROMPTS, max_new_tokens=24)
out = {}

# -- (data 2, model 2): sharded HF loading == shard(), tokens equal ------------------------------------------------
mesh = shd.make_mesh(data=2, model=2, devices=jax.devices()[:4])
with tempfile.TemporaryDirectory() as tmp:
    loaded = dj.load_target(dj.save_hf(Path(tmp) / "t", target), param_dtype="float32", compute_dtype="float32",
                            mesh=mesh)
placed = shd.shard(target, mesh)
pairs = list(zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)))
out["values"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
out["placement"] = all(a.sharding == b.sharding for a, b in pairs)
net = loaded.params.layers[0].linear_attn
out["value_heads_split"] = list(net.A_log.sharding.spec)
out["qkv_split_model2"] = list(net.in_proj_qkv.sharding.spec)
many = dj.generate(loaded, shd.shard(drafter, mesh), PROMPTS, max_new_tokens=24)
out["tokens_equal"] = bool(np.array_equal(one.tokens, many.tokens))
out["tau"] = float(many.tau)

# -- (data 2, model 4) with 4 key heads: q / k / v split at whole key heads ---------------------------------------
mesh4 = shd.make_mesh(data=2, model=4)
cfg4 = HCFG.replace(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=4)
from random_models import random_params  # noqa: E402
from dflash_jax.params import abstract_target  # noqa: E402

t4 = dataclasses.replace(target, config=cfg4, params=dataclasses.replace(
    random_params(abstract_target(cfg4), 9), embed_tokens=target.params.embed_tokens,
    lm_head=target.params.lm_head))
with tempfile.TemporaryDirectory() as tmp:
    folder = dj.save_hf(Path(tmp) / "t4", t4)
    hf = read_safetensors(folder / "model.safetensors")
    l4 = dj.load_target(folder, param_dtype="float32", compute_dtype="float32", mesh=mesh4)
net4 = l4.params.layers[0].linear_attn
out["qkv_split_model4"] = list(net4.in_proj_qkv.sharding.spec)
out["conv_split_model4"] = list(net4.conv1d.sharding.spec)
# device d (model index d) must hold HF's q, k rows of key head d and v / z rows of value heads 2d, 2d + 1
W, Z = hf["model.layers.0.linear_attn.in_proj_qkv.weight"], hf["model.layers.0.linear_attn.in_proj_z.weight"]
Kd, dk, dv = cfg4.linear_key_dim, cfg4.linear_key_head_dim, cfg4.linear_value_head_dim
whole = True
for sq, sz in zip(net4.in_proj_qkv.addressable_shards, net4.in_proj_z.addressable_shards):
    d = sq.index[0].start // (2 * dk + 2 * dv)
    want = np.concatenate([W[d * dk:(d + 1) * dk], W[Kd + d * dk:Kd + (d + 1) * dk],
                           W[2 * Kd + 2 * d * dv:2 * Kd + (2 * d + 2) * dv]])
    whole &= bool(np.array_equal(np.asarray(sq.data), want))
    whole &= bool(np.array_equal(np.asarray(sz.data), Z[2 * d * dv:(2 * d + 2) * dv]))
out["whole_heads_per_device"] = whole
ids = np.asarray([p + [0] * (13 - len(p)) for p in PROMPTS], np.int32)
ref_logits = np.asarray(dj.target_forward(t4, ids, (0, 1))[0])
got_logits = np.asarray(dj.target_forward(l4, ids, (0, 1))[0])
out["logits_max_diff_model4"] = float(np.abs(ref_logits - got_logits).max())
out["logits_argmax_equal_model4"] = bool(np.array_equal(ref_logits.argmax(-1), got_logits.argmax(-1)))

# -- the copy target (2 key heads) on model 4: q / k / v replicated, value heads split ----------------------------
c4 = shd.shard(target, mesh4)
out["qkv_split_2_key_heads_model4"] = list(c4.params.layers[0].linear_attn.in_proj_qkv.sharding.spec)
out["logits_max_diff_replicated_qkv"] = float(np.abs(np.asarray(dj.target_forward(target, ids, (0, 1))[0])
                                                     - np.asarray(dj.target_forward(c4, ids, (0, 1))[0])).max())
Path(sys.argv[1]).write_text(json.dumps(out))
