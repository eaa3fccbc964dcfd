"""A tiny target (saved as a folder) and a datagen work dir of synthetic shards for it, for the trainer's tests
(tests/test_train_shards.py, and the mesh runs of tests/train_sharded_run.py, in their own processes).

Synthetic answers (random tokens, random features) are enough here: these tests are about which rows a step reads,
resume, placement and refusals, not about what the drafter learns (tests/test_train.py has that)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

import dflash_jax as dj
from dflash_jax.train import shards
from dflash_jax.train.datagen import vocabulary_fingerprint
from dflash_jax.train.drafter_data import target_fingerprint
from dflash_jax.train.loop import load_training_tokenizer
from dflash_jax.train.refill import Answer
from dflash_jax.train.shards import DataSpec

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "tokenizer.json"  # vocabulary 4096, <|endoftext|> 0, <|mask|> 1
CFG = dj.TargetConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
TAPS = (0, 2)
MAX_PROMPT, MAX_NEW = 8, 24


def make_target(folder: Path, seed: int = 0):
    target = dj.init_target(CFG, jax.random.key(seed))
    dj.save(folder, target)
    return dj.load_target(folder, compute_dtype="float32")


def spec_of(target, **changes) -> DataSpec:
    tok = load_training_tokenizer(TOKENIZER)
    spec = DataSpec(target_fingerprint=target_fingerprint(target), layer_ids=TAPS, hidden_size=CFG.hidden_size,
                    vocab_size=CFG.vocab_size, vocabulary=vocabulary_fingerprint(tok), block_size=4,
                    max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW, eos_ids=(0,), sampled_fraction=0.0,
                    temperature=0.0, seed=0)
    return dataclasses.replace(spec, **changes)


def add_shard(work: Path, number: int, spec: DataSpec, n: int = 12, seed: int | None = None) -> dict:
    """A shard of n synthetic answers (queue indices number*n ..) into a datagen work dir (made on first use)."""
    work = Path(work)
    if not (work / shards.MANIFEST).exists():
        work.mkdir(parents=True, exist_ok=True)
        shards.write_manifest(work, {"spec": spec.as_json(), "sources": [], "runs": [], "totals": {}})
    rng = np.random.default_rng(number if seed is None else seed)
    answers = []
    for i in range(n):
        p, a = int(rng.integers(2, MAX_PROMPT + 1)), int(rng.integers(6, MAX_NEW + 1))
        tokens = rng.integers(2, CFG.vocab_size, p + a).astype(np.int32)
        feats = rng.standard_normal((p + a, spec.feature_width)).astype(np.float16)
        answers.append(Answer(index=number * n + i, tokens=tokens, prompt_len=p, features=feats))
    return shards.write_shard(work, number, answers, spec)


def train_args(target_dir: Path, data_dir: Path, work: Path, out: Path, *, steps: int = 10, batch: int = 4,
               extra=()) -> list[str]:
    return ["--target", str(target_dir), "--tokenizer", str(TOKENIZER), "--data-dir", str(data_dir),
            "--block-size", "4", "--layers", "1", "--tap-ids", *map(str, TAPS), "--steps", str(steps),
            "--batch", str(batch), "--anchors", "3", "--eval-prompts", "0", "--ckpt-every", "5", "--lr", "3e-3",
            "--work-dir", str(work), "--out", str(out), *extra]


def checkpoint(work: Path, step: int) -> dict:
    """The orbax checkpoint of a run at `step`: {"params", "opt", "clock"} as host arrays."""
    import orbax.checkpoint as ocp

    path = Path(work).absolute() / "ckpt" / str(step) / "default"
    return jax.tree.map(np.asarray, ocp.StandardCheckpointer().restore(path))
