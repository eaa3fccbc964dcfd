# One process's share of a two-tree A/B: AR and generate's default (+ chains of 1, 3 and 7 with lookup), greedy,
# held-out requests x 128 tokens; prints one JSON line of decode tok/s per setting and request, and the tokens' hash.
# AB_TOKENS sets the length, AB_SETTINGS a comma list of the settings to run (e.g. AR,default), AB_TEMPERATURE the
# temperature (default 0; above it "same" compares nothing: sampled tokens differ from AR's).
import hashlib, json, os, sys
sys.path.insert(0, os.getcwd())
import numpy as np
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
target, drafter, tok = dj.load_default()
ids = chat_prompt_ids(tok, n, split="eval", seed=1)
base = dict(max_new_tokens=int(os.environ.get("AB_TOKENS", "128")), prefill_timing="rerun",
            temperature=float(os.environ.get("AB_TEMPERATURE", "0")))
settings = {"AR": None, "default": {}, "D1": dict(draft_length=1, context_lookup=2, draft_pass="drafted"),
            "D3": dict(draft_length=3, context_lookup=2, draft_pass="drafted"),
            "D7": dict(draft_length=7, context_lookup=2, draft_pass="drafted")}
if os.environ.get("AB_SETTINGS"):
    settings = {k: settings[k] for k in os.environ["AB_SETTINGS"].split(",")}
def run(s, p):
    return dj.generate_autoregressive(target, [p], **base) if s is None else dj.generate(target, drafter, [p], **s, **base)
for s in settings.values(): run(s, ids[0])
out = {k: [] for k in settings}; h = hashlib.sha256(); same = True
for p in ids:
    ar_tokens = None
    for k, s in settings.items():
        r = run(s, p); out[k].append(r.decode_tokens_per_second)
        t = np.asarray(r.tokens).tolist()
        if ar_tokens is None: ar_tokens = t; h.update(json.dumps(t).encode())
        same = same and (t == ar_tokens or base["temperature"] > 0)
print("RESULT", json.dumps(dict(tps=out, hash=h.hexdigest()[:16], same=same)))
