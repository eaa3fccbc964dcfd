"""Fast checks (< 20 s) for the stdlib corpus pipeline and the shipped tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.train.corpus import (
    MAX_FILE_BYTES,
    batches,
    held_out_prompts,
    read_texts,
    relpath,
    split_files,
    stdlib_files,
    stdlib_root,
    token_stream,
    train_prompts,
)

TOKENIZER_PATH = Path(__file__).resolve().parents[1] / "checkpoints" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER_PATH)


@pytest.fixture(scope="module")
def split() -> tuple[list[Path], list[Path]]:
    return split_files(stdlib_files())


def test_file_list_deterministic_and_filtered() -> None:
    files = stdlib_files()
    assert files == stdlib_files()
    rels = [relpath(f) for f in files]
    assert rels == sorted(rels) and len(set(rels)) == len(rels)
    assert len(files) > 300  # the stdlib is big; a tiny list means the walk broke
    for rel, f in zip(rels, files):
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "test", "tests", "idle_test", "__pycache__"} & set(parts[:-1])
        assert f.stat().st_size <= MAX_FILE_BYTES
    assert "os.py" in rels and "json/__init__.py" in rels


def test_linked_file_outside_the_stdlib_is_skipped(tmp_path: Path) -> None:
    """Debian links sitecustomize.py into the stdlib from /etc: the walk skips linked files (as linked folders), so
    splitting the corpus never meets a path outside its root (it raised ValueError on such a machine)."""
    root, elsewhere = tmp_path / "lib", tmp_path / "etc"
    root.mkdir(), elsewhere.mkdir()
    (root / "os.py").write_text("x = 1\n")
    (elsewhere / "sitecustomize.py").write_text("y = 2\n")
    (root / "sitecustomize.py").symlink_to(elsewhere / "sitecustomize.py")
    files = stdlib_files(root)
    assert [f.name for f in files] == ["os.py"]
    assert sum(map(len, split_files(files, root=root))) == 1


def test_split_disjoint_and_deterministic(split: tuple[list[Path], list[Path]]) -> None:
    train, held = split
    assert split_files(stdlib_files()) == (train, held)
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(stdlib_files())
    assert 0.01 < len(held) / (len(train) + len(held)) < 0.15  # ~5%


def test_shipped_tokenizer(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert (tok.eos_id, tok.mask_id) == (0, 1)
    assert tok.pad_id is None
    assert tok.decode([-1, -5]) == ""


def test_round_trip_on_real_and_tricky_text(tok: Tokenizer, split: tuple[list[Path], list[Path]]) -> None:
    _, held = split
    real = read_texts(held[:5])  # whole unseen files
    snippets = [
        "def f(x):\n\tif x:\n\t\treturn x  # tab-indented\n",
        "    \n\n\n  trailing spaces   \n\n",
        "s = 'naïve café 日本語 🐍'\r\nπ = 3.14159\n",
        "x = '<|endoftext|>' + '<|mask|>'\n",  # literal special-token text stays text
        "",
        "\n",
        "no trailing newline",
    ]
    for s in real + snippets:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert tok.eos_id not in ids and tok.mask_id not in ids
    assert tok.decode([*tok.encode("abc"), -1, *tok.encode("def")]) == "abcdef"


def test_held_out_prompts(split: tuple[list[Path], list[Path]]) -> None:
    train, held = split
    prompts = held_out_prompts(16, seed=0)
    assert prompts == held_out_prompts(16, seed=0)
    assert prompts != held_out_prompts(16, seed=1)
    assert len(prompts) == len(set(prompts)) == 16
    eval_texts = read_texts(held)
    for p in prompts:
        assert 99 <= len(p) <= 300 and not p.endswith("\n")  # the final newline is left to the model
        assert any(p in t for t in eval_texts)
    assert any(p.rstrip().endswith(":") and "def " in p.splitlines()[-1] for p in prompts)
    # Train prompts come from train files, and differ from eval prompts.
    tp = train_prompts(8, seed=0)
    assert tp == train_prompts(8, seed=0) and not set(tp) & set(prompts)
    sample_train = read_texts(train)
    assert all(any(p in t for t in sample_train) for p in tp)


def test_token_stream_and_batches(tok: Tokenizer) -> None:
    texts = ["a = 1\n", "def g():\n    pass\n"]
    stream = token_stream(tok, texts, tok.eos_id)
    assert stream.dtype == np.int32 and stream.ndim == 1
    assert list(stream) == [*tok.encode(texts[0]), tok.eos_id, *tok.encode(texts[1]), tok.eos_id]

    tokens = np.arange(1000, dtype=np.int32)
    a = list(batches(tokens, 4, 33, seed=3, steps=3))
    b = list(batches(tokens, 4, 33, seed=3, steps=3))
    assert len(a) == 3
    for x, y in zip(a, b):
        assert x.shape == (4, 33) and x.dtype == np.int32
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # contiguous windows
        assert x.min() >= 0 and x.max() < 1000
    c = next(batches(tokens, 4, 33, seed=4))
    assert not np.array_equal(a[0], c)
    with pytest.raises(ValueError):
        next(batches(tokens[:10], 2, 33, seed=0))


def test_stdlib_root_matches_interpreter() -> None:
    assert (stdlib_root() / "os.py").is_file()
