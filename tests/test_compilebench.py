"""Keeps `python -m dflash_jax.bench.compile` from rotting: its sections on tiny models and budgets (figures are
printed by the script, never asserted)."""

from random_models import make_drafter, make_target
from dflash_jax.bench import compile as compilebench
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.attention import attention_chunk

CFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
DCFG = DrafterConfig(model=CFG.replace(num_hidden_layers=1), block_size=4, mask_token_id=63, target_layer_ids=(0, 1),
                     num_target_layers=2)


def test_sections_run_tiny(capsys):
    with attention_chunk(16):
        _sections(capsys)


def _sections(capsys):
    target, drafter = make_target(CFG, 0), make_drafter(DCFG, 1)
    att = compilebench.attention_section(target, drafter, live=8, cache_lens=(32, 96), reps=2)
    assert set(att["ratios"]) == {"verify_ms", "decode_ms", "draft_ms"}
    progs = compilebench.programs_section(target, drafter, n_prompts=3, max_len=20, new_tokens=2)
    assert progs["length_programs"] <= 1 and progs["length_prefill_programs"] <= progs["prompt_buckets"] == 2
    assert progs["grid_programs"] <= 2 and progs["batch_programs"] <= progs["batch_buckets"] == 4
    scan = compilebench.scan_section(layers=2, hidden=32, steps=2, reps=1)
    assert set(scan) == {"unrolled", "scan"}
    out = capsys.readouterr().out
    assert "ratio 96 vs 32 slots" in out and "loop program(s)" in out and "scan / unrolled" in out
