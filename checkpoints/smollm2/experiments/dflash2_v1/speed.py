"""DFlash2 (leg 2) against the shipped DFlash drafter on the same held-out requests: greedy, 128 tokens, batch 1,
generate's decode tokens/s over plain decoding's, alternating, medians; each setting's tau."""
import statistics, sys
import dflash_jax as dj
from dflash_jax.io.shipped import load_default
from dflash_jax.train.drafter_data import chat_prompt_ids
target, dflash, tok = load_default()
d2 = dj.load_drafter(sys.argv[1], param_dtype="bfloat16")
prompts = chat_prompt_ids(tok, 8, split="eval", seed=1)
kw = dict(max_new_tokens=128, eos_ids=(tok.eos_id,), prefill_timing="rerun")
settings = [("DFlash default", dflash, {}), ("DFlash D1 lookup 2", dflash, dict(draft_length=1, context_lookup=2)),
            ("DFlash D3 lookup 2", dflash, dict(draft_length=3, context_lookup=2)),
            ("DFlash D3", dflash, dict(draft_length=3, context_lookup=0)),
            ("DFlash2 D1", d2, dict(draft_length=1)), ("DFlash2 D2", d2, dict(draft_length=2)),
            ("DFlash2 D3", d2, dict(draft_length=3)), ("DFlash2 D7", d2, dict(draft_length=7))]
for name, dr, opt in settings:
    ratios, taus, same = [], [], 0
    for p in prompts:
        ar = dj.generate_autoregressive(target, [p], **kw); sp = dj.generate(target, dr, [p], **kw, **opt)
        ar = dj.generate_autoregressive(target, [p], **kw); sp = dj.generate(target, dr, [p], **kw, **opt)
        ratios.append(sp.decode_tokens_per_second / ar.decode_tokens_per_second); taus.append(sp.tau)
        same += sp.token_lists() == ar.token_lists()
    print(f"{name:>20}: tau {statistics.mean(taus):.3f}  speedup median {statistics.median(ratios):.2f}x  "
          f"identical {same}/{len(prompts)}", flush=True)
