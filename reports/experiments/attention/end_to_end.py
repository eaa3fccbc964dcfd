import sys, json, hashlib, statistics, dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, 2, split="eval", seed=1)
out = {}
for n in (256, 1024):
    kw = dict(max_new_tokens=n, eos_ids=(), prefill_timing="rerun")
    ar = [dj.generate_autoregressive(target, [p], **kw) for p in ids]
    sp = [dj.generate(target, drafter, [p], tree_budget=2, plain_when_slower=False, **kw) for p in ids]
    same = all(a.token_lists() == s.token_lists() for a, s in zip(ar, sp))
    h = hashlib.sha1(str([a.token_lists() for a in ar]).encode()).hexdigest()[:8]
    out[n] = dict(ar=[round(r.decode_tokens_per_second, 1) for r in ar], sp=[round(r.decode_tokens_per_second, 1) for r in sp],
                  tau=[round(float(r.tau), 3) if hasattr(r, 'tau') else None for r in sp], same=same, hash=h)
print(sys.argv[1], json.dumps(out))
