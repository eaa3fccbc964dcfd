"""One compile path keyed on everything that changes the program (dflash_jax.decode.programs), and compile-once.

- sampling numbers, EOS sets and budgets are traced: a grid of them costs at most 2 programs (greedy + sampled);
- prompt lengths and budgets map to power-of-two buckets (host-side keys: no compile needed to count them);
- a change of NVFP4 backend between calls builds a new program, and going back reuses the old one;
- the same inputs on another device sharding run (a new program) and give the same tokens (subprocess, 4 CPU devices);
- the persistent compilation cache: the CLI fills it, a second process finds every program there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
import dflash_jax.quant.linear as linear_mod
from random_models import make_drafter, make_target
from dflash_jax.bench.mesh import xla_flags_with_devices
from dflash_jax.config import DrafterConfig, TargetConfig

G = importlib.import_module("dflash_jax.decode.programs")
from dflash_jax.decode import buckets
ROOT = Path(__file__).resolve().parents[1]

# A config no other test module uses, so every count below starts from programs this module builds.
CFG = TargetConfig(vocab_size=72, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
DCFG = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=71, target_layer_ids=(0, 1),
                     num_target_layers=2)


@pytest.fixture(scope="module")
def pair():
    return make_target(CFG, 0), make_drafter(DCFG, 1)


def _prompts(seed, lens=(5, 11)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 71, n).tolist() for n in lens]


def test_sampling_settings_eos_sets_and_budgets_share_programs(pair):
    """4 temperatures x 3 EOS sets x 3 budgets (plus top-k / top-p / p_min varied), one prompt shape: one trace per
    sampling *kind* (greedy, and each on/off combination of top-k (with its power-of-two cap) / top-p / p_min, which
    are static so that no step holds a conditional): 4 here, whatever the temperatures, EOS sets, budgets and the
    values of top-k / top-p / p_min; every result honours its own settings."""
    target, drafter = pair
    prompts = _prompts(0)
    before = G.TRACE_COUNTS["speculative"]
    greedy_ref = dj.generate_autoregressive(target, prompts, max_new_tokens=20).tokens
    results = {}
    for i, temperature in enumerate((0.0, 0.5, 0.8, 1.0)):
        for eos in ((), (int(greedy_ref[0, 4]),), (3, 9, int(greedy_ref[1, 2]))):
            for n in (9, 14, 20):
                res = dj.generate(target, drafter, prompts, max_new_tokens=n, temperature=temperature, eos_ids=eos,
                                  top_k=(0, 5, 0, 8)[i], top_p=(1.0, 1.0, 0.9, 0.95)[i], p_min=(0.0, 0.3)[i % 2],
                                  seed=i)
                results[temperature, eos, n] = res
                assert res.tokens.shape == (2, n)
                for b, row in enumerate(res.token_lists()):
                    assert len(row) <= n and (len(row) == n or row[-1] in eos)
                    assert not set(row[:-1]) & set(eos)  # stops at the first EOS
                    assert (res.tokens[b, len(row):] == -1).all()
    traces = G.TRACE_COUNTS["speculative"] - before
    first, *rest = results.values()
    # compile time is reported apart (from jax.monitoring's trace / lower / compile events), and only when compiled
    assert first.timings["compile_s"] > 0 and sum(r.timings["compile_s"] > 0 for r in rest) == traces - 1
    print(f"\n[compile] 36 generate calls (4 temperatures x 3 EOS sets x 3 budgets): {traces} programs")
    assert traces <= 4
    for (temperature, eos, n), res in results.items():  # greedy: exactly the autoregressive prefix, cut at EOS
        if temperature == 0.0:
            for b, row in enumerate(res.token_lists()):
                want = greedy_ref[b, :n].tolist()
                cut = next((j + 1 for j, t in enumerate(want) if t in eos), n)
                assert row == want[:cut]
    assert not np.array_equal(results[0.5, (), 20].tokens, results[1.0, (), 20].tokens)


def test_prompt_length_and_budget_buckets():
    """100 prompts with lengths spread over 1..1000 map to few program keys (prepared on the host, the keys
    `generate` compiles under): prefill is keyed on the prompt bucket and the cache bucket, the loop on the cache
    bucket alone (1: buckets start at 2048 slots on every platform), and a key never changes within a bucket."""
    big = CFG.replace(max_position_embeddings=4096)
    target, drafter = make_target(big, 0), make_drafter(DCFG.replace(model=DCFG.model.replace(
        max_position_embeddings=4096)), 1)
    prefill_keys, loop_keys = set(), set()
    for n in np.linspace(1, 1000, 100).astype(int):
        call = G.speculative_call(target, drafter, [[1] * int(n)], max_new_tokens=64)
        prefill_keys.add((call.args[2].shape, tuple(sorted(call.prefill_static.items())), call.prefill_context))
        loop_keys.add((call.prefill_static["cache_len"], tuple(sorted(call.loop_static.items())), call.context))
    print(f"\n[compile] program keys for 100 prompt lengths in 1..1000: {len(prefill_keys)} prefill, "
          f"{len(loop_keys)} loop")
    assert len(prefill_keys) <= 10 and len(loop_keys) == 1
    assert [buckets.bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
    for lo, hi in ((1, 256), (257, 512), (513, 1024)):  # one program per budget bucket
        budgets = {tuple(sorted(G.speculative_call(target, drafter, [[1, 2]], max_new_tokens=n).static.items()))
                   for n in range(lo, hi + 1, 7)}
        assert len(budgets) == 1, (lo, hi)


def _emulated_scaled_matmul(calls):
    def fn(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        calls.append(1)  # counted while tracing: the native path is in the program
        a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), 16, axis=-1)
        b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), 16, axis=-1)
        return jnp.einsum("bmk,bnk->bmn", a, b).astype(preferred_element_type)
    return fn


def test_backend_change_between_calls_takes_effect(pair, monkeypatch):
    """set_default_backend (or nvfp4_backend=) after a first call builds the other program; going back reuses the
    first one. Native is emulated on CPU (jax.nn.scaled_matmul has no CPU lowering)."""
    target, drafter = pair
    q = dj.quantize_nvfp4(drafter)
    calls = []
    monkeypatch.setattr(linear_mod, "_scaled_matmul", _emulated_scaled_matmul(calls))
    monkeypatch.setattr(linear_mod, "native_supported", lambda: True)
    monkeypatch.delenv(linear_mod.ENV_VAR, raising=False)
    prompts = _prompts(1)
    t0 = G.TRACE_COUNTS["speculative"]
    portable = dj.generate(target, q, prompts, max_new_tokens=12)
    assert G.TRACE_COUNTS["speculative"] == t0 + 1 and not calls
    try:
        linear_mod.set_default_backend("native")
        native = dj.generate(target, q, prompts, max_new_tokens=12)
        assert G.TRACE_COUNTS["speculative"] == t0 + 2 and calls, "the native backend did not reach the program"
        n_calls = len(calls)
        linear_mod.set_default_backend(None)
        again = dj.generate(target, q, prompts, max_new_tokens=12)
        assert G.TRACE_COUNTS["speculative"] == t0 + 2 and len(calls) == n_calls  # the portable program, reused
        explicit = dj.generate(target, q, prompts, max_new_tokens=12, nvfp4_backend="native")
        assert G.TRACE_COUNTS["speculative"] == t0 + 2  # explicit = same key as the default set to native
    finally:
        linear_mod.set_default_backend(None)
    # Greedy output is exact whatever the drafter's numerics (its drafts only change what is accepted).
    for res in (native, again, explicit):
        np.testing.assert_array_equal(res.tokens, portable.tokens)
    np.testing.assert_array_equal(again.acceptance_lengths, portable.acceptance_lengths)
    # The public one-shot calls are keyed on the backend too.
    feats = np.random.default_rng(0).standard_normal((1, 5, 2 * CFG.hidden_size)).astype(np.float32)
    block = np.array([[3, 71, 71, 71]], np.int32)
    a = dj.draft_logits(target, q, feats, block)
    n_calls = len(calls)
    b = dj.draft_logits(target, q, feats, block, nvfp4_backend="native")
    assert len(calls) > n_calls and not np.allclose(np.asarray(a), np.asarray(b))


SHARDING_SCRIPT = textwrap.dedent('''
    import dataclasses, json, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, {tests!r})
    import dflash_jax as dj
    from dflash_jax.decode import programs as G
    from dflash_jax.config import DrafterConfig, TargetConfig
    from random_models import make_drafter, make_target
    assert len(jax.devices()) == 4, jax.devices()
    cfg = TargetConfig(vocab_size=72, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
    dcfg = DrafterConfig(model=cfg.replace(num_hidden_layers=1), block_size=4, mask_token_id=71,
                         target_layer_ids=(0, 1), num_target_layers=2)
    target, drafter = make_target(cfg, 0), make_drafter(dcfg, 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 71, n).tolist() for n in (5, 11, 7, 3)]
    out = {{}}
    one = dj.generate(target, drafter, prompts, max_new_tokens=12)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rep = NamedSharding(mesh, P())
    t2, d2 = jax.device_put(target, rep), jax.device_put(drafter, rep)
    replicated = dj.generate(t2, d2, prompts, max_new_tokens=12)
    emb = jax.device_put(target.params.embed_tokens, NamedSharding(mesh, P("x", None)))  # vocab over 4 devices
    t3 = t2.replace(params=dataclasses.replace(t2.params, embed_tokens=emb))
    sharded = dj.generate(t3, d2, prompts, max_new_tokens=12)
    again = dj.generate(target, drafter, prompts, max_new_tokens=12)
    out["traces"] = G.TRACE_COUNTS["speculative"]
    out["same"] = [bool(np.array_equal(r.tokens, one.tokens)) for r in (replicated, sharded, again)]
    out["compile_s"] = [r.timings["compile_s"] for r in (one, replicated, sharded, again)]
    print(json.dumps(out))
''')


def test_sharding_change_between_calls_takes_effect(tmp_path):
    """The same inputs on 1 device, replicated over 4, and with the embedding sharded over 4: three compiled
    programs, the same tokens; back to 1 device reuses the first program. (The old private AOT cache failed here
    with "compiled for input shardings that disagree".)"""
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    script = SHARDING_SCRIPT.format(tests=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"] == [True, True, True]
    # Three compiled programs (tracing is shared: it depends on shapes, not placements), the fourth call reuses one.
    assert all(c > 0 for c in out["compile_s"][:3]) and out["compile_s"][3] == 0.0, out
    assert out["traces"] <= 3, out


def test_persistent_compilation_cache_across_processes(tmp_path):
    """The CLI switches the persistent cache on (XDG_CACHE_HOME honoured): a first `dflash-jax generate` fills it,
    a second process finds every program there (it writes nothing new); DFLASH_JAX_NO_COMPILE_CACHE=1 turns it off."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(ROOT))
    env.pop("DFLASH_JAX_NO_COMPILE_CACHE", None)
    cmd = [sys.executable, "-m", "dflash_jax.cli", "generate", "def f(x):", "--max-new-tokens", "6"]
    folder = tmp_path / "xdg" / "dflash-jax" / "xla"

    def run(env):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    first = run(env)
    ours = [n for n in first if n.startswith("jit_dflash_")]
    loops = [n for n in ours if n.startswith(("jit_dflash_speculative", "jit_dflash_autoregressive"))]
    assert len(loops) >= 2, first  # at least the speculative and the autoregressive loop programs
    assert any(n.startswith("jit_dflash_prefill") for n in ours), first  # and prefill (callback-free: "rerun")
    second = run(env)
    # Every entry is still there and no generation program was compiled again. (A small helper program whose
    # compile time straddles the 0.2 s write threshold on a loaded machine may be written by the second run only.)
    assert set(first) <= set(second) and [n for n in second if n.startswith("jit_dflash_")] == ours, (first, second)
    off = dict(env, XDG_CACHE_HOME=str(tmp_path / "off"), DFLASH_JAX_NO_COMPILE_CACHE="1")
    run(off)
    assert not (tmp_path / "off").exists()
