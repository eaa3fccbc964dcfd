"""The execution context: the one piece of process state a forward pass reads besides its arguments.

What a traced forward depends on without being handed it (the NVFP4 backend of `quant.linear.linear` and how its
Pallas kernel lowers, the mesh the sharding constraints pin activations to, attention's block size and live-length
loop, and during calibration the recorder of every linear's input) is one frozen value, `ExecutionContext`, held in
a JAX user context: its value is part of every `jax.jit` cache key, so a program traced under one context is never
reused under another (a later change of backend or attention setting retraces instead of running a stale
executable).

The package's compiled programs (generate's prefill and loop, `target_forward`, `draft_logits` / `draft_proposal`)
each run under one context, built on the host when the call is prepared and entered around the dispatch (`using`).
The settings' entry points change one field of the current context: `quant.linear.set_default_backend` (the process
default) and `backend_scope`, `models.attention.attention_chunk` and `live_length_loop`, `parallel.sharding.mesh_scope`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax

from dflash_jax.frozen import Replaceable


@dataclasses.dataclass(frozen=True)
class ExecutionContext(Replaceable):
    """How forwards run, as opposed to what they compute from (arguments) or what the model is (configs)."""

    # NVFP4 backend name for `linear` ("portable" | "pallas" | "native"); None = the process default, then the
    # environment, then automatic (`quant.linear.resolve_backend`). Programs hold a concrete name, resolved on the
    # host, or None when no weight is NVFP4.
    nvfp4_backend: str | None = None
    mesh: Any = None  # the ("data", "model") jax.sharding.Mesh caches and K/V are pinned to; None = one device
    # Attention over cached keys visits only the blocks up to the longest live row (a data-dependent trip count:
    # CPU programs only, never where a gradient is taken); False = static trip counts over the whole cache.
    live_length_loop: bool = False
    attention_chunk: int | None = None  # keys and queries per attention block, exactly (None: attention's defaults)
    # Dense and NVFP4 weights through the CPU matmul kernel (`quant.cpu_kernel`), as GGML blocks always are: on in
    # the CPU generation loops, where products have few rows (XLA:CPU's GEMM costs ~2x its GEMV there) and a row's
    # result must not depend on how many rows share the product (a verify then equals a decode bit for bit).
    cpu_kernel: bool = False
    # GGML weights (Q4_1 / Q8_0) times x rounded to Q8 blocks, llama.cpp's integer dot product, in the CPU kernel
    # (`quant/cpu_q8_dot.h`): ~2x fewer cycles per weight where compute bounds a step (AVX2 CPUs), and another function
    # of x than the float path (x rounded to 8 bits per 32-wide block). A row's result still depends on that row alone.
    q8_activations: bool = False
    # GGML weights and x rounded to bfloat16, AVX512-BF16's dot product, in the CPU kernel (`quant/cpu_bf16_dot.h`):
    # one instruction per 32 weights and row of x instead of two FMAs, where the FMA pipes bound a verify of 3+ rows;
    # another function of x and of the weights than the float path. A row's result still depends on that row alone.
    # None: generation's default (`quant.products.generation_bf16_products`: on where the CPU has the instruction and x
    # is not rounded to Q8), float products everywhere else (a forward called outside generation, training data).
    bf16_products: bool | None = None
    # The Pallas NVFP4 kernel (`quant.pallas_nvfp4`): None = the Triton kernel on a GPU, interpreted elsewhere;
    # False forces the Triton lowering (e.g. to export a CUDA program from a CPU-only host), True the interpreter.
    pallas_interpret: bool | None = None
    pallas_debug: bool = False  # pallas_call(debug=...): print the kernel jaxpr and the Triton IR when lowering
    # Calibration (`quant.quantize.collect_linear_inputs`, eager): called with (x, w) for every linear. Left out of
    # equality and hashing, so of jit cache keys: it observes a forward and never changes what a program computes.
    input_recorder: Callable[[Any, Any], None] | None = dataclasses.field(default=None, compare=False)


def rows_in_fixed_order() -> bool:
    """Whether forwards traced now compute each row's reductions (attention's sums, RMSNorm's mean) in an order that
    depends on that row alone (`models.attention`, `models.layers`): the CPU loop programs, float32 or Q8 activations
    alike. With the kernel's matmul rows, a row's values then never depend on how many rows share the step, so a
    verify's row equals the decode of the same token bit for bit (XLA's reductions pick their order by shape: a few
    ulps apart, which Q8 rounding turns into different tokens and float32 into a near-tie's flip)."""
    return current().cpu_kernel


# Thread-local values over a process-wide default (`set_process_default`), both part of jit cache keys.
_CONTEXT = jax.make_user_context(default_value=ExecutionContext())


def current() -> ExecutionContext:
    """The context forwards traced (or run eagerly) now read."""
    return _CONTEXT.value


def process_default() -> ExecutionContext:
    """The context outside every `using` block."""
    return _CONTEXT.get_global()


def set_process_default(context: ExecutionContext) -> None:
    _CONTEXT.set_global(_checked(context))


def using(context: ExecutionContext):
    """Inside the block, forwards read `context` (and jitted programs are keyed on it)."""
    return _CONTEXT(_checked(context))


@contextlib.contextmanager
def changed(**fields) -> Iterator[ExecutionContext]:
    """Inside the block, the current context with `fields` changed (read when the block is entered)."""
    context = current().replace(**fields)
    with using(context):
        yield context


def _checked(context) -> ExecutionContext:
    if not isinstance(context, ExecutionContext):
        raise TypeError(f"expected an ExecutionContext, got {type(context).__name__}")
    return context


__all__ = ["ExecutionContext", "changed", "current", "process_default", "rows_in_fixed_order", "set_process_default",
           "using"]
