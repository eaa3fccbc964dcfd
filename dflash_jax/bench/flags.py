"""The `--q8-activations` option, one definition for every command that takes it (`dflash-jax generate` / `bench`,
`python -m dflash_jax.bench.llamacpp`, `python -m dflash_jax.bench.profile`), and the one rule that applies it."""

from __future__ import annotations

import contextlib

from dflash_jax.quant.linear import q8_activations_scope


def add_q8_flag(parser) -> None:
    parser.add_argument("--q8-activations", action="store_true",
                        help="GGML weights' products on a CPU with x rounded to Q8 blocks, llama.cpp's integer dot, "
                             "and attention's rows in a fixed order (faster where compute bounds a step, e.g. AVX2 "
                             "CPUs; another function of the prompt than the float products, the same for "
                             "speculative and autoregressive decoding)")


def q8_scope(on: bool):
    """For a command's duration (on: True), GGML products run as Q8 integer dots (`ExecutionContext.q8_activations`):
    every program it compiles is traced under it, and a drafter's step table is read for that build. Off leaves the
    caller's setting as it is. Scoped, not the process default: a caller running several commands in one process
    (the docs test) gets each one's own setting."""
    if not on:
        return contextlib.nullcontext()
    return q8_activations_scope(True)
