"""One generation call as `generate` prepares it on the host (`ProgramCall`), and running it: both programs
dispatched back to back, timed, their results read back into a `GenerationResult`.

Timing: each dispatch traces and compiles first when needed (synchronously; JAX reports those seconds through
jax.monitoring, counted here apart from run time), while execution is asynchronous. Prefill runs from the end of
its compile to its stamp (a host callback at the end of the prefill program), or, with prefill_timing="rerun", for
as long as a second run of the compiled prefill program takes; the loop from the later of the stamp and the end of
its own dispatch to the end.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Callable

import jax
import numpy as np

from dflash_jax import execution
from dflash_jax.decode.buckets import PAD
from dflash_jax.decode.loop import autoregressive_loop, speculative_loop
from dflash_jax.decode.prefill import STAMPS, prefill_program
from dflash_jax.decode.result import GenerationResult

PROGRAM_PREFIX = "dflash_"  # the name of every traced program of ours starts with it (the compile clock looks)


@dataclasses.dataclass(frozen=True)
class ProgramCall:
    """One generation call as `generate` prepares it on the host: the prefill program, then the loop program."""

    name: str  # "speculative" | "autoregressive" (the loop program)
    args: tuple  # (target, drafter | None, prompt [B, Tp], lens [B], keys [B, 2], SamplingParams, Budget)
    prefill_static: dict  # static keyword arguments of prefill: cache bucket, stamp
    loop_static: dict  # static keyword arguments of the loop: budget bucket, draft length
    # The loop program runs under it (NVFP4 backend, mesh, attention rule, block size), prefill under
    # `prefill_context`: part of each program's jit cache key, like the static arguments.
    context: execution.ExecutionContext
    max_new: int
    draft_length: int  # drafts per step (a draft tree's depth)
    eos: tuple[int, ...]
    prefill_program: Callable  # the jitted prefill program (`decode.programs`)
    loop_program: Callable  # the jitted loop program
    batch: int = 0  # rows the caller gave (the programs run a batch bucket: inert padding rows after them)
    prompts: tuple = ()  # the caller's rows (real tokens), for return_prompt
    return_prompt: bool = False
    tree_budget: int | None = None  # draft-tree nodes per step (None: chains)
    context_lookup: int = 0  # a step's shortest repeat copied from the text (0: off; `decode.lookup`)
    draft_pass: str | None = None  # the drafter's `draft_pass` as the loop runs it (None: nothing drafted)

    @property
    def prefill_context(self) -> execution.ExecutionContext:
        """The loop's context without the live-length loop and the CPU kernel for dense weights: prefill attends no
        cache and its products have many rows (XLA's GEMM), so one prefill program serves both rules."""
        return self.context.replace(live_length_loop=False, cpu_kernel=False)

    @property
    def static(self) -> dict:
        """Everything both programs are keyed on besides their arguments' shapes: their static arguments and the
        loop's execution context."""
        return {**self.prefill_static, **self.loop_static, "context": self.context}

    @property
    def unjitted(self):
        """Prefill then the loop as one plain function of `args`, static arguments bound and each part traced under
        its context (to inspect the jaxpr)."""
        loop_fn = speculative_loop if self.name == "speculative" else autoregressive_loop

        def fn(target, drafter, prompt, lens, keys, sampling, budget):
            with execution.using(self.prefill_context):
                pre = prefill_program(target, drafter, prompt, lens, **self.prefill_static)
            with execution.using(self.context):
                return loop_fn(target, drafter, pre, keys, sampling, budget, **self.loop_static)
        return fn

    def run_prefill(self, *args):
        target, drafter, prompt, lens = (args or self.args)[:4]
        with execution.using(self.prefill_context):
            return self.prefill_program(target, drafter, prompt, lens, **self.prefill_static)

    def run_loop(self, pre, *args):
        """The loop program on prefill's handoff `pre` (donated: `pre` is consumed)."""
        target, drafter, _, _, keys, sampling, budget = args or self.args
        with warnings.catch_warnings(), execution.using(self.context):
            # logits and lengths have no output to alias (only the caches do)
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self.loop_program(target, drafter, pre, keys, sampling, budget, **self.loop_static)

    def __call__(self, *args):
        """Both programs, dispatched back to back (the handoff stays on device): (out, n_out, acc, steps)."""
        return self.run_loop(self.run_prefill(*args), *args)[:4]

    def lower(self) -> tuple:
        """(prefill, loop) lowered for these arguments (prefill runs once here to give the loop its input)."""
        target, drafter, prompt, lens, keys, sampling, budget = self.args
        with execution.using(self.prefill_context):
            pre_low = self.prefill_program.lower(target, drafter, prompt, lens, **self.prefill_static)
        pre = self.run_prefill()
        with execution.using(self.context):
            loop_low = self.loop_program.lower(target, drafter, pre, keys, sampling, budget, **self.loop_static)
        return pre_low, loop_low

    def compiled_text(self) -> str:
        """The optimized HLO of both programs, prefill first."""
        return "\n".join(low.compile().as_text() for low in self.lower())

    def run(self) -> GenerationResult:
        """Runs both programs and times them (see the module doc)."""
        _compile_clock.seconds = 0.0
        STAMPS["prefill_done"] = None
        t0 = time.perf_counter()
        pre = self.run_prefill()
        compile_prefill = _compile_clock.seconds
        out, n_out, acc, steps, _ = self.run_loop(pre)
        t_loop = time.perf_counter()  # the loop is dispatched (and compiled, if it had to be)
        out, n_out, acc, steps = jax.block_until_ready((out, n_out, acc, steps))
        t1 = time.perf_counter()
        compile_s = _compile_clock.seconds
        t_start = min(t0 + compile_prefill, t1)  # prefill execution starts once it is traced and compiled
        if self.prefill_static["stamp"]:
            t_prefill = STAMPS["prefill_done"] if STAMPS["prefill_done"] is not None else t_start
        else:  # prefill timed by running the (compiled, callback-free) prefill program once more on its own
            r0 = time.perf_counter()
            jax.block_until_ready(self.run_prefill())
            t_prefill = t_start + (time.perf_counter() - r0)
        t_prefill = min(t_prefill, t1)
        t_decode = min(max(t_prefill, t_loop if compile_s > compile_prefill else t_prefill), t1)
        out, n_out, acc, steps = map(to_host, (out, n_out, acc, steps))
        steps = int(steps)
        B = self.batch or out.shape[0]  # padding rows (batch bucket, mesh's data axis) never reach the result
        out, n_out, acc = out[:B, :self.max_new], n_out[:B], acc[:B, :steps]
        last = np.take_along_axis(out, np.maximum(n_out - 1, 0)[:, None].astype(np.int64), axis=1)[:, 0]
        ended = (n_out > 0) & np.isin(last, np.asarray(self.eos, np.int64))
        reasons = tuple(np.where(ended, "eos", "length").tolist())
        timings = {"prefill_s": t_prefill - t_start, "decode_s": t1 - t_decode,
                   "total_s": (t_prefill - t_start) + (t1 - t_decode), "compile_s": compile_s}
        lens = np.asarray(self.args[3] if not isinstance(self.args[3], jax.Array) else to_host(self.args[3]))[:B]
        if self.return_prompt:
            out = _with_prompts(self.prompts, out, n_out)
        return GenerationResult(tokens=out, num_tokens=n_out, acceptance_lengths=acc, finish_reason=reasons,
                                num_steps=steps, draft_length=self.draft_length, tree_budget=self.tree_budget,
                                context_lookup=self.context_lookup,
                                draft_pass=self.draft_pass,
                                timings=timings,
                                prompt_lengths=lens.astype(np.int32), includes_prompt=self.return_prompt)


def to_host(x) -> np.ndarray:
    """A program result on the host; with several processes, results are replicated and read from a local copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.device_get(x))


def _with_prompts(prompts, out: np.ndarray, n_out: np.ndarray) -> np.ndarray:
    """[B, longest prompt + N]: each row's prompt, its new tokens, then PAD (HF's `generate` output, unpadded)."""
    N = out.shape[1]
    full = np.full((len(prompts), max(len(p) for p in prompts) + N), PAD, np.int32)
    for b, p in enumerate(prompts):
        full[b, :len(p)] = p
        full[b, len(p):len(p) + int(n_out[b])] = out[b, :int(n_out[b])]
    return full


# Seconds spent tracing, lowering and compiling our programs, as JAX reports them (jax.monitoring): a call's
# compile time is reported apart from its run time without a compile cache of our own.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_clock = threading.local()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS and PROGRAM_PREFIX in str(kwargs.get("fun_name", "")):
        _compile_clock.seconds = getattr(_compile_clock, "seconds", 0.0) + duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


__all__ = ["PROGRAM_PREFIX", "ProgramCall", "to_host"]
