"""Drafter data from existing text instead of generated answers: the target's own greedy predictions over text.

The text is a coding request made from a function of the corpus's TRAIN split (the same templates as
`train.instructions`) through the chat template, answered by that function's own source in a code block. One
batched prefill of the frozen target over each sequence gives the tapped features and the argmax prediction at
every position; the loss then uses the predictions as labels (`drafter_loss.training_labels`), keeping slot k of an
anchor only where the text equals the predictions at the k-1 positions before it, so that every kept label is what
greedy decoding would produce from that anchor. A prefill is a few times cheaper per token than decoding, but a
label survives only as long as the text keeps agreeing with the target, so the deeper slots get few labels.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.target import Target, forward_with_cache
from dflash_jax.train import corpus, instructions


def function_sources(texts, n: int, seed: int) -> list[tuple[str, str, str]]:
    """(signature, first docstring sentence, source) of `n` public functions of `texts`, drawn with `seed`."""
    out = [(sig, what, src) for sig, what, text, node in instructions.documented_functions(texts)
           if (src := ast.get_source_segment(text, node))]
    rng = np.random.default_rng(seed)
    return [out[i] for i in rng.choice(len(out), size=min(n, len(out)), replace=False)]


def text_sequences(tok, n: int, *, seed: int, max_prompt_tokens: int, max_answer_tokens: int) -> list[tuple]:
    """(prompt ids, answer ids) pairs: a request through the chat template, the function's source as the answer
    (cut to max_answer_tokens, ended by the EOS when it fits); prompts longer than max_prompt_tokens are skipped."""
    train, _ = corpus.split_files(corpus.stdlib_files())
    rng = np.random.default_rng(seed + 1)
    pairs = []
    for sig, what, src in function_sources(corpus.read_texts(train), 2 * n, seed):
        template = instructions._CODE_TEMPLATES[rng.integers(len(instructions._CODE_TEMPLATES))]
        prompt = instructions.chat_prompts(tok, [template.format(sig=sig, what=what)])[0]
        if len(prompt) > max_prompt_tokens:
            continue
        answer = (tok.encode(f"```python\n{src}\n```") + [tok.eos_id])[:max_answer_tokens]
        pairs.append((prompt, answer))
        if len(pairs) == n:
            break
    return pairs


def predictions_over_text(target: Target, pairs, layer_ids, *, seq_len: int, batch: int = 8) -> dict:
    """Prefill the target over every pair: tokens [N, L], lengths, prompt_lens, features [N, L, K*H] float16,
    labels [N, L] (the argmax after each prefix: labels[p] predicts position p; labels[0] = tokens[0]) and agree
    [N, L] (tokens == labels)."""
    n = len(pairs)
    tokens = np.zeros((n, seq_len), np.int32)
    lengths = np.asarray([min(len(p) + len(a), seq_len) for p, a in pairs], np.int32)
    for i, (p, a) in enumerate(pairs):
        tokens[i, :lengths[i]] = (list(p) + list(a))[:seq_len]
    width = len(layer_ids) * target.config.hidden_size
    feats, labels = np.zeros((n, seq_len, width), np.float16), tokens.copy()
    fwd = jax.jit(lambda t, x: forward_with_cache(t, x, None, tuple(layer_ids))[:2])
    for i in range(0, n, batch):
        chunk = tokens[i:i + batch]
        pad = batch - len(chunk)
        logits, f = fwd(target, jnp.asarray(np.concatenate([chunk, np.zeros((pad, seq_len), np.int32)])))
        m = len(chunk)
        feats[i:i + m] = np.asarray(f[:m], np.float32).astype(np.float16)
        labels[i:i + m, 1:] = np.asarray(jnp.argmax(logits[:m, :-1], axis=-1))
    return {"tokens": tokens, "lengths": lengths, "prompt_lens": np.asarray([min(len(p), seq_len) for p, _ in pairs],
                                                                            np.int32),
            "features": feats, "labels": labels, "agree": tokens == labels}


def build_text_data(target: Target, tok, layer_ids, work: Path, *, n: int, seed: int, max_prompt_tokens: int,
                    max_answer_tokens: int) -> dict:
    """`predictions_over_text` for n requests, cached in `work` (text_<n>_<seed>.npz)."""
    path = Path(work) / f"text_{n}_{seed}_{max_prompt_tokens}_{max_answer_tokens}.npz"
    if path.exists():
        return dict(np.load(path))
    t0 = time.perf_counter()
    pairs = text_sequences(tok, n, seed=seed, max_prompt_tokens=max_prompt_tokens,
                           max_answer_tokens=max_answer_tokens)
    data = predictions_over_text(target, pairs, layer_ids, seq_len=max_prompt_tokens + max_answer_tokens)
    np.savez(path, **data)
    live = data["lengths"] - data["prompt_lens"]
    agree = sum(int(data["agree"][i, data["prompt_lens"][i]:data["lengths"][i]].sum()) for i in range(len(live)))
    print(f"text data: {len(pairs)} answers, {int(live.sum()):,} answer tokens, the target's prediction equals the "
          f"text at {agree / max(int(live.sum()), 1):.1%} of them, in {time.perf_counter() - t0:.0f}s", flush=True)
    return data


__all__ = ["function_sources", "text_sequences", "predictions_over_text", "build_text_data"]
