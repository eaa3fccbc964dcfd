"""Keeps `python -m dflash_jax.bench.matmul` from rotting: a tiny run, and the HLO inspector on hand-written HLO."""

from dflash_jax.bench import matmul as microbench

FUSED_HLO = """
%fused_dot (param_0: f32[4,32], param_1: bf16[32,32]) -> f32[4,32] {
  %param_0 = f32[4,32]{1,0} parameter(0)
  %param_1 = bf16[32,32]{1,0} parameter(1)
  %convert.1 = f32[32,32]{1,0} convert(%param_1)
  %multiply.2 = f32[32,32]{1,0} multiply(%convert.1, %convert.1)
  %bitcast.3 = f32[32,32]{1,0} bitcast(%multiply.2)
  ROOT %dot.0 = f32[4,32]{1,0} dot(%param_0, %bitcast.3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (x: f32[4,32], w: bf16[32,32]) -> f32[4,32] {
  %x = f32[4,32]{1,0} parameter(0)
  %w = bf16[32,32]{1,0} parameter(1)
  ROOT %f = f32[4,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
}
"""

MATERIALISED_HLO = """
%deq (param_0: bf16[32,32]) -> f32[32,32] {
  %param_0 = bf16[32,32]{1,0} parameter(0)
  ROOT %convert.1 = f32[32,32]{1,0} convert(%param_0)
}

ENTRY %main (x: f32[4,32], w: bf16[32,32]) -> f32[4,32] {
  %x = f32[4,32]{1,0} parameter(0)
  %w = bf16[32,32]{1,0} parameter(1)
  %wide = f32[32,32]{1,0} fusion(%w), kind=kLoop, calls=%deq
  ROOT %dot = f32[4,32]{1,0} dot(%x, %wide), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_inspector_on_handwritten_hlo():
    fused = microbench.inspect_hlo(FUSED_HLO, (32, 32))
    assert fused.weight_source == "fused" and "kOutput" in fused.dot_in and fused.materialised == []
    mat = microbench.inspect_hlo(MATERIALISED_HLO, (32, 32))
    assert mat.weight_source == "materialised" and mat.dot_in == "top level"
    assert "wide" in mat.detail and "kLoop" in mat.detail and len(mat.materialised) == 1


def test_microbench_small_run(capsys):
    out = microbench.main(["--size", "256", "--tokens", "4", "--reps", "2", "--warmup", "1"])
    text = capsys.readouterr().out
    for name in ("nvfp4 W . f32 x", "bf16 W . f32 x", "f32 W . f32 x", "bf16 W . bf16 x"):
        assert text.count(name) >= 2, name  # table row + HLO line
    assert "NVFP4 finding:" in text
    assert len(out["timings"]) == 4 and all(t.median_ms > 0 for t in out["timings"])
    hlo = out["hlo"]
    assert hlo[(microbench.BASELINE, 4)].weight_source == "argument"
    assert hlo[("nvfp4 W . f32 x", 4)].weight_source in ("fused", "materialised")


def test_profile_puts_decode_against_its_weight_bytes_at_the_measured_stream_rate():
    """`bench.profile`'s bandwidth line: a decode's wall time against (the target's weight bytes) / (GB/s of a large
    float32 sum measured in the same run); the bytes are every parameter leaf's, GGML blocks counted as stored."""
    import jax
    import numpy as np
    from dflash_jax.bench import profile
    from dflash_jax.io.shipped import load_default

    target, _, _ = load_default(model="code-5m")
    want = sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(target.params)) / 1e6
    assert abs(profile.weight_megabytes(target) - want) < 1e-9
    line = profile.bandwidth_line(13.0, 96.6, 20.0)  # 96.6 MB at 20 GB/s = 4.83 ms
    assert "4.83 ms: 2.69x" in line and "goal <= 1.3x" in line
    line = profile.bandwidth_line(13.0, 96.6, 20.0, call_ms=14.49)  # a call of its own: its launch included
    assert "4.83 ms: 2.69x" in line and "(14.49 ms as a call of its own: 3.00x)" in line
    assert profile.stream_gbps(megabytes=8.0, reps=3) > 0.1


def test_loop_profile_splits_a_step_into_the_target_pass_the_draft_and_the_bookkeeping():
    """`python -m dflash_jax.bench.loop_profile` on tiny random models: the speculative loop's instructions fall into
    the target's groups, "draft: ..." groups and the loop's bookkeeping (the chain's acceptance, the draft's
    argmax), the autoregressive loop's into no draft group; ms per step are positive and the printout relates the
    two. Its stacks come from the compiled HLO's own frames (`profile.parse_hlo`)."""
    import jax

    import dflash_jax as dj
    from dflash_jax.bench import loop_profile
    from helpers import tiny_qwen3

    cfg = tiny_qwen3(num_hidden_layers=2, max_position_embeddings=256)
    target = dj.init_target(cfg, jax.random.key(0))
    dcfg = dj.DrafterConfig(model=cfg.drafter_stack(1), block_size=4, mask_token_id=0, target_layer_ids=(0, 1),
                            num_target_layers=2)
    drafter = dj.init_drafter(dcfg, jax.random.key(1))
    prof = loop_profile.profile_loop(target, drafter, [[3, 4, 5, 6]], max_new_tokens=12, reps=1, draft_length=2)
    spec, ar = prof["speculative"]["groups"], prof["autoregressive"]["groups"]
    assert any(g.startswith("draft: ") for g in spec) and not any(g.startswith("draft: ") for g in ar)
    assert any(not g.startswith(("draft: ", "loop: ")) and g not in dict(loop_profile.LOOP_GROUPS) for g in spec)
    assert "walk, acceptance and sampling" in spec
    assert all(r["ms"] >= 0 for r in spec.values()) and sum(r["ms"] for r in spec.values()) > 0
    assert prof["speculative"]["layout"] == "chain of 2" and prof["autoregressive"]["layout"] == "plain"
    text = loop_profile.format_loop(prof)
    assert "a speculative step = " in text and "autoregressive steps (draft " in text
