"""Train the shipped target: a small Qwen3 on the Python standard library's sources (next-token CE).

    dflash-jax train-target            # reproduces checkpoints/target (resumable: rerun the same command)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.checkpoint import save
from dflash_jax.config import Qwen3Config
from dflash_jax.target import Target, forward_with_cache, init_target
from dflash_jax.tokenizer import Tokenizer
from dflash_jax.train import corpus
from dflash_jax.train.loop import OptimConfig, batch_rng, cross_entropy, run

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def shipped_target_config(vocab_size: int, eos_id: int) -> Qwen3Config:
    """About 5.8M parameters: sized so that an hour of 2-core CPU training sees several million tokens."""
    return Qwen3Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True,
                       eos_token_id=eos_id, param_dtype="float32", compute_dtype="float32")


def lm_loss(cfg: Qwen3Config):
    def loss_fn(params, batch):
        tokens = batch  # [B, S+1]
        logits, _, _ = forward_with_cache(Target(params=params, config=cfg), tokens[:, :-1], None)
        ce = cross_entropy(logits, tokens[:, 1:])
        return ce.mean(), {}
    return loss_fn


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def heldout_loss_fn(cfg: Qwen3Config, eval_stream: np.ndarray, seq_len: int, n_windows: int = 64):
    windows = random_windows(eval_stream, n_windows, seq_len + 1, np.random.default_rng(1234))
    loss = jax.jit(lm_loss(cfg))

    def eval_fn(params) -> dict:
        losses = [float(loss(params, jnp.asarray(windows[i:i + 16]))[0]) for i in range(0, n_windows, 16)]
        return {"heldout_loss": float(np.mean(losses))}
    return eval_fn


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the shipped target on the stdlib corpus")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=str(CHECKPOINTS / "tokenizer.json"))
    ap.add_argument("--out", default=str(CHECKPOINTS / "target"))
    ap.add_argument("--work-dir", default=".train/target", help="orbax training checkpoints (for resume)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    tok = Tokenizer.from_file(args.tokenizer)
    train_files, eval_files = corpus.split_files(corpus.stdlib_files())
    train_stream = corpus.token_stream(tok, corpus.read_texts(train_files), tok.eos_id)
    eval_stream = corpus.token_stream(tok, corpus.read_texts(eval_files), tok.eos_id)
    print(f"corpus: {len(train_files)} train files ({len(train_stream):,} tokens), "
          f"{len(eval_files)} held-out files ({len(eval_stream):,} tokens)")
    cfg = shipped_target_config(tok.vocab_size, tok.eos_id)
    params = init_target(cfg, jax.random.key(args.seed)).params

    def batch_fn(step):
        return jnp.asarray(random_windows(train_stream, args.batch, args.seq_len + 1, batch_rng(args.seed, step)))

    optim = OptimConfig(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    params, history = run(params=params, loss_fn=lm_loss(cfg), batch_fn=batch_fn, optim=optim,
                          ckpt_dir=Path(args.work_dir) / "ckpt", eval_fn=heldout_loss_fn(cfg, eval_stream, args.seq_len),
                          eval_every=250, desc="target", log_file=Path(args.work_dir) / "log.jsonl")
    target = Target(params=params, config=cfg)
    save(args.out, target)
    final = history[-1]
    report = {"command": "dflash-jax train-target " + " ".join(argv or []), "steps": args.steps,
              "batch": args.batch, "seq_len": args.seq_len, "tokens_seen": args.steps * args.batch * args.seq_len,
              "train_loss": final["loss"], "heldout_loss": final.get("heldout_loss"),
              "wall_time_s": round(time.perf_counter() - t_start, 1), "params": int(sum(
                  int(np.prod(x.shape)) for x in jax.tree.leaves(params)))}
    with open(Path(args.out) / "train_report.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
