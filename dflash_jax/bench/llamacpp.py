"""This project's decoding against llama.cpp on the same GGUF, the same prompts and the same threads.

    python -m dflash_jax.bench.llamacpp [--prompts 4] [--new-tokens 128] [--threads 2] [--llama-python PATH]

llama.cpp comes from `llama-cpp-python` (built from source by pip: `pip install llama-cpp-python`), imported here when
it is installed in this environment, else run by another interpreter that has it (`--llama-python`, e.g. a separate
virtual environment, so that its build never touches this package's). It decodes greedily (temperature 0) from the
same token ids with `n_threads` threads; its tokens/s counts the new tokens after the first over the time from the
first new token to the last (prompt evaluation excluded), as `GenerationResult.decode_tokens_per_second` does. One
run prints both tools' medians over the prompts and the ratios; llama.cpp quantizes activations to 8 bits where this
project keeps them float32, so the texts may part after a while (the agreement of the first tokens is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from dflash_jax.bench.flags import add_product_flags
from dflash_jax.decode.programs import generate, generate_autoregressive
from dflash_jax.io import shipped
from dflash_jax.quant.products import generation_products, products_scope
from dflash_jax.train.drafter_data import chat_prompt_ids

# run in the llama.cpp interpreter: argv = [gguf, threads, new tokens, json prompts]; prints one JSON line
_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, new, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False, seed=0)
out = []
for ids in prompts:
    llm.reset()
    toks, times = [], []
    for t in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        toks.append(int(t))
        if len(toks) >= new or t == llm.token_eos():
            break
    rate = (len(toks) - 1) / (times[-1] - times[0]) if len(toks) > 1 else float("nan")
    out.append({"tokens": toks, "tokens_per_s": rate})
print(json.dumps({"version": __import__("llama_cpp").__version__, "rows": out}))
"""


def run_llama_cpp(gguf: str, prompts: list[list[int]], *, new_tokens: int, threads: int,
                  python: str | None = None) -> dict:
    """{"version", "rows": [{"tokens", "tokens_per_s"}]} from llama.cpp, in this interpreter or `python`."""
    exe = python or sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run([exe, "-c", _CHILD, gguf, str(threads), str(new_tokens), json.dumps(prompts)],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"llama.cpp run failed (interpreter {exe}; is llama-cpp-python installed there?):\n"
                           f"{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare(*, prompts: int = 4, new_tokens: int = 128, threads: int = 2, llama_python: str | None = None,
            draft_length: int | None = None, seed: int = 0) -> dict:
    """Greedy tokens/s of llama.cpp, this project's autoregressive decoding and its speculative decoding (the default
    pair), on the same held-out chat requests, each tool warmed up on the first prompt first."""
    target, drafter, tok = shipped.load_default(model="smollm2")  # the model whose GGUF llama.cpp reads
    ids = chat_prompt_ids(tok, prompts, split="eval", seed=1 + seed)
    eos = (tok.eos_id,)
    gguf = str(shipped.smollm2_path())
    llama = run_llama_cpp(gguf, [ids[0]] + ids, new_tokens=new_tokens, threads=threads, python=llama_python)
    llama_rows = llama["rows"][1:]  # the first run warms llama.cpp up
    ours_ar, ours_sp = [], []
    for i, p in enumerate([ids[0]] + ids):
        ar = generate_autoregressive(target, [p], max_new_tokens=new_tokens, eos_ids=eos, prefill_timing="rerun")
        sp = generate(target, drafter, [p], max_new_tokens=new_tokens, draft_length=draft_length, eos_ids=eos,
                         prefill_timing="rerun")
        if i:
            assert ar.token_lists() == sp.token_lists(), "speculative output differs from autoregressive"
            ours_ar.append(ar)
            ours_sp.append(sp)
    agree = []
    for row, ar in zip(llama_rows, ours_ar):
        a, b = row["tokens"], ar.token_lists()[0]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree.append(n)
    med = statistics.median
    out = {"llama_cpp_version": llama["version"], "threads": threads, "prompts": prompts, "new_tokens": new_tokens,
           "llama_cpp_tokens_per_s": med(r["tokens_per_s"] for r in llama_rows),
           "ar_tokens_per_s": med(r.decode_tokens_per_second for r in ours_ar),
           "speculative_tokens_per_s": med(r.decode_tokens_per_second for r in ours_sp),
           "tau": med(r.tau for r in ours_sp), "draft_length": ours_sp[0].draft_length,
           "tree_budget": ours_sp[0].tree_budget,
           "first_tokens_identical_with_llama_cpp": agree,
           "products": generation_products()}
    out["ar_vs_llama_cpp"] = out["ar_tokens_per_s"] / out["llama_cpp_tokens_per_s"]
    out["speculative_vs_llama_cpp"] = out["speculative_tokens_per_s"] / out["llama_cpp_tokens_per_s"]
    out["speculative_vs_ar"] = out["speculative_tokens_per_s"] / out["ar_tokens_per_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.bench.llamacpp", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--draft-length", type=int, default=None)
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python (default: this one)")
    add_product_flags(ap)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with products_scope(args):
        r = compare(prompts=args.prompts, new_tokens=args.new_tokens, threads=args.threads,
                    llama_python=args.llama_python, draft_length=args.draft_length)
    layout = (f"speculative tree of {r['tree_budget']}" if r["tree_budget"] else
              f"speculative D {r['draft_length']}" if r["draft_length"] else
              "generate (decoding plainly: the step table predicts no speedup here)")
    print(f"llama.cpp {r['llama_cpp_version']} ({r['threads']} threads): {r['llama_cpp_tokens_per_s']:.1f} tok/s | "
          f"dflash-jax ({r['products']} products) "
          f"autoregressive: "
          f"{r['ar_tokens_per_s']:.1f} tok/s ({r['ar_vs_llama_cpp']:.2f}x) | "
          f"{layout}: {r['speculative_tokens_per_s']:.1f} tok/s ({r['speculative_vs_llama_cpp']:.2f}x of "
          f"llama.cpp, {r['speculative_vs_ar']:.2f}x of autoregressive, tau {r['tau']:.2f}); medians over "
          f"{r['prompts']} prompts x {r['new_tokens']} tokens; greedy tokens identical to llama.cpp's for the first "
          f"{r['first_tokens_identical_with_llama_cpp']} ({time.perf_counter() - t0:.0f} s)")
    return r


if __name__ == "__main__":
    main()
