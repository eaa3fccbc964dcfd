import numpy as np, jax, jax.numpy as jnp, dflash_jax as dj
from dflash_jax.quant.linear import bf16_products_scope, q8_activations_scope
from dflash_jax.train.drafter_data import chat_prompt_ids
target, drafter, tok = dj.load_default()
ids = np.asarray([chat_prompt_ids(tok, 1, split="eval", seed=1)[0][:48]], np.int32)
base = np.asarray(dj.target_forward(target, ids)[0])
for name, scope in (("bf16", bf16_products_scope), ("q8", q8_activations_scope)):
    with scope(True):
        x = np.asarray(dj.target_forward(target, ids)[0])
    rel = np.abs(x - base).max() / np.abs(base).max()
    same = np.mean(x.argmax(-1) == base.argmax(-1))
    print(f"{name}: max |logit diff| / max |logit| = {rel:.4f}, argmax agreement {same:.3f} over {ids.shape[1]} positions")
