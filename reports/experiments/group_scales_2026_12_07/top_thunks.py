# The spec loop's and AR loop's most expensive thunks (non-matmul, non-attention), per step: name, group, us, MB.
# python top_thunks.py N [TEMPERATURE]: the N most expensive, at that temperature (default 0: greedy).
import collections, sys, warnings
from dflash_jax.bench.loop_profile import loop_group
from dflash_jax.bench.profile import parse_hlo, _computations, trace_program, CONTAINERS
from dflash_jax.decode.call import PROGRAM_PREFIX
from dflash_jax.decode.programs import autoregressive_call, speculative_call
from dflash_jax.io.shipped import load_default
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = load_default()
p = chat_prompt_ids(tok, 1, split="eval", seed=1)[0]
kw = dict(max_new_tokens=128, temperature=float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
for name, call in (("speculative", speculative_call(target, drafter, [p], plain_when_slower=False, **kw)),
                   ("autoregressive", autoregressive_call(target, [p], **kw))):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = call.lower()[1].compile().as_text()
    res = call.run()
    events = trace_program(call.run, 3, module=f"{PROGRAM_PREFIX}{name}")
    hlo, comps = parse_hlo(text), _computations(text)
    n = 3 * res.num_steps
    rows = collections.defaultdict(lambda: [0.0, 0, 0.0, "", ""])
    for op, us in events:
        ins = hlo.get(op)
        if ins is None or ins.opcode in CONTAINERS: continue
        g = loop_group(ins, hlo, comps, target.config)
        r = rows[op]; r[0] += us / n; r[1] += 1; r[2] = (ins.out_bytes + sum(hlo[o].out_bytes for o in ins.operands if o in hlo)) / 1e6
        r[3] = g; r[4] = f"{ins.opcode} {ins.function} <- {'/'.join(ins.stack[:4])}"
    tot = sum(r[0] for r in rows.values())
    print(f"\n{name}: {tot:.0f} us per step, {len(rows)} distinct thunks, {sum(r[1] for r in rows.values()) / n:.0f} thunk runs per step")
    skip = ("MLP matmuls", "attention projections", "LM head", "draft: MLP matmuls", "draft: attention projections", "draft: LM head")
    shown = 0
    for op, r in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if r[3] in skip: continue
        shown += 1
        if shown > int(sys.argv[1]): break
        print(f"{r[0]:7.1f} us  x{r[1] / n:5.1f}  {r[2]:8.3f} MB  {r[3]:28s} {op[:40]:40s} {r[4][:110]}")
