# tau on requests that quote code (answers repeat the prompt): trees of 2 / 4, lookup off / on. With
# `import dflash_jax.decode.programs as P; P.PROMPT_WINDOW = 0` before loading, the search reads the output alone.
import numpy as np, dflash_jax as dj
target, drafter, tok = dj.load_default()
CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result
'''
asks = ["Add type hints and a docstring to this Python function:\n\n" + CODE,
        "Rename the variable `chunk` to `segment` in this Python function:\n\n" + CODE,
        "Rewrite this Python function so that it raises ValueError when window is not positive:\n\n" + CODE]
from dflash_jax.train import instructions
ids = instructions.chat_prompts(tok, asks)
print([len(i) for i in ids])
ar = dj.generate_autoregressive(target, ids, max_new_tokens=200, eos_ids=(tok.eos_id,))
for N in (2, 4):
    for cl in (0, 2):
        r = dj.generate(target, drafter, ids, max_new_tokens=200, tree_budget=N, context_lookup=cl, eos_ids=(tok.eos_id,))
        print(f"tree {N} lookup {cl}: tau {r.tau:.3f} identical {np.array_equal(r.tokens, ar.tokens)}", flush=True)
print(repr(tok.decode(ar.token_lists()[0][:120])))
