# Offline (~10 min on 2 cores): greedy answers to the 8 held-out requests (256 tokens), and at every anchor t the
# drafter's top-4 tokens and log-probabilities per block position (teacher-forced context features), to drafts.json.
import sys, numpy as np, jax, jax.numpy as jnp, json
import dflash_jax as dj
from dflash_jax.train.drafter_data import chat_prompt_ids
from dflash_jax.models.target import forward_with_cache
from dflash_jax.io.shipped import load_default
target, drafter, tok = load_default()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
ids = chat_prompt_ids(tok, n, split="eval", seed=1)
ar = dj.generate_autoregressive(target, ids, max_new_tokens=256)
taps = tuple(drafter.config.target_layer_ids)
fwd = jax.jit(lambda t, x: forward_with_cache(t, x, None, taps)[1])
mask = drafter.config.mask_token_id
out = []
for r, p in enumerate(ids):
    ans = [int(x) for x in np.asarray(ar.tokens[r])[: int(ar.num_tokens[r])]]
    seq = list(p) + ans
    feats = fwd(target, jnp.asarray([seq], jnp.int32))
    P = len(p)
    rows = []
    for t in range(P, len(seq) - 1):
        block = jnp.asarray([[seq[t]] + [mask] * 7], jnp.int32)
        lg = dj.draft_logits(target, drafter, feats[:, :t], block)[0]
        lp = jax.nn.log_softmax(lg[:, :(drafter.config.draft_vocab_size or lg.shape[-1])], axis=-1)
        v, i = jax.lax.top_k(lp, 4)
        rows.append([np.asarray(i).tolist(), np.round(np.asarray(v), 4).tolist()])
    out.append({"P": P, "seq": seq, "draft": rows})
    print(r, P, len(seq), flush=True)
json.dump(out, open("drafts.json", "w"))
