# Thunks per loop step and the main thread's waits, plain decoding vs generate's default (one held-out request, 128
# tokens); then, for the speculative loop, where the main thread waits (by the thunk it waits for) and what the other
# threads run. python reports/experiments/step_table_2026_12_07/thunks.py
import collections, glob, gzip, json, tempfile, warnings
import jax, dflash_jax as dj
from dflash_jax.bench.profile import parse_hlo
from dflash_jax.decode.programs import autoregressive_call, speculative_call
from dflash_jax.train.drafter_data import chat_prompt_ids


def key(ins):
    return (ins.opcode if ins else "?") + " " + "/".join(ins.stack[:3] if ins else ())


target, drafter, tok = dj.load_default()
p = chat_prompt_ids(tok, 1, split="eval", seed=1)[0]
for name, make in (("autoregressive", lambda: autoregressive_call(target, [p], max_new_tokens=128)),
                   ("speculative", lambda: speculative_call(target, drafter, [p], max_new_tokens=128))):
    call = make(); res = call.run(); res = call.run()
    walls = []
    for _ in range(3):
        res = call.run(); walls.append(res.timings["decode_s"])
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        res = call.run()
        jax.profiler.stop_trace()
        ev = json.load(gzip.open(glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]))["traceEvents"]
    loop = [e for e in ev if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_op")
            and f"dflash_{name}" in (e.get("args") or {}).get("hlo_module", "")]
    tids = collections.Counter(e["tid"] for e in loop)
    main_tid = tids.most_common(1)[0][0]
    main = sorted((e for e in loop if e["tid"] == main_tid), key=lambda e: e["ts"])
    span = (main[-1]["ts"] + main[-1]["dur"] - main[0]["ts"]) / 1e3
    busy = sum(e["dur"] for e in main) / 1e3
    steps = res.num_steps
    print(f"{name}: {steps} steps, unprofiled decode {1e3 * min(walls) / steps:.2f} ms/step; traced: "
          f"{len(loop) / steps:.0f} "
          f"thunks/step ({len(main) / steps:.0f} on the main thread of {len(tids)}), span {span / steps:.2f} ms/step, "
          f"busy {busy / steps:.2f} ms/step, gaps {(span - busy) / steps:.2f} ms/step "
          f"({1e3 * (span - busy) / max(len(main), 1):.2f} us per main-thread thunk)", flush=True)
    if name != "speculative":
        continue
    with warnings.catch_warnings():  # lowering again: JAX notes the loop's donated inputs once more
        warnings.simplefilter("ignore")
        hlo = parse_hlo(call.lower()[1].compile().as_text())
    gap_by, count = collections.Counter(), collections.Counter()
    for a, b in zip(main, main[1:]):
        k = key(hlo.get(b["args"]["hlo_op"]))
        gap_by[k] += b["ts"] - (a["ts"] + a["dur"])
        count[k] += 1
    for k, v in gap_by.most_common(15):
        print(f"{v / steps:8.1f} us/step  n/step {count[k] / steps:5.1f}  {k}")
    others = collections.Counter()
    for e in loop:
        if e["tid"] != main_tid:
            others[key(hlo.get(e["args"]["hlo_op"]))] += e["dur"]
    print("other threads' thunks:")
    for k, v in others.most_common(10):
        print(f"{v / steps:8.1f} us/step {k}")
