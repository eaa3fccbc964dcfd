"""Instruction prompts for an instruct target: requests made from the corpus's own functions, plus general requests.

A drafter learns what *its* target says, so its data is the target's answers to requests like a user's. The coding
requests are built from the docstrings and signatures of functions in the corpus (the TRAIN split for training, the
held-out split for evaluation, see `corpus.split_files`): "Write a Python function `chunked(items, size)` that splits
a list into consecutive chunks ...". The general requests are written here from templates and subjects (none comes
from a benchmark data set). Everything is deterministic for a seed.
"""

from __future__ import annotations

import ast
import re
from typing import Sequence

import numpy as np

from dflash_jax.train import corpus

_CODE_TEMPLATES = (
    "Write a Python function `{sig}` that {what}",
    "Implement `{sig}` in Python. It {what}",
    "Can you write a Python function `{sig}`? It {what}",
    "Write a short Python function `{sig}` that {what} Explain briefly how it works.",
    "I need a Python function `{sig}` that {what} Please include a docstring.",
)

_GENERAL_TEMPLATES = (
    "Explain {s} in Python.",
    "What is {s} in Python? Give a short example.",
    "How do I use {s} in Python?",
    "Give me a simple example of {s} in Python.",
    "When should I use {s} in Python?",
)

_GENERAL_SUBJECTS = (
    "a list comprehension", "a dictionary", "a generator", "a decorator", "a context manager", "exception handling",
    "the difference between a list and a tuple", "string formatting with f-strings", "reading a text file",
    "writing a CSV file", "a class with a constructor", "inheritance", "a lambda function", "the `with` statement",
    "recursion", "a set", "sorting a list of dictionaries by a key", "the `enumerate` function", "the `zip` function",
    "a while loop", "default arguments", "keyword arguments", "`*args` and `**kwargs`", "a module import",
    "a virtual environment", "unit tests with unittest", "type hints", "a dataclass", "the `json` module",
    "regular expressions", "the `pathlib` module", "a binary search", "a stack", "a queue with collections.deque",
    "a counter with collections.Counter", "list slicing", "string methods such as split and join",
    "integer division and the modulo operator", "the `datetime` module", "a property", "a static method",
    "iterators", "the `any` and `all` functions", "mutable default arguments", "shallow and deep copies",
    "global and local variables", "the `__name__ == '__main__'` idiom", "error messages and tracebacks",
)


_VERBS = frozenset("""
add append apply ask build calculate call check choose clear close compare compile compute convert copy count create
decode delete determine discard display emit encode escape extract fetch fill filter find flush format generate get
handle initialize insert iterate join load make match merge move normalize open parse prepare print process quote
raise read register remove replace reset resolve return run save search select send set show sort split start stop
strip test translate unquote unset update validate wait wrap write yield
""".split())


def _third_person(verb: str) -> str:
    if verb.endswith(("sh", "ch", "x", "z", "s")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _first_sentence(doc: str) -> str | None:
    """The docstring's first sentence as a clause ('splits a list ...'), or None unless it starts with a plain
    verb (imperative 'Return ...' or third person 'Returns ...'): other openings do not read as a request."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = m.group(1) if m else text
    if not 12 <= len(sentence) <= 200 or any(c in sentence for c in "`>{}|"):
        return None
    first, _, rest = sentence.partition(" ")
    verb = first.lower()
    if verb in _VERBS:
        clause = f"{_third_person(verb)} {rest}"
    elif verb.endswith("s") and (verb[:-1] in _VERBS or verb[:-2] in _VERBS or verb[:-3] + "y" in _VERBS):
        clause = f"{verb} {rest}"
    else:
        return None
    clause = clause.strip().rstrip(".")
    return clause if clause.endswith(("!", "?")) else clause + "."


def _signature(fn: ast.FunctionDef) -> str | None:
    args = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
    if fn.args.vararg:
        args.append("*" + fn.args.vararg.arg)
    args += [a.arg for a in fn.args.kwonlyargs]
    if fn.args.kwarg:
        args.append("**" + fn.args.kwarg.arg)
    if len(args) > 5 or fn.name.startswith("_"):
        return None
    return f"{fn.name}({', '.join(args)})"


def documented_functions(texts: Sequence[str]) -> list[tuple[str, str, str, ast.FunctionDef]]:
    """(signature, clause, its file's text, the function's node) for every public function with a usable docstring
    in `texts` (files that do not parse are skipped), in file order, deduplicated by signature."""
    seen, out = set(), []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            doc = ast.get_docstring(node)
            sig = _signature(node) if doc else None
            what = _first_sentence(doc) if sig else None
            if what and sig not in seen:
                seen.add(sig)
                out.append((sig, what, text, node))
    return out


def function_requests(texts: Sequence[str]) -> list[tuple[str, str]]:
    """(signature, clause) for every public function with a usable docstring in `texts` (`documented_functions`)."""
    return [(sig, what) for sig, what, _, _ in documented_functions(texts)]


def general_requests(split: str = "train") -> list[str]:
    """Every template x subject of the split: every sixth subject is held out for evaluation."""
    subjects = [s for i, s in enumerate(_GENERAL_SUBJECTS) if (i % 6 == 0) == (split == "eval")]
    return [t.format(s=s) for s in subjects for t in _GENERAL_TEMPLATES]


def instruction_requests(n: int, *, split: str = "train", seed: int = 0, general_fraction: float = 0.25) -> list[str]:
    """`n` user requests: about `general_fraction` general ones, the rest coding requests made from functions of the
    corpus's `split` ("train" or "eval") files. Deterministic for a seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    train, held = corpus.split_files(corpus.stdlib_files())
    files = train if split == "train" else [f for f in held if not corpus.relpath(f).startswith("encodings/")]
    funcs = function_requests(corpus.read_texts(files))
    rng = np.random.default_rng(seed)
    general = general_requests(split)
    n_general = min(len(general), int(round(n * general_fraction)))
    n_code = n - n_general
    if n_code > len(funcs):
        raise ValueError(f"asked for {n_code} coding requests; the {split} split has {len(funcs)} usable functions")
    picks = [funcs[i] for i in rng.choice(len(funcs), size=n_code, replace=False)]
    code = [_CODE_TEMPLATES[rng.integers(len(_CODE_TEMPLATES))].format(sig=sig, what=what) for sig, what in picks]
    chosen = [general[i] for i in rng.choice(len(general), size=n_general, replace=False)]
    out = code + chosen
    return [out[i] for i in rng.permutation(len(out))]


def chat_prompts(tokenizer, requests: Sequence[str]) -> list[list[int]]:
    """Each request as one user turn through the tokenizer's own chat template, ready for the assistant's answer."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True)
            for r in requests]
