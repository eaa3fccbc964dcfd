"""The `--q8-activations` option, one definition for every command that takes it (`dflash-jax generate` / `bench`,
`python -m dflash_jax.bench.llamacpp`, `python -m dflash_jax.bench.profile`); the one rule that applies it is
`quant.linear.q8_scope`. No JAX here: the command's parser uses it, and `dflash-jax --help` loads no JAX."""

from __future__ import annotations


def add_q8_flag(parser) -> None:
    parser.add_argument("--q8-activations", action="store_true",
                        help="GGML weights' products on a CPU with x rounded to Q8 blocks, llama.cpp's integer dot, "
                             "and attention's rows in a fixed order (faster where compute bounds a step, e.g. AVX2 "
                             "CPUs; another function of the prompt than the float products, the same for "
                             "speculative and autoregressive decoding)")
