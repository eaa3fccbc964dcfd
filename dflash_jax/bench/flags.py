"""The products options, one definition for every command that takes them (`dflash-jax generate` / `bench`,
`python -m dflash_jax.bench.llamacpp`, `python -m dflash_jax.bench.profile`, `python -m dflash_jax.bench.loop_profile`):
`--q8-activations`, `--bf16-products` and `--f32-products` (none: generation's default, bfloat16 products where the
CPU has AVX512-BF16); the one rule that applies them is `quant.products.products_scope`. No JAX here: the command's
parser uses it, and `dflash-jax --help` loads no JAX."""

from __future__ import annotations


def add_product_flags(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--q8-activations", action="store_true",
                       help="GGML weights' products on a CPU with x rounded to Q8 blocks, llama.cpp's integer dot, "
                            "and attention's rows in a fixed order (faster where compute bounds a step, e.g. AVX2 "
                            "CPUs; another function of the prompt than the float products, the same for "
                            "speculative and autoregressive decoding)")
    group.add_argument("--bf16-products", action="store_true",
                       help="GGML weights' products on a CPU with the weights and x rounded to bfloat16, AVX512-BF16's "
                            "dot product (a verify 5-16%% cheaper against a decode on a Zen 5; the default on CPUs "
                            "with AVX512-BF16; emulated, the same values and slower, on CPUs without it; another "
                            "function of the prompt than the float products, the same for speculative and "
                            "autoregressive decoding)")
    group.add_argument("--f32-products", action="store_true",
                       help="GGML weights' products on a CPU in float32, x as it is (the default on CPUs without "
                            "AVX512-BF16; the closest to the dequantized weights' own products)")
