# The loop programs compiled with and without XLA:CPU's concurrency-optimized scheduler, timed in turns.
import statistics, sys
import dflash_jax as dj
from dflash_jax.decode import programs as P
from dflash_jax.decode.loop import speculative_loop, autoregressive_loop
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 4, split="eval", seed=1)
opts = {"default": None, "no-concurrency-sched": {"xla_cpu_enable_concurrency_optimized_scheduler": False}}
calls = {}
for v, o in opts.items():
    P._COMPILED.clear()
    P._COMPILED["speculative"] = P._jit_program("speculative", speculative_loop, P.SPECULATIVE_STATIC, (2,), o)
    P._COMPILED["autoregressive"] = P._jit_program("autoregressive", autoregressive_loop, P.AUTOREGRESSIVE_STATIC,
                                                   (2,), o)
    for i, p in enumerate(ids):
        for kind in ("ar", "sp"):
            c = (P.autoregressive_call(target, [p], max_new_tokens=256) if kind == "ar" else
                 P.speculative_call(target, drafter, [p], max_new_tokens=256))
            c.run()
            calls[(v, i, kind)] = c
tps = {(v, k): [] for v in opts for k in ("ar", "sp")}
for rep in range(3):
    for i in range(len(ids)):
        for v in opts:
            for k in ("ar", "sp"):
                r = calls[(v, i, k)].run()
                tps[(v, k)].append(r.decode_tokens_per_second)
for v in opts:
    a, s = statistics.median(tps[(v, "ar")]), statistics.median(tps[(v, "sp")])
    print(f"{v:22s} AR {a:6.1f} tok/s  spec {s:6.1f} tok/s  {s / a:.2f}x", flush=True)
