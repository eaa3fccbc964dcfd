"""Where a compiled step spends its time, per op group: the profile behind the step costs r and c.

    python -m dflash_jax.bench.profile [--model smollm2|code-5m] [--draft-lengths 1 3 7] [--context 128] [--reps 10]
                                       [--q8-activations]

Each program (one decode step, one verify of D + 1 tokens, one draft of D tokens, as `bench.step_costs.
step_functions` builds them: donated caches, rolled back after each step) runs `reps` times under `jax.profiler`;
XLA:CPU's thunk runtime records one event per executed HLO instruction (fusion, custom call, copy, ...). Each
instruction is put in a group from the compiled HLO: the CPU kernel's custom calls by their weight's shape (the
model's projections, its MLP, its LM head), every other instruction by the innermost Python function that emitted it
(`FUNCTION_GROUPS`). Per group: milliseconds per step (thunk time; XLA may run independent thunks side by side, so
groups can add up to more than the step's wall time, which is printed apart: a call of the program, and a step when
16 run in one program, the launch of ~1 ms a call spread over them as in generate's loop), megabytes read and written (the
instruction's operands and result), GFLOP (matrix products only) and the number of copies. Containers (while loops,
conditionals, calls) are not counted themselves: their bodies are.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import math
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.flags import add_product_flags
from dflash_jax.bench.matmul import time_call
from dflash_jax.bench.step_costs import STEPS_PER_PROGRAM, interleaved_ms, step_functions
from dflash_jax.io.shipped import load_default
from dflash_jax.params import param_bytes
from dflash_jax.quant.products import products_scope

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1,
               "s64": 8, "u64": 8, "f64": 8, "s16": 2, "u16": 2}
CONTAINERS = ("while", "conditional", "call")
# innermost Python function of an instruction -> its group (first match of a prefix wins)
FUNCTION_GROUPS = (
    ("attention", ("attention", "attention_rows", "_attend", "_key_blocks", "_partial", "_merge", "_empty", "visible",
                   "cached_valid", "fresh_valid", "blocks", "one")),  # attention_rows: the kernel's (the CPU loops)
    ("cache writes", ("write_kv", "write_rows", "append_context", "empty_draft_cache")),
    ("norms", ("rms_norm", "norm", "_qk_norm")),
    ("rope", ("rope", "rope_inv_freq")),
    ("embedding", ("embedding_rows", "take_rows", "_values", "_codes", "embed_block")),
    ("acceptance", ("accept_block", "_commit", "commit_states", "_accept", "greedy_accept")),
    ("sampling", ("sample_tokens", "_sample", "argmax")),
    ("feature taps", ("forward_hidden",)),
)


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    out_bytes: int
    operands: list[str]
    function: str
    line: str
    text: str
    stack: tuple[str, ...] = ()  # the Python functions that emitted it, innermost first


def _shape_bytes(shape: str) -> int:
    total = 0
    for dt, dims in re.findall(r"\b(\w+)\[([\d,]*)\]", shape):
        if dt in DTYPE_BYTES:
            total += DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _section(text: str, name: str) -> dict[int, str]:
    m = re.search(rf"^{name}\n((?:\d+ .*\n)+)", text, re.M)
    return {} if m is None else {int(l.split(" ", 1)[0]): l.split(" ", 1)[1] for l in m.group(1).splitlines()}


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of a compiled module's text: result bytes, operands, and the function that emitted it."""
    funcs = {k: v.strip('"') for k, v in _section(text, "FunctionNames").items()}
    locs = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in _section(text, "FileLocations").items()}
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in _section(text, "StackFrames").items()}
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(,|$)", line)
        if not m:
            continue
        name, shape, opcode, ops = m.group(1), m.group(2), m.group(3), m.group(4)
        where, stack = "", []
        f = re.search(r"stack_frame_id=(\d+)", line)
        frame = int(f.group(1)) if f else -1
        while frame in frames and len(stack) < 64:  # a frame's parent_frame_id is its parent's id + 1 (0: none)
            loc = locs.get(int(frames[frame]["file_location_id"]), {})
            if not stack:
                where = loc.get("line", "")  # the innermost frame's line
            stack.append(funcs.get(int(loc.get("function_name_id", 0)), ""))
            frame = int(frames[frame]["parent_frame_id"]) - 1
        fn = stack[0] if stack else ""
        out[name] = Instruction(name, opcode, _shape_bytes(shape), re.findall(r"%([\w.\-]+)", ops), fn, where, line,
                                tuple(stack))
    return out


def _dims(text: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([\d,]*)\}}", text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(instr: Instruction, hlo: dict[str, Instruction], computations: dict[str, list[str]]) -> float:
    """2 * output elements * contracted size for a dot (or a fusion whose computation holds one)."""
    texts = [instr.text]
    called = re.search(r"calls=%([\w.\-]+)", instr.text)
    if called:
        texts = [hlo[n].text for n in computations.get(called.group(1), []) if n in hlo]
    total = 0.0
    for t in texts:
        if " dot(" not in t:
            continue
        out_shape = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]", t)
        lhs = re.search(r"dot\(%([\w.\-]+)", t)
        if not (out_shape and lhs and lhs.group(1) in hlo):
            continue
        lhs_dims = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]", hlo[lhs.group(1)].text)
        if not lhs_dims:
            continue
        ld = [int(d) for d in lhs_dims.group(1).split(",") if d]
        contracted = math.prod(ld[i] for i in _dims(t, "lhs_contracting_dims"))
        total += 2.0 * math.prod(int(d) for d in out_shape.group(1).split(",") if d) * contracted
    return total


def _computations(text: str) -> dict[str, list[str]]:
    """computation name -> its instruction names."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        i = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if i and current is not None:
            current.append(i.group(1))
    return out


def kernel_rows(text: str) -> list[int]:
    """The output rows of each weight of one kernel call (its `n_rows` attribute: `dense<[576, 192, 192]>`, or one
    value `dense<1536> : tensor<2xi64>` that every weight shares)."""
    m = re.search(r"n_rows = dense<\[?([\d, ]+)\]?>(?: : tensor<(\d+)xi64>)?", text)
    if m is None:
        return []
    values = [int(v) for v in m.group(1).split(",")]
    count = int(m.group(2)) if m.group(2) else len(values)
    return values * count if len(values) == 1 else values


def kernel_group(instr: Instruction, hlo: dict[str, Instruction], cfg) -> str:
    """A CPU-kernel matmul's group, from its weights' shapes: [N_i, K] with N_i = n_rows (q / k / v or gate / up
    share one call)."""
    ns = kernel_rows(instr.text)
    k_match = re.search(r"operand_layout_constraints=\{\w+\[([\d,]+)\]", instr.text)
    N = sum(ns)
    K = int(k_match.group(1).split(",")[-1]) if k_match else 0
    if cfg is None:
        return "matmuls"
    H, I = cfg.hidden_size, cfg.intermediate_size
    if K == H and len(ns) == 1 and N > max(I, 4 * H):
        return "LM head"
    if K == I or (I in ns and K == H):
        return "MLP matmuls"
    return "attention projections"


def group_of(instr: Instruction, hlo, computations, cfg) -> str:
    if instr.opcode == "custom-call" and "dflash_block_matmul" in instr.text:
        return kernel_group(instr, hlo, cfg)
    if instr.opcode == "copy":
        return "copies"
    if instr.opcode in ("dot",) or (instr.opcode == "fusion" and _dot_flops(instr, hlo, computations) > 0):
        if instr.function in ("linear", "_dot", "dequant_matmul", "lm_logits"):
            return "matmuls (XLA)"
        if instr.function in ("_partial",) or "bkgtc" in instr.text or "bckd" in instr.text:
            return "attention"
    for group, names in FUNCTION_GROUPS:
        if instr.function in names:
            return group
    return "other"


def trace_program(run, reps: int, module: str = "") -> list[tuple[str, float]]:
    """(HLO instruction name, microseconds) of every thunk executed by `reps` calls of run() (of the compiled modules
    whose name holds `module`)."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(reps):
            run()
        jax.profiler.stop_trace()
        f = glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]
        events = json.load(gzip.open(f))["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        op = (e.get("args") or {}).get("hlo_op")
        if op and module in (e.get("args") or {}).get("hlo_module", ""):
            out.append((op, float(e["dur"])))
    return out


def profile_table(events, hlo_text: str, steps: int, cfg, group=None) -> dict[str, dict]:
    """{group: ms, MB, GFLOP, copies per step} of the events; group(instr, hlo, computations, cfg) -> its name
    (default `group_of`)."""
    group = group or group_of
    hlo, comps = parse_hlo(hlo_text), _computations(hlo_text)
    rows = collections.defaultdict(lambda: {"ms": 0.0, "mb": 0.0, "gflop": 0.0, "copies": 0, "count": 0})
    for op, us in events:
        instr = hlo.get(op)
        if instr is None or instr.opcode in CONTAINERS:
            continue
        g = group(instr, hlo, comps, cfg)
        r = rows[g]
        r["ms"] += us / 1e3 / steps
        r["count"] += 1 / steps
        r["mb"] += (instr.out_bytes + sum(hlo[o].out_bytes for o in instr.operands if o in hlo)) / 1e6 / steps
        if instr.opcode == "custom-call" and "dflash_block_matmul" in instr.text:
            n = sum(kernel_rows(instr.text))
            xs = re.search(r"operand_layout_constraints=\{\w+\[([\d,]+)\]", instr.text).group(1).split(",")
            r["gflop"] += 2.0 * math.prod(int(d) for d in xs) * n / 1e9 / steps
        else:
            r["gflop"] += _dot_flops(instr, hlo, comps) / 1e9 / steps
        r["copies"] += (instr.opcode == "copy") / steps
    return dict(rows)


def profile_steps(target, drafter, *, draft_lengths=(1, 3, 7), context_len: int = 128, reps: int = 10) -> dict:
    """{program: {"wall_ms": median, "step_ms": median, "groups": {group: {...}}}} for decode, verify (each D) and
    draft (each D): wall_ms a call of the program (its launch included), step_ms a step when `STEPS_PER_PROGRAM` run
    in one program (`step_costs.repeated`: the launch spread over them, as generate's loop runs steps)."""
    out = {}
    for D in draft_lengths:
        fns = step_functions(target, drafter, context_len=context_len, draft_length=D)
        fns.pop("_meta")
        in_one = step_functions(target, drafter, context_len=context_len, draft_length=D, repeat=STEPS_PER_PROGRAM)
        in_one.pop("_meta")
        names = {"verify_ms": f"verify D={D}", "draft_ms": f"draft D={D}"}
        if D == draft_lengths[0]:
            names = {"decode_ms": "decode", **names}
        for key, label in names.items():
            step, state = fns[key]
            box = {"state": state}

            def run():
                box["state"] = jax.block_until_ready(step(box["state"]))

            for _ in range(3):
                run()
            walls = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run()
                walls.append(time.perf_counter() - t0)
            lowered = step.compiled_text(box["state"])
            events = trace_program(run, reps)
            out[label] = {"wall_ms": 1e3 * statistics.median(walls),
                          "step_ms": interleaved_ms({key: in_one.pop(key)}, reps)[key],
                          "groups": profile_table(events, lowered, reps, target.config)}
    return out


STREAM_MB = 256.0  # the streaming probe's array: far past this CPU's 32 MB L3


def weight_megabytes(target) -> float:
    """MB a decode step reads of the target's weights: every parameter (GGML blocks or dense), the tied embedding
    once as the LM head (its lookup reads one row); norms are noise."""
    return param_bytes(target.params) / 1e6


def stream_gbps(megabytes: float = STREAM_MB, reps: int = 10) -> float:
    """GB/s at which XLA streams a float32 array much larger than the caches through one sum, all cores (median)."""
    x = jnp.ones((int(megabytes * 1e6 / 4),), jnp.float32)
    ms = statistics.median(time_call(jax.jit(jnp.sum), (x,), reps, warmup=1))
    return x.nbytes / ms / 1e6


def bandwidth_line(decode_ms: float, weights_mb: float, gbps: float, megabytes: float = STREAM_MB,
                   call_ms: float | None = None) -> str:
    """The decode step (ms, as the loop runs it) against its weights' bytes at the measured streaming rate;
    call_ms: the same step as a program call of its own (its launch included), printed beside it."""
    floor_ms = weights_mb / gbps
    call = "" if call_ms is None else f" ({call_ms:.2f} ms as a call of its own: {call_ms / floor_ms:.2f}x)"
    return (f"decode {decode_ms:.2f} ms a step in one program vs its {weights_mb:.1f} MB of weights at this run's "
            f"streaming rate ({gbps:.1f} GB/s, a float32 sum over {megabytes:.0f} MB) = {floor_ms:.2f} ms: "
            f"{decode_ms / floor_ms:.2f}x (goal <= 1.3x){call}")


def format_table(profile: dict) -> str:
    lines = []
    for label, p in profile.items():
        groups = p["groups"]
        total = sum(g["ms"] for g in groups.values())
        lines.append(f"\n{label}: {p['wall_ms']:.2f} ms a call (wall, median; {p['step_ms']:.2f} ms a step with "
                     f"{STEPS_PER_PROGRAM} in one program); thunks {total:.2f} ms")
        lines.append(f"| group | ms | share | MB read+written | GFLOP | copies |")
        lines.append("|---|---|---|---|---|---|")
        for g, r in sorted(groups.items(), key=lambda kv: -kv[1]["ms"]):
            lines.append(f"| {g} | {r['ms']:.2f} | {100 * r['ms'] / total:.0f}% | {r['mb']:.1f} | {r['gflop']:.3f} | "
                         f"{r['copies']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.profile", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a shipped model (default: the default model)")
    ap.add_argument("--draft-lengths", type=int, nargs="+", default=None,
                    help="D of the verify and draft programs (default: 1, 3 and block size - 1)")
    ap.add_argument("--context", type=int, default=128, help="live tokens in the caches")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    add_product_flags(ap)
    args = ap.parse_args(argv)
    with products_scope(args):
        target, drafter, _ = load_default(model=args.model)
        bs = drafter.config.block_size
        Ds = tuple(args.draft_lengths or sorted({1, min(3, bs - 1), bs - 1}))
        prof = profile_steps(target, drafter, draft_lengths=Ds, context_len=args.context, reps=args.reps)
    print(format_table(prof))
    bandwidth = {}
    if "decode" in prof:
        bandwidth = {"weights_mb": weight_megabytes(target), "stream_gbps": stream_gbps()}
        print("\n" + bandwidth_line(prof["decode"]["step_ms"], bandwidth["weights_mb"], bandwidth["stream_gbps"],
                                     call_ms=prof["decode"]["wall_ms"]))
    if args.json:
        args.json.write_text(json.dumps({**prof, **({"bandwidth": bandwidth} if bandwidth else {})}, indent=1))
    return prof


if __name__ == "__main__":
    main()
