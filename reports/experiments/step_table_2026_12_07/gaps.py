# Where the speculative loop's main thread waits (by the thunk it waits for) and what other threads run.
import collections, glob, gzip, json, re, tempfile
import jax, dflash_jax as dj
from dflash_jax.decode.programs import speculative_call
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.bench.profile import parse_hlo
target, drafter, tok = dj.load_default()
p = chat_prompt_ids(tok, 1, split="eval", seed=1)[0]
call = speculative_call(target, drafter, [p], max_new_tokens=128)
res = call.run(); res = call.run()
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hlo = parse_hlo(call.lower()[1].compile().as_text())
with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    res = call.run()
    jax.profiler.stop_trace()
    ev = json.load(gzip.open(glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]))["traceEvents"]
loop = [e for e in ev if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_op")
        and "dflash_speculative" in (e.get("args") or {}).get("hlo_module", "")]
tids = collections.Counter(e["tid"] for e in loop)
print("threads", tids)
main_tid = tids.most_common(1)[0][0]
main = sorted((e for e in loop if e["tid"] == main_tid), key=lambda e: e["ts"])
gap_by = collections.Counter(); cnt = collections.Counter()
for a, b in zip(main, main[1:]):
    g = b["ts"] - (a["ts"] + a["dur"])
    op = b["args"]["hlo_op"]
    ins = hlo.get(op)
    key = (ins.opcode if ins else "?") + " " + ("/".join(s for s in (ins.stack[:3] if ins else ())))
    gap_by[key] += g; cnt[key] += 1
steps = res.num_steps
for k, v in gap_by.most_common(15):
    print(f"{v / steps:8.1f} us/step  n/step {cnt[k] / steps:5.1f}  {k}")
others = [e for e in loop if e["tid"] != main_tid]
oc = collections.Counter()
for e in others:
    ins = hlo.get(e["args"]["hlo_op"])
    oc[(ins.opcode if ins else "?") + " " + "/".join(ins.stack[:3] if ins else ())] += e["dur"]
print("other threads' thunks:")
for k, v in oc.most_common(10):
    print(f"{v / steps:8.1f} us/step {k}")
