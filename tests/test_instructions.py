"""Instruction prompts for the instruct target's drafter data: made from corpus functions, split-clean, deterministic."""

import ast

import pytest

from dflash_jax.train import corpus, instructions as I


def test_clause_from_docstrings():
    assert I._first_sentence("Return the sum of a and b.\n\nMore text.") == "returns the sum of a and b."
    assert I._first_sentence("Returns the processor architecture.") == "returns the processor architecture."
    assert I._first_sentence("Search mailbox for matching messages.") == "searches mailbox for matching messages."
    assert I._first_sentence("Copy a file, then apply it.") == "copies a file, then apply it."
    assert I._first_sentence("Like itermonthdates(), but will yield day numbers.") is None  # not a request
    assert I._first_sentence("Return x.") is None  # too short to say what to write
    assert I._first_sentence("Return `x` quoted.") is None  # markup does not read as prose


def test_signature_and_requests_from_source():
    src = 'def chunked(items, size, *rest, key=None, **kw):\n    """Split a list into chunks."""\n\n' \
          'def _private(x):\n    """Return x doubled twice over."""\n\n' \
          'def undocumented(x):\n    pass\n'
    assert I.function_requests([src]) == [("chunked(items, size, *rest, key, **kw)", "splits a list into chunks.")]
    assert I.function_requests(["def broken(:\n"]) == []  # files that do not parse are skipped


def test_splits_are_disjoint_and_deterministic():
    train = I.instruction_requests(64, split="train", seed=3)
    again = I.instruction_requests(64, split="train", seed=3)
    held = I.instruction_requests(32, split="eval", seed=3)
    assert train == again and len(train) == 64 and len(set(train)) == 64
    assert not set(train) & set(held)
    assert not set(I.general_requests("train")) & set(I.general_requests("eval"))
    # every coding request of the eval split names a function defined in a held-out file
    _, held_files = corpus.split_files(corpus.stdlib_files())
    held_names = {n.name for t in corpus.read_texts(held_files) for n in ast.walk(ast.parse(t))
                  if isinstance(n, ast.FunctionDef)}
    for r in held:
        if r.startswith(("Write", "Implement", "Can you", "I need")):  # a coding request (general ones ask otherwise)
            assert r.split("`")[1].split("(")[0] in held_names
    with pytest.raises(ValueError, match="split"):
        I.instruction_requests(4, split="test")
    with pytest.raises(ValueError, match="usable functions"):
        I.instruction_requests(100_000, split="eval", general_fraction=0.0)
