"""The multi-device check of tests/test_hybrid.py, run in a subprocess (XLA_FLAGS must be set before jax starts):
a hybrid target saved as an HF folder loads straight into shards on a (data 2, model 2) mesh of virtual CPU devices,
placed as `shard` places it, and greedy speculative decoding on the mesh gives the one-device tokens.
`python tests/hybrid_sharded_run.py OUT.json`; the test reads OUT.json."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
import helpers as H  # noqa: E402
from dflash_jax.parallel import sharding as shd  # noqa: E402
from test_hybrid import PROMPTS, hybrid_copy_target  # noqa: E402

target = hybrid_copy_target()
_, drafter = H.build_copy_pair(H.FLAW)
mesh = shd.make_mesh(data=2, model=2)
with tempfile.TemporaryDirectory() as tmp:
    loaded = dj.load_target(dj.save_hf(Path(tmp) / "t", target), param_dtype="float32", compute_dtype="float32",
                            mesh=mesh)
placed = shd.shard(target, mesh)
pairs = list(zip(jax.tree.leaves(loaded.params), jax.tree.leaves(placed.params)))
out = {"values": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
       "placement": all(a.sharding == b.sharding for a, b in pairs),
       "value_heads_split": list(loaded.params.layers[0].linear_attn.A_log.sharding.spec)}
one = dj.generate(target, drafter, PROMPTS, max_new_tokens=24)
many = dj.generate(loaded, shd.shard(drafter, mesh), PROMPTS, max_new_tokens=24)
out["tokens_equal"] = bool(np.array_equal(one.tokens, many.tokens))
out["tau"] = float(many.tau)
Path(sys.argv[1]).write_text(json.dumps(out))
