"""Train the project's byte-level BPE tokenizer on the stdlib TRAIN split.

    python -m dflash_jax.train.tokenizer_train --vocab-size 4096 --out checkpoints/tokenizer.json

Writes the tokenizer and, next to it, ``<stem>.manifest.json`` recording the
Python version, corpus file-list digest and compression figures (the stdlib,
hence the tokenizer, differs across Python versions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dflash_jax.io.tokenizer import SPECIAL_TOKENS, Tokenizer
from dflash_jax.train.corpus import manifest, read_texts, split_files, stdlib_files


def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` = 0 and ``<|mask|>`` = 1.

    WHY special tokens first: their ids stay small and stable whatever the
    vocab size, so configs and tests can rely on them. WHY the full 256-byte
    initial alphabet: any byte sequence stays encodable, even bytes the
    corpus never contained (no unk token is ever needed).
    """
    hf = HFTokenizer(models.BPE())
    # No normalizer: code must come back byte for byte. No prefix space: it
    # would change the first token of every file and break the round trip.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return Tokenizer(hf)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--out", type=Path, default=Path("checkpoints/tokenizer.json"),
                        help="where the tokenizer JSON is written")
    args = parser.parse_args(argv)

    train_files, eval_files = split_files(stdlib_files())
    train_texts, eval_texts = read_texts(train_files), read_texts(eval_files)
    train_chars = sum(map(len, train_texts))
    eval_chars = sum(map(len, eval_texts))

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab_size)  # TRAIN split only
    train_s = time.perf_counter() - t0
    tok.save(args.out)

    train_tokens = sum(map(len, tok.encode_batch(train_texts)))
    eval_tokens = sum(map(len, tok.encode_batch(eval_texts)))
    stats = {
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "mask_id": tok.mask_id,
        "train_chars": train_chars,
        "eval_chars": eval_chars,
        "train_tokens": train_tokens,
        "eval_tokens": eval_tokens,
        "train_tokens_per_char": train_tokens / train_chars,
        "eval_tokens_per_char": eval_tokens / eval_chars,
        "train_seconds": round(train_s, 2),
    }
    record = {**manifest(train_files, eval_files), **stats}
    manifest_path = args.out.with_name(args.out.stem + ".manifest.json")
    manifest_path.write_text(json.dumps(record, indent=1) + "\n")

    print(f"python {sys.version.split()[0]}  train files {len(train_files)}  eval files {len(eval_files)}")
    print(f"chars: train {train_chars:,}  eval {eval_chars:,}  total {train_chars + eval_chars:,}")
    print(f"tokens/char: train {stats['train_tokens_per_char']:.4f}  eval {stats['eval_tokens_per_char']:.4f}")
    print(f"trained vocab {tok.vocab_size} in {train_s:.1f}s -> {args.out} ({args.out.stat().st_size:,} bytes), {manifest_path}")


if __name__ == "__main__":
    main()
