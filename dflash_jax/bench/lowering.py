"""Loops and conditionals in a lowered program: what would make an accelerator wait on the host.

On XLA:GPU a `while` whose trip count depends on data, and every `case` / `if`, copies its predicate to the host on
each execution (unless command buffers with conditional nodes are on). `loop_report` walks a StableHLO module (e.g.
`jax.export(..., platforms=["cuda"]).mlir_module()`, exported on any host) and splits its while loops into those
with a provably static trip count (the condition is `counter < constant` and the body steps the counter by a
constant: `lax.scan`, `fori_loop` with static bounds) and the rest, and counts the conditionals.
`speculative_module` exports the speculative loop program `generate` would build for a platform, with that
platform's execution settings whatever host exports it (a CUDA export takes the accelerator rule: attention with
static trip counts and XLA's own dot; a CPU export the live-length loop and the CPU kernel:
`buckets.uses_live_length_loop`).
"""

from __future__ import annotations

import jax
from jax import export
from jax._src.interpreters import mlir as jmlir  # the MLIR Python bindings JAX ships (to parse the module)
from jax._src.lib.mlir import ir

from dflash_jax import execution
from dflash_jax.decode import programs as G
from dflash_jax.decode.buckets import uses_live_length_loop
from dflash_jax.quant import cpu_kernel

# The Pallas NVFP4 kernel lowers to this custom call for CUDA, the CPU kernel to its own for CPU (opaque kernels
# here; none is a stable export target, which these exports only inspect).
TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
# custom calls an export may hold (no compatibility guarantee)
UNCHECKED = [TRITON, *(export.DisabledSafetyCheck.custom_call(name) for name in cpu_kernel.FFI_TARGETS)]


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                yield o.operation
                yield from _walk(o.operation)


def _is_constant(value) -> bool:
    return not isinstance(value.owner, ir.Block) and value.owner.name == "stablehlo.constant"


def _arg_index(value, block) -> int | None:
    """The index of `value` among block's arguments, or None if it is not one of them."""
    if isinstance(value.owner, ir.Block) and value.owner == block:
        return ir.BlockArgument(value).arg_number
    return None


def static_trip_count(while_op) -> bool:
    """True when the loop's condition is `counter < constant` and its body steps that counter by a constant."""
    cond, body = while_op.regions[0].blocks[0], while_op.regions[1].blocks[0]
    pred = list(cond.operations)[-1].operands[0].owner
    if isinstance(pred, ir.Block) or pred.name != "stablehlo.compare":
        return False
    if "LT" not in str(pred.attributes["comparison_direction"]):
        return False
    counter, bound = pred.operands
    i = _arg_index(counter, cond)
    if i is None or not _is_constant(bound):
        return False
    step = list(body.operations)[-1].operands[i].owner  # the counter's next value
    if isinstance(step, ir.Block) or step.name != "stablehlo.add":
        return False
    a, b = step.operands
    return (_arg_index(a, body) == i and _is_constant(b)) or (_arg_index(b, body) == i and _is_constant(a))


def loop_report(text: str) -> dict:
    """Whiles of a StableHLO module split by static trip count, and its conditionals (`case` / `if`).

    static / dynamic: whiles anywhere; dynamic_at_top: dynamic whiles directly in a function (not nested in another
    loop); dynamic_nested: whiles of any kind nested inside a dynamic one (in its regions; functions it calls are
    counted where they are defined)."""
    with jmlir.make_ir_context():
        module = ir.Module.parse(text)
        ops = list(_walk(module.operation))
        whiles = [o for o in ops if o.name == "stablehlo.while"]
        dynamic = [o for o in whiles if not static_trip_count(o)]
        return {"static": len(whiles) - len(dynamic), "dynamic": len(dynamic),
                "dynamic_nested": sum(1 for d in dynamic for o in _walk(d) if o.name == "stablehlo.while"),
                "dynamic_at_top": sum(1 for d in dynamic if d.parent.name == "func.func"),
                "conditionals": sum(1 for o in ops if o.name in ("stablehlo.case", "stablehlo.if"))}


def speculative_module(target, drafter, prompts, *, platform: str = "cuda", chunk: int | None = None,
                       **generate_kw) -> str:
    """The StableHLO text of the speculative loop program `generate` would run (the generation `while_loop` that holds
    every draft / verify / accept step; prefill is a program of its own), exported for `platform` (no device of
    that kind needed) with `platform`'s execution settings, not the host's. chunk: attention blocks
    (`ExecutionContext.attention_chunk`), e.g. small to make every block loop appear."""
    call = G.speculative_call(target, drafter, prompts, prefill_timing="rerun", **generate_kw)
    target, drafter, prompt, lens, keys, sampling, budget = call.args
    with execution.using(call.prefill_context.replace(attention_chunk=chunk)):
        # the loop program takes prefill's handoff: its shapes are enough to export it (nothing runs here)
        pre = jax.eval_shape(lambda *a: call.prefill_program(*a, **call.prefill_static), target, drafter, prompt, lens)
    # the platform's rule for both CPU-only settings: the live-length loop and the CPU matmul kernel (a custom call
    # only XLA:CPU has)
    cpu = uses_live_length_loop(platform)
    with execution.using(call.context.replace(attention_chunk=chunk, live_length_loop=cpu, cpu_kernel=cpu)):
        exp = export.export(call.loop_program, platforms=[platform], disabled_checks=UNCHECKED)(
            target, drafter, pre, keys, sampling, budget, **call.loop_static)
    return exp.mlir_module()


def prefill_module(target, drafter, prompts, *, platform: str = "cuda", chunk: int | None = None,
                   **generate_kw) -> str:
    """The StableHLO text of the prefill program `generate` runs before the loop, exported for `platform`."""
    call = G.speculative_call(target, drafter, prompts, prefill_timing="rerun", **generate_kw)
    target, drafter, prompt, lens = call.args[:4]
    with execution.using(call.prefill_context.replace(attention_chunk=chunk)):
        exp = export.export(call.prefill_program, platforms=[platform], disabled_checks=UNCHECKED)(
            target, drafter, prompt, lens, **call.prefill_static)
    return exp.mlir_module()


__all__ = ["loop_report", "prefill_module", "speculative_module", "static_trip_count"]
