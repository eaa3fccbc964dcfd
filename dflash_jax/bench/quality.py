"""How good is a target as a language model of Python code: held-out loss and degenerate repetition.

seq-rep-n (Welleck et al. 2019, "Neural text generation with unlikelihood training") of a continuation is
1 - (distinct n-grams / all n-grams) over its tokens: 0 for text that never repeats an n-gram, close to 1 for a loop
such as `self._w, self._w, self._w, ...`. Hand-written code scores low (the solutions below: ~0.05); a target whose
greedy output loops inflates every acceptance figure, because a drafter predicts a loop easily.

The hand-written prompts are function headers with docstrings written for this project (not taken from any corpus
or benchmark data set), each with a hand-written solution, so that loss and repetition can be measured on code the
target has never seen.
"""

from __future__ import annotations

import statistics
from typing import Sequence

import numpy as np

from dflash_jax.train.repetition import continuation_repetition, seq_rep_n  # noqa: F401 (re-exported)
from dflash_jax.models.target import target_forward
from dflash_jax.train import corpus
from dflash_jax.train.target import heldout_loss_fn


# (prompt, hand-written body). Prompts end right after the docstring, as a user would start a function.
HANDWRITTEN: tuple[tuple[str, str], ...] = (
    ('def word_frequencies(text):\n    """Count how often each lower-cased word occurs in text."""\n',
     "    counts = {}\n    for word in text.lower().split():\n        word = word.strip('.,;:!?\"\\'()')\n"
     "        if word:\n            counts[word] = counts.get(word, 0) + 1\n    return counts\n"),
    ('def chunked(items, size):\n    """Split a list into consecutive chunks of at most size items."""\n',
     "    if size < 1:\n        raise ValueError('size must be positive')\n"
     "    return [items[i:i + size] for i in range(0, len(items), size)]\n"),
    ('def parse_key_values(line):\n    """Parse "a=1; b=two" into a dict of stripped strings."""\n',
     "    result = {}\n    for part in line.split(';'):\n        if not part.strip():\n            continue\n"
     "        key, sep, value = part.partition('=')\n        if not sep:\n"
     "            raise ValueError(f'missing = in {part!r}')\n        result[key.strip()] = value.strip()\n"
     "    return result\n"),
    ('def flatten(nested):\n    """Yield the leaves of arbitrarily nested lists and tuples, left to right."""\n',
     "    for item in nested:\n        if isinstance(item, (list, tuple)):\n            yield from flatten(item)\n"
     "        else:\n            yield item\n"),
    ('def binary_search(sorted_items, target):\n    """Return the index of target in sorted_items, or -1."""\n',
     "    lo, hi = 0, len(sorted_items) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
     "        if sorted_items[mid] == target:\n            return mid\n        if sorted_items[mid] < target:\n"
     "            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n"),
    ('def read_config(path):\n    """Read an INI-style file of "key = value" lines, skipping comments."""\n',
     "    settings = {}\n    with open(path, encoding='utf-8') as f:\n        for raw in f:\n"
     "            line = raw.strip()\n            if not line or line.startswith('#'):\n                continue\n"
     "            key, _, value = line.partition('=')\n            settings[key.strip()] = value.strip()\n"
     "    return settings\n"),
    ('class Stack:\n    """A last-in, first-out stack backed by a list."""\n\n    def __init__(self):\n',
     "        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n"
     "    def pop(self):\n        if not self._items:\n            raise IndexError('pop from an empty stack')\n"
     "        return self._items.pop()\n\n    def __len__(self):\n        return len(self._items)\n"),
    ('def merge_intervals(intervals):\n    """Merge overlapping (start, end) intervals and return them sorted."""\n',
     "    merged = []\n    for start, end in sorted(intervals):\n        if merged and start <= merged[-1][1]:\n"
     "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n        else:\n"
     "            merged.append((start, end))\n    return merged\n"),
    ('def is_palindrome(s):\n    """True when s reads the same backwards, ignoring case and non-letters."""\n',
     "    letters = [c.lower() for c in s if c.isalnum()]\n    return letters == letters[::-1]\n"),
    ('def moving_average(values, window):\n    """Averages of each run of window consecutive values."""\n',
     "    if window <= 0:\n        raise ValueError('window must be positive')\n    out = []\n    total = 0.0\n"
     "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
     "            total -= values[i - window]\n        if i >= window - 1:\n            out.append(total / window)\n"
     "    return out\n"),
    ('def group_by(items, key):\n    """Group items into a dict of lists by key(item), keeping their order."""\n',
     "    groups = {}\n    for item in items:\n        groups.setdefault(key(item), []).append(item)\n"
     "    return groups\n"),
    ('def format_duration(seconds):\n    """Format a number of seconds as "1h 02m 03s" (hours only when non-zero)."""\n',
     "    seconds = int(seconds)\n    hours, rest = divmod(seconds, 3600)\n    minutes, secs = divmod(rest, 60)\n"
     "    if hours:\n        return f'{hours}h {minutes:02d}m {secs:02d}s'\n    return f'{minutes}m {secs:02d}s'\n"),
    ('def topological_sort(graph):\n    """Order the nodes of a dict-of-lists DAG so that edges point forward."""\n',
     "    order, state = [], {}\n\n    def visit(node):\n        if state.get(node) == 'done':\n            return\n"
     "        if state.get(node) == 'active':\n            raise ValueError('graph has a cycle')\n"
     "        state[node] = 'active'\n        for nxt in graph.get(node, ()):\n            visit(nxt)\n"
     "        state[node] = 'done'\n        order.append(node)\n\n    for node in graph:\n        visit(node)\n"
     "    return order[::-1]\n"),
    ('def retry(func, attempts=3, exceptions=(Exception,)):\n    """Call func until it succeeds, at most attempts times."""\n',
     "    last = None\n    for _ in range(attempts):\n        try:\n            return func()\n"
     "        except exceptions as exc:\n            last = exc\n    raise last\n"),
    ('def camel_to_snake(name):\n    """Convert "parseHttpResponse" to "parse_http_response"."""\n',
     "    out = []\n    for i, ch in enumerate(name):\n        if ch.isupper() and i and not name[i - 1].isupper():\n"
     "            out.append('_')\n        out.append(ch.lower())\n    return ''.join(out)\n"),
    ('def unique_in_order(items):\n    """Drop repeated items, keeping the first occurrence of each."""\n',
     "    seen = set()\n    result = []\n    for item in items:\n        if item not in seen:\n"
     "            seen.add(item)\n            result.append(item)\n    return result\n"),
)


def handwritten_texts() -> list[tuple[str, str]]:
    return [(p, p + body) for p, body in HANDWRITTEN]


def text_loss(target, tokenizer, texts: Sequence[str]) -> float:
    """Mean next-token loss (nats/token) of the target over each text (all tokens after the first).

    One forward over all texts, right-padded to a common length: the target is causal, so padding after a text
    changes none of its logits, and one program is compiled instead of one per text length."""
    import jax.numpy as jnp

    ids = [tokenizer.encode(text) for text in texts]
    width = max(len(t) for t in ids)
    batch = np.zeros((len(ids), width), np.int32)
    for i, t in enumerate(ids):
        batch[i, :len(t)] = t
    logits, _ = target_forward(target, jnp.asarray(batch))
    x = np.asarray(logits, np.float64)[:, :-1]  # [N, W-1, V]
    m = x.max(-1, keepdims=True)
    logp = x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))
    total = -sum(float(logp[i, np.arange(len(t) - 1), t[1:]].sum()) for i, t in enumerate(ids))
    return total / sum(len(t) - 1 for t in ids)


def heldout_loss(target, tokenizer, *, seq_len: int = 256, n_windows: int = 64, skip_codecs: bool = False) -> float:
    """Mean next-token loss on fixed windows of the stdlib held-out split (the windows the trainer evaluates).

    skip_codecs leaves out ``encodings/``: its codec modules are near-identical generated tables, so their loss
    says more about whether a sibling table was trained on than about code (the v2 corpus drops such siblings).
    """

    held = corpus.split_files(corpus.stdlib_files())[1]
    if skip_codecs:
        held = [f for f in held if not corpus.relpath(f).startswith("encodings/")]
    stream = corpus.token_stream(tokenizer, corpus.read_texts(held), tokenizer.eos_id)
    cfg = target.config.replace(compute_dtype="float32")
    fn = heldout_loss_fn(cfg, stream, seq_len, n_windows=n_windows, chunk=max(1, 4096 // seq_len))
    params = target.params
    return fn(params)["heldout_loss"]


def report(target, tokenizer, *, prompts: int = 16, max_new_tokens: int = 256, seed: int = 0,
           windows: int = 64) -> dict:
    """Held-out loss (256- and 1024-token windows), and seq-rep-4 of greedy continuations of held-out and
    hand-written prompts, with the hand-written solutions' own seq-rep-4 and the target's loss on them."""

    held = corpus.held_out_prompts(prompts, seed=seed)
    hand = [p.rstrip("\n") for p, _ in HANDWRITTEN]  # the newline is the model's (see corpus._sample_prompts)
    out = {
        "windows": windows,
        "heldout_loss_256": heldout_loss(target, tokenizer, seq_len=256, n_windows=windows),
        "heldout_loss_1024": heldout_loss(target, tokenizer, seq_len=1024, n_windows=max(1, windows // 4)),
        "heldout_loss_256_no_codecs": heldout_loss(target, tokenizer, seq_len=256, n_windows=windows,
                                                   skip_codecs=True),
        "seq_rep_4_heldout": continuation_repetition(target, tokenizer, held, max_new_tokens=max_new_tokens),
        "seq_rep_4_handwritten": continuation_repetition(target, tokenizer, hand, max_new_tokens=max_new_tokens),
        "seq_rep_4_handwritten_solutions": float(statistics.median(
            seq_rep_n(tokenizer.encode(t), 4) for _, t in handwritten_texts())),
        "handwritten_loss": text_loss(target, tokenizer, [t for _, t in handwritten_texts()]),
    }
    return out


def format_report(r: dict, *, show: int = 2) -> str:
    w = r.get("windows", 64)
    lines = [
        f"held-out loss (stdlib held-out split, nats/token): {r['heldout_loss_256']:.3f} on {w} windows of 256 "
        f"tokens, {r['heldout_loss_1024']:.3f} on {max(1, w // 4)} windows of 1024; "
        f"{r['heldout_loss_256_no_codecs']:.3f} on {w} windows of 256 without encodings/ (generated codec tables)",
        f"loss on the hand-written functions (prompt + body): {r['handwritten_loss']:.3f} nats/token",
        f"seq-rep-4 of greedy continuations, median: held-out prompts {r['seq_rep_4_heldout']['median']:.3f} "
        f"(n={len(r['seq_rep_4_heldout']['per_prompt'])}); hand-written prompts "
        f"{r['seq_rep_4_handwritten']['median']:.3f} (n={len(r['seq_rep_4_handwritten']['per_prompt'])}); the "
        f"hand-written solutions themselves {r['seq_rep_4_handwritten_solutions']:.3f}",
    ]
    for i, (p, _) in enumerate(HANDWRITTEN[:show]):
        lines += ["-" * 72, p.rstrip("\n") + r["seq_rep_4_handwritten"]["texts"][i]]
    return "\n".join(lines)
