"""Which products a GGUF target's GGML weights take in generation on a CPU: float32 ones (x as it is), bfloat16 ones
(AVX512-BF16's dot product: the default where the CPU has the instruction) or Q8 integer dots (llama.cpp's), and a
command's flags for them (`bench.flags`). The products themselves are the CPU kernel's (`quant/cpu_matmul.cc`);
`quant.linear` picks the kernel format from the execution context, which this module's rules fill in for generation's
programs (`decode.programs`, `bench.step_costs`)."""

from __future__ import annotations

import contextlib

from dflash_jax import execution
from dflash_jax.quant import cpu_kernel
from dflash_jax.quant.linear import bf16_products_scope, cpu_kernel_runs, q8_activations_scope


def generation_bf16_products(q8: bool | None = None) -> bool:
    """Whether generation's programs (generate's prefill and loop, the step table's pieces) take bfloat16 products:
    the execution context's setting where it has one, else on where the CPU kernel runs AVX512-BF16's `vdpbf16ps`
    natively (`cpu_kernel.bf16_products_native`: Zen 4 and 5, Sapphire Rapids) and x is not rounded to Q8 (`q8`:
    None = the context's). Why a default there: a verify's rows are bound by the FMA pipes, and the instruction does
    a row's 32 products in one (a verify of 4 rows 6.04 vs 6.83 ms, the first command 1.40x against 1.10x on a Zen
    5: docs/cpu-step.md); the output is another function of the prompt than float32 products (logits within 1% of
    the largest on the default target), the same for speculative and autoregressive decoding. Elsewhere the
    instruction is emulated, slower than float32 products, so they stay. Forwards outside generation read only the
    context's explicit True."""
    context = execution.current()
    if context.bf16_products is not None:
        return context.bf16_products
    q8 = context.q8_activations if q8 is None else q8
    return not q8 and cpu_kernel_runs() and cpu_kernel.bf16_products_native()


def generation_products() -> str:
    """What a GGUF target's products are in generation here, as benchmarks name them: "Q8-activation",
    "bfloat16" (`generation_bf16_products`) or "float32"."""
    if execution.current().q8_activations:
        return "Q8-activation"
    return "bfloat16" if generation_bf16_products() else "float32"


def products_scope(args):
    """A command's `--q8-activations` / `--bf16-products` / `--f32-products` (`bench.flags`; `args` the parsed
    arguments, any may be absent): for the command's duration, GGML products run as Q8 integer dots
    (`ExecutionContext.q8_activations`), as bfloat16 dot products (`ExecutionContext.bf16_products`) or as float32
    ones; none of them: generation's default (`generation_bf16_products`). Every program the command compiles is
    traced under it, and a drafter's step table is read for that build. None leaves the caller's setting as it is.
    Scoped, not the process default: a caller running several commands in one process (the docs test) gets each
    one's own setting."""
    if getattr(args, "q8_activations", False):
        return q8_activations_scope(True)
    if getattr(args, "bf16_products", False):
        return bf16_products_scope(True)
    if getattr(args, "f32_products", False):
        return bf16_products_scope(False)
    return contextlib.nullcontext()
