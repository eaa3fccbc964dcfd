"""Train the shipped target: a small Qwen3 on Python sources (next-token CE); or fine-tune a trained one.

    dflash-jax train-target            # reproduces checkpoints/target (resumable: rerun the same command)

`--init-from X --unlikelihood W` starts from the target in X and adds W x the sequence-level unlikelihood loss on the
model's own greedy continuations (dflash_jax/train/unlikelihood.py; checkpoints/target_v3 was made so).

Data: the stdlib plus the pinned pure-Python packages of the `[corpus]` extra (`corpus.build_corpus`), held-out files
by path hash never trained on. Each batch row comes from the stdlib with probability `--stdlib-weight` (else from the
packages), at a uniformly random offset of that source's token stream. Curriculum: the first steps see
`--seq-len`-token windows, the last `--long-fraction` of steps `--long-seq-len`-token windows with the same number of
tokens per batch, so the model learns long context late, when it is cheap to learn.
Batches are a pure function of the step number, so an interrupted run resumes exactly where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io.orbax_folder import save
from dflash_jax.config import TargetConfig
from dflash_jax.models.target import Target, forward_with_cache, init_target
from dflash_jax.train import corpus, unlikelihood
from dflash_jax.train.loop import OptimConfig, batch_rng, cross_entropy, lm_loss, load_training_tokenizer, run  # noqa: F401
from dflash_jax.io.checkpoint import load_target

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def shipped_target_config(vocab_size: int, eos_id: int, *, layers: int = 6, hidden: int = 256,
                          intermediate: int = 768, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                          rope_theta: float = 100_000.0, max_positions: int = 4096) -> TargetConfig:
    """The shipped target's shape (defaults), chosen by a measured pilot (checkpoints/README.md)."""
    return TargetConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=rope_theta,
                       max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=eos_id,
                       param_dtype="float32", compute_dtype="float32")


def random_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    if len(stream) <= length:
        raise ValueError(f"token stream of {len(stream)} tokens is too short for {length}-token windows")
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def mixed_windows(streams: list[np.ndarray], weights: list[float], batch: int, length: int,
                  rng: np.random.Generator) -> np.ndarray:
    """[batch, length] windows; each row's source drawn with the given weights, then a random offset in it."""
    src = rng.choice(len(streams), size=batch, p=np.asarray(weights) / np.sum(weights))
    rows = [random_windows(streams[s], 1, length, rng)[0] for s in src]
    return np.stack(rows)


def heldout_loss_fn(cfg: TargetConfig, eval_stream: np.ndarray, seq_len: int, n_windows: int = 64,
                    name: str = "heldout_loss", chunk: int = 16):
    # Fixed windows (seed 1234), so every evaluation of every run sees the same text.
    windows = random_windows(eval_stream, n_windows, seq_len + 1, np.random.default_rng(1234))
    loss = jax.jit(lm_loss(cfg))

    def eval_fn(params) -> dict:
        losses = [float(loss(params, jnp.asarray(windows[i:i + chunk]))[0]) for i in range(0, n_windows, chunk)]
        return {name: float(np.mean(losses))}
    return eval_fn


def tokenized_corpus(tok, work_dir: Path, *, packages: bool) -> dict[str, np.ndarray | dict]:
    """Token streams of the corpus (train: stdlib / packages; held-out: stdlib / packages), cached in work_dir."""
    train, held, man = corpus.build_corpus(packages=packages)
    key = hashlib.sha256((man["file_list_sha256"] + tok.hf.to_str()).encode()).hexdigest()[:16]
    cache = work_dir / f"corpus_tokens_{key}.npz"
    if cache.exists():
        with np.load(cache) as z:
            streams = {k: z[k] for k in z.files}
    else:
        def stream(files):
            texts = [f.text for f in files]
            return corpus.token_stream(tok, texts, tok.eos_id) if texts else np.zeros((0,), np.int32)
        streams = {
            "train_stdlib": stream([f for f in train if f.origin == "stdlib"]),
            "train_packages": stream([f for f in train if f.origin != "stdlib"]),
            # The stdlib held-out stream exactly as the first shipped target measured it (same files, same order).
            "eval_stdlib": corpus.token_stream(tok, corpus.read_texts(corpus.split_files(corpus.stdlib_files())[1]),
                                               tok.eos_id),
            "eval_packages": stream([f for f in held if f.origin != "stdlib"]),
        }
        work_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cache, **streams)
    man["train_tokens"] = {"stdlib": int(len(streams["train_stdlib"])),
                           "packages": int(len(streams["train_packages"]))}
    man["eval_tokens"] = {"stdlib": int(len(streams["eval_stdlib"])), "packages": int(len(streams["eval_packages"]))}
    return {**streams, "manifest": man}


def load_init_target(path, tok) -> Target:
    """The target a fine-tune starts from, in float32, or an error that says what is wrong with it."""
    if not Path(path).exists():
        raise SystemExit(f"error: --init-from {path}: no such folder (give a target saved by train-target)")
    start = load_target(path, param_dtype="float32", compute_dtype="float32")
    if start.config.vocab_size != tok.vocab_size or start.config.eos_token_id != tok.eos_id:
        raise SystemExit(f"error: --init-from {path} was trained with another tokenizer (vocab "
                         f"{start.config.vocab_size}, EOS {start.config.eos_token_id}; this tokenizer: vocab "
                         f"{tok.vocab_size}, EOS {tok.eos_id})")
    return start


def main(argv=None):
    ap = argparse.ArgumentParser(prog="dflash-jax train-target",
                                 description="Train the shipped target on the stdlib + corpus packages")
    ap.add_argument("--steps", type=int, default=2400, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=24, help="rows per batch in the short-window phase")
    ap.add_argument("--seq-len", type=int, default=256, help="window length of the short phase (tokens)")
    ap.add_argument("--long-seq-len", type=int, default=1280, help="window length of the long phase (tokens)")
    ap.add_argument("--long-fraction", type=float, default=0.25,
                    help="fraction of the steps (the last ones) trained on long windows; 0 = none")
    ap.add_argument("--stdlib-weight", type=float, default=0.3,
                    help="probability that a batch row comes from the stdlib rather than the packages")
    ap.add_argument("--no-packages", action="store_true", help="train on the stdlib alone (no [corpus] extra)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warmup + cosine)")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--intermediate", type=int, default=768, help="MLP intermediate size")
    ap.add_argument("--heads", type=int, default=4, help="query heads (head_dim 64)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    ap.add_argument("--rope-theta", type=float, default=100_000.0, help="RoPE base")
    ap.add_argument("--eval-every", type=int, default=300, help="held-out evaluation interval (steps)")
    ap.add_argument("--ckpt-every", type=int, default=100, help="orbax checkpoint interval (steps), for resume")
    ap.add_argument("--seed", type=int, default=0, help="init and data seed")
    ap.add_argument("--tokenizer", default=str(CHECKPOINTS / "tokenizer.json"), help="tokenizer.json to train with")
    ap.add_argument("--out", default=str(CHECKPOINTS / "target"), help="where the trained target is saved")
    ap.add_argument("--work-dir", default=".train/target", help="orbax training checkpoints (for resume) and logs")
    ft = ap.add_argument_group("fine-tuning a trained target (unlikelihood: see dflash_jax/train/unlikelihood.py)")
    ft.add_argument("--init-from", default=None,
                    help="start from this saved target (its shape; the shape options above are ignored)")
    ft.add_argument("--unlikelihood", type=float, default=0.0,
                    help="weight of the sequence-level unlikelihood loss on the model's own greedy continuations "
                         "(0 = next-token loss only)")
    ft.add_argument("--ul-batch", type=int, default=16, help="greedy continuations per step")
    ft.add_argument("--ul-prefix", type=int, default=64, help="real-text prefix of each continuation (tokens)")
    ft.add_argument("--ul-new-tokens", type=int, default=128, help="tokens generated per continuation")
    ft.add_argument("--ul-ngram", type=int, default=4, help="a token inside a repeated n-gram of this length is penalised")
    args = ap.parse_args(argv)
    if args.unlikelihood < 0:
        raise SystemExit(f"error: --unlikelihood must be >= 0, got {args.unlikelihood}")
    if args.unlikelihood > 0 and min(args.ul_batch, args.ul_prefix, args.ul_new_tokens, args.ul_ngram) < 1:
        raise SystemExit("error: --ul-batch, --ul-prefix, --ul-new-tokens and --ul-ngram must be >= 1")
    if not 0.0 <= args.long_fraction <= 1.0:
        raise SystemExit(f"error: --long-fraction must be in [0, 1], got {args.long_fraction}")

    t_start = time.perf_counter()
    tok = load_training_tokenizer(args.tokenizer)
    start = load_init_target(args.init_from, tok) if args.init_from else None  # a bad start fails before the corpus
    work = Path(args.work_dir)
    try:
        data = tokenized_corpus(tok, work, packages=not args.no_packages)
    except corpus.CorpusError as e:
        raise SystemExit(f"error: {e}") from None
    man = data["manifest"]
    print(f"corpus: {man['n_train_files']} train files ({man['train_tokens']['stdlib']:,} stdlib + "
          f"{man['train_tokens']['packages']:,} package tokens), {man['n_eval_files']} held-out files, "
          f"{man['duplicates_dropped']} duplicates dropped", flush=True)
    streams, weights = [data["train_stdlib"]], [args.stdlib_weight]
    if len(data["train_packages"]):
        streams.append(data["train_packages"])
        weights.append(1.0 - args.stdlib_weight)
    if start is not None:
        cfg, params = start.config, start.params
    else:
        cfg = shipped_target_config(tok.vocab_size, tok.eos_id, layers=args.layers, hidden=args.hidden,
                                    intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
                                    rope_theta=args.rope_theta)
        params = init_target(cfg, jax.random.key(args.seed)).params
    long_start = args.steps - int(round(args.steps * args.long_fraction))
    long_batch = max(1, args.batch * args.seq_len // args.long_seq_len)

    def batch_fn(step):
        rng = batch_rng(args.seed, step)
        if step >= long_start:
            return jnp.asarray(mixed_windows(streams, weights, long_batch, args.long_seq_len + 1, rng))
        return jnp.asarray(mixed_windows(streams, weights, args.batch, args.seq_len + 1, rng))

    evals = [heldout_loss_fn(cfg, data["eval_stdlib"], 256)]  # comparable with the first target's 4.08
    if len(data["eval_packages"]):
        evals.append(heldout_loss_fn(cfg, data["eval_packages"], 256, name="heldout_loss_packages"))
    if args.long_fraction > 0:
        evals.append(heldout_loss_fn(cfg, data["eval_stdlib"], 1024, n_windows=16, name="heldout_loss_1024",
                                     chunk=4))

    if args.unlikelihood > 0:
        # What the fine-tune is for: repetition of greedy continuations of held-out prompts (as `dflash-jax quality`).
        held_prompts = corpus.held_out_prompts(16, seed=0)
        evals.append(lambda p: {"seq_rep_4": unlikelihood.median_seq_rep(Target(params=p, config=cfg), tok,
                                                                         held_prompts)})

    def eval_fn(params):
        out = {}
        for e in evals:
            out.update(e(params))
        return out

    optim = OptimConfig(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay)
    work.mkdir(parents=True, exist_ok=True)
    loss_fn, uses_params = lm_loss(cfg), False
    if args.unlikelihood > 0:  # the same text batches, plus the model's own continuations of real prefixes
        batch_fn = unlikelihood.make_batch_fn(
            cfg, batch_fn, lambda rng: mixed_windows(streams, weights, args.ul_batch, args.ul_prefix, rng),
            prefix_len=args.ul_prefix, new_tokens=args.ul_new_tokens, ngram=args.ul_ngram, seed=args.seed)
        loss_fn, uses_params = unlikelihood.unlikelihood_loss(cfg, args.unlikelihood), True
    params, history = run(params=params, loss_fn=loss_fn, batch_fn=batch_fn, optim=optim,
                          ckpt_dir=work / "ckpt", eval_fn=eval_fn, eval_every=args.eval_every,
                          ckpt_every=args.ckpt_every, desc="target",
                          log_file=work / "log.jsonl", batch_uses_params=uses_params)
    target = Target(params=params, config=cfg)
    save(args.out, target)
    final = eval_fn(params)
    tokens_seen = long_start * args.batch * args.seq_len + (args.steps - long_start) * long_batch * args.long_seq_len
    report = {"command": "dflash-jax train-target " + " ".join(argv or []), "steps": args.steps,
              "batch": args.batch, "seq_len": args.seq_len, "long_seq_len": args.long_seq_len,
              "long_from_step": long_start, "long_batch": long_batch, "tokens_seen": tokens_seen,
              "stdlib_weight": args.stdlib_weight, "lr": args.lr, "weight_decay": args.weight_decay,
              "init_from": args.init_from, "unlikelihood": args.unlikelihood,
              **({"ul_batch": args.ul_batch, "ul_prefix": args.ul_prefix, "ul_new_tokens": args.ul_new_tokens,
                  "ul_ngram": args.ul_ngram} if args.unlikelihood > 0 else {}),
              "train_loss": history[-1]["loss"] if history else None, **final,
              "wall_time_s_this_invocation": round(time.perf_counter() - t_start, 1),
              "params": int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))),
              "corpus": {k: man[k] for k in ("n_train_files", "n_eval_files", "train_tokens", "eval_tokens",
                                             "duplicates_dropped", "file_list_sha256", "python_version")},
              "packages": man["packages"]}
    with open(Path(args.out) / "train_report.json", "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "packages"}, indent=1))


if __name__ == "__main__":
    main()
