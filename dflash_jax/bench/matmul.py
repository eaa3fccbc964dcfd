"""CPU micro-benchmark of `dflash_jax.quant.linear.linear` under `jax.jit`, plus a look at the compiled HLO.

    python -m dflash_jax.bench.matmul [--size 2048] [--tokens 1,8,16] [--reps 20] [--warmup 3]

What it measures: y = x @ W.T for one square weight W [size, size] and x [tokens, size], one jitted call per
timing (weight passed as an argument, never closed over, so XLA cannot constant-fold the dequantization), for

    nvfp4  W . f32  x   NVFP4Array weight, portable (W4A16) path: dequantize inside the jitted function, f32 dot
    bf16   W . f32  x   dense bf16 weight, upcast to f32 inside the jitted function
    f32    W . f32  x   dense f32 weight (the baseline every ratio refers to)
    bf16   W . bf16 x   dense bf16 weight, bf16 activations (f32 accumulation)

Reported: median / p10 / p90 wall time per call over `reps` calls after `warmup` calls (block_until_ready each),
and median / baseline median. One run on whatever this machine is doing; see the printed load average.

Then, for each case, the optimised HLO (`jax.jit(f).lower(...).compile().as_text()`) is inspected to answer: does the
weight reach the dot straight from the argument buffer, or does a separate computation first materialise a full
f32/bf16 [size, size] weight in memory (the dequantization / upcast *not* fused into the dot)? For decode-size
token counts a materialised weight means every call writes and re-reads size*size*4 bytes, which dominates.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quant.linear import linear
from dflash_jax.quant.nvfp4 import NVFP4Array, quantize

BASELINE = "f32 W . f32 x"


# -- cases -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    weight: Any  # NVFP4Array or array [size, size]
    x_dtype: Any

    @property
    def weight_bytes(self) -> int:
        w = self.weight
        return w.nbytes if isinstance(w, NVFP4Array) else int(w.size) * w.dtype.itemsize


def make_cases(size: int, seed: int = 0) -> list[Case]:
    w = np.random.default_rng(seed).standard_normal((size, size)).astype(np.float32) * 0.02
    w32 = jnp.asarray(w)
    w16 = w32.astype(jnp.bfloat16)
    q = quantize(w)
    jax.block_until_ready((w32, w16, q))
    return [  # the NVFP4 case first: the HLO finding below is about cases[0]
        Case("nvfp4 W . f32 x", q, jnp.float32),
        Case(BASELINE, w32, jnp.float32),
        Case("bf16 W . f32 x", w16, jnp.float32),
        Case("bf16 W . bf16 x", w16, jnp.bfloat16),
    ]


def _fn(x, w):
    return linear(x, w, backend="portable")


# -- timing ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Timing:
    case: str
    tokens: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    weight_mib: float


def time_call(f: Callable, args: tuple, reps: int, warmup: int) -> list[float]:
    for _ in range(max(warmup, 1)):  # the first call compiles
        jax.block_until_ready(f(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def run_timings(cases: list[Case], tokens: list[int], reps: int, warmup: int, seed: int = 1) -> list[Timing]:
    f = jax.jit(_fn)
    rng = np.random.default_rng(seed)
    results = []
    for t in tokens:
        x32 = rng.standard_normal((t, cases[0].weight.shape[1])).astype(np.float32)
        for c in cases:
            x = jnp.asarray(x32, c.x_dtype)
            ms = time_call(f, (x, c.weight), reps, warmup)
            results.append(Timing(c.name, t, statistics.median(ms), _quantile(ms, 0.1), _quantile(ms, 0.9),
                                  c.weight_bytes / 2**20))
    return results


def format_table(results: list[Timing]) -> str:
    base = {r.tokens: r.median_ms for r in results if r.case == BASELINE}
    head = (f"{'tokens':>6}  {'case':<17} {'W MiB':>6} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
            f"{'x f32-W time':>12}")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r.median_ms / base[r.tokens] if r.tokens in base else float("nan")
        lines.append(f"{r.tokens:>6}  {r.case:<17} {r.weight_mib:>6.2f} {r.median_ms:>10.3f} {r.p10_ms:>8.3f} "
                     f"{r.p90_ms:>8.3f} {ratio:>12.2f}")
    return "\n".join(lines)


# -- HLO inspection ----------------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")
_PASS_THROUGH = {"bitcast", "copy", "reshape", "transpose"}
_DEQUANT_OPS = {"convert", "multiply", "bitcast-convert", "shift-right-logical", "and"}


@dataclasses.dataclass
class Instr:
    name: str
    dtype: str
    dims: tuple[int, ...]
    opcode: str
    operands: list[str]
    kind: str | None
    calls: str | None
    target: str | None
    text: str


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """{computation name: instructions} and the ENTRY computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        sm = _SHAPE.match(shape)
        dtype, dims = (sm.group(1), tuple(int(d) for d in sm.group(2).split(",") if d)) if sm else (shape, ())
        args = rest.split(")", 1)[0]
        kind = re.search(r"kind=(\w+)", rest)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        comps[current].append(Instr(name, dtype, dims, opcode, re.findall(r"%([\w.\-]+)", args),
                                    kind and kind.group(1), calls and calls.group(1), target and target.group(1),
                                    line.strip()))
    return comps, entry


def _is_dot(i: Instr) -> bool:
    return i.opcode == "dot" or (i.opcode == "custom-call" and bool(i.target)
                                 and re.search(r"matmul|gemm|dot", i.target, re.I) is not None)


@dataclasses.dataclass
class FusionReport:
    dot: str  # the dot instruction
    dot_in: str  # "top level" or the fusion (kind) that contains it
    weight_source: str  # one of: "argument", "fused", "materialised"
    detail: str  # the instruction producing the weight operand, and what it computes
    materialised: list[str]  # top-level float [out, in] buffers that are not arguments


def inspect_hlo(text: str, weight_shape: tuple[int, int]) -> FusionReport:
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    by_name = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
    caller = {}  # fused computation -> (calling computation, fusion instruction)
    for c, instrs in comps.items():
        for i in instrs:
            if i.calls and i.calls in comps:
                caller[i.calls] = (c, i)
    dots = [(c, i) for c, instrs in comps.items() for i in instrs if _is_dot(i)]
    if not dots:
        raise ValueError("no dot / matmul custom-call found in the HLO")
    comp, dot = dots[0]
    dot_in = "top level" if comp == entry else f"{caller[comp][1].name} (kind={caller[comp][1].kind})" \
        if comp in caller else comp
    # The weight operand: the dot operand with the weight's shape (rhs for x @ W.T).
    cands = [o for o in dot.operands if by_name[comp].get(o) and by_name[comp][o].dims == weight_shape]
    node, where = (by_name[comp][cands[0]] if cands else by_name[comp][dot.operands[-1]]), comp
    fused_ops: set[str] = set()
    while True:
        if node.opcode in _PASS_THROUGH and node.operands:
            node = by_name[where][node.operands[0]]
            continue
        if node.opcode == "parameter" and where in caller:  # leave the fused computation: caller's operand
            idx = int(re.search(r"parameter\((\d+)\)", node.text).group(1))
            where, fusion = caller[where]
            node = by_name[where][fusion.operands[idx]]
            continue
        break
    if where == comp and node.opcode in _DEQUANT_OPS:
        fused_ops = {i.opcode for i in comps[comp]} & _DEQUANT_OPS
        source, detail = "fused", f"{node.opcode} inside the dot's own computation (ops: {sorted(fused_ops)})"
    elif node.opcode == "parameter":
        source, detail = "argument", f"{node.name} = {node.dtype}{list(node.dims)} parameter (used in place)"
    else:
        inner = sorted({i.opcode for i in comps.get(node.calls, [])} & _DEQUANT_OPS) if node.calls else []
        source = "materialised"
        detail = (f"{node.name} = {node.dtype}{list(node.dims)} {node.opcode}"
                  f"{f' kind={node.kind}' if node.kind else ''}{f' (ops: {inner})' if inner else ''}")
    top_level = [i for i in comps[entry] if i.dims == weight_shape and i.opcode != "parameter"
                 and i.dtype in ("f32", "bf16", "f16") and i.opcode not in ("bitcast",)]
    mats = [f"{i.name} = {i.dtype}{list(i.dims)} {i.opcode}{f' kind={i.kind}' if i.kind else ''}"
            for i in top_level]
    return FusionReport(dot.text.split(", metadata")[0], dot_in, source, detail, mats)


def compiled_hlo(case: Case, tokens: int) -> str:
    x = jnp.zeros((tokens, case.weight.shape[1]), case.x_dtype)
    return jax.jit(_fn).lower(x, case.weight).compile().as_text()


# -- main --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=2048, help="weight is [size, size] (multiple of 16)")
    ap.add_argument("--tokens", default="1,8,16", help="comma-separated token counts (rows of x)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per cell (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per cell (the first compiles)")
    ap.add_argument("--show-hlo", action="store_true", help="also print the NVFP4 case's compiled HLO")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    size = args.size

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"dflash_jax.bench.matmul: linear(x [T, {size}], W [{size}, {size}]) under jax.jit")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
          f"{os.cpu_count()} CPUs, {platform.machine()}, load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{args.reps} timed reps after {args.warmup} warmup calls per cell; one run, not repeated")
    print()
    cases = make_cases(size)
    results = run_timings(cases, tokens, args.reps, args.warmup)
    print(format_table(results))
    print(f"\n'x f32-W time' = median / median of '{BASELINE}' at the same token count (< 1 is faster).")

    print("\nHLO inspection (optimised HLO of each jitted call): where does the dot's weight operand come from?")
    reports = {}
    for c in cases:
        seen: dict[tuple[str, str], list[int]] = {}
        for t in tokens:
            hlo = compiled_hlo(c, t)
            r = inspect_hlo(hlo, (size, size))
            reports[(c.name, t)] = r
            seen.setdefault((f"dot in {r.dot_in}; weight from: {r.weight_source}", r.detail), []).append(t)
            if c is cases[0] and t == tokens[-1] and args.show_hlo:
                print(hlo)
        for (where, detail), ts in seen.items():
            print(f"  [{c.name}] tokens {','.join(map(str, ts))}: {where}: {detail}")
    r = reports[(cases[0].name, tokens[-1])]
    if any(reports[(cases[0].name, t)].weight_source != r.weight_source for t in tokens):
        print("  (note: the NVFP4 verdict differs between token counts; the finding below is for the largest)")
    print()
    if r.weight_source == "fused":
        print(f"NVFP4 finding: the dequantization IS fused into the dot's fusion ({r.dot_in}); no f32/bf16 "
              f"[{size}, {size}] weight buffer is materialised.")
    elif r.weight_source == "materialised":
        mib = size * size * 4 / 2**20
        print(f"NVFP4 finding: the dequantization is NOT fused into the dot. A separate fusion "
              f"({r.detail}) writes a full [{size}, {size}] weight buffer ({mib:.2f} MiB in f32) on every call, "
              f"and the dot ({r.dot_in}) reads it back. Top-level weight-shaped float buffers: {r.materialised}.")
    else:
        print(f"NVFP4 finding: unexpected: the dot reads the weight straight from an argument ({r.detail}).")
    return {"timings": results, "hlo": reports}


if __name__ == "__main__":
    main(sys.argv[1:])
