"""The training corpus: the Python standard library's own ``.py`` sources.

WHY this corpus: it is real, varied, human-written code that exists on every
machine with a Python install, so the project can train and evaluate its own
small LM with no network and no dataset download.

File list (``stdlib_files``), deterministic for a given Python build:

* every file under ``sysconfig.get_paths()["stdlib"]`` whose name ends in ``.py``;
* excluding any directory named ``site-packages`` / ``dist-packages`` (third-party
  code, differs per machine), ``test`` / ``tests`` / ``idle_test`` (this covers
  ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``unittest/test``, ...: test
  suites are huge, repetitive and contain deliberately broken files), and
  ``__pycache__``;
* excluding machine-specific build artefacts: ``_sysconfigdata_*.py`` and the
  ``config-*`` directory (they embed build paths/flags, not source code);
* excluding files larger than 200 KB (generated data such as ``pydoc_data/topics.py``
  would dominate the corpus) and files that are not valid UTF-8;
* sorted by relative POSIX path.

The stdlib differs across Python versions, so every manifest records
``sys.version``; figures are only comparable for the same version.

Split (``split_files``): whole files, by ``sha1(relpath) % 20 == 0`` -> eval
(~5%). WHY hash the path rather than shuffle: the split is stable under
additions/removals of other files and never needs a stored list, and because it
splits whole files, no eval text (or a near-duplicate chunk of it) is in training.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

MAX_FILE_BYTES = 200_000
EVAL_MODULUS = 20  # sha1(relpath) % EVAL_MODULUS == 0 -> eval, ~5%
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's stdlib directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def relpath(path: Path, root: Path | None = None) -> str:
    """POSIX path of ``path`` relative to ``root`` (default: the stdlib root)."""
    return Path(path).resolve().relative_to((root or stdlib_root()).resolve()).as_posix()


def _excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIRS or name.startswith("config-")


@functools.lru_cache(maxsize=4)
def _scan(root: Path) -> tuple[Path, ...]:
    found: list[tuple[str, Path]] = []
    # followlinks=False: a symlinked directory could pull in files outside the
    # stdlib or make the list depend on the filesystem layout.
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata_"):
                continue
            path = Path(dirpath) / name
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return tuple(p for _, p in found)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Absolute paths of the corpus files, sorted by relative POSIX path (see module doc)."""
    return list(_scan((root or stdlib_root()).resolve()))


def is_eval_file(rel: str) -> bool:
    """True when the file with relative POSIX path ``rel`` belongs to the held-out split."""
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % EVAL_MODULUS == 0


def split_files(files: Sequence[Path], *, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Split whole files into ``(train, eval)``, order preserved, by hashing relpaths."""
    root = (root or stdlib_root()).resolve()
    train: list[Path] = []
    held: list[Path] = []
    for f in files:
        (held if is_eval_file(relpath(f, root)) else train).append(f)
    return train, held


def read_texts(files: Sequence[Path]) -> list[str]:
    """File contents, decoded as strict UTF-8, byte-faithful.

    WHY bytes + decode rather than ``read_text``: text mode would translate
    ``\\r\\n`` and depend on the locale; the corpus must be identical everywhere.
    """
    return [Path(f).read_bytes().decode("utf-8") for f in files]


def manifest(train: Sequence[Path], held: Sequence[Path], *, root: Path | None = None) -> dict:
    """A JSON-able record of the corpus: Python version, counts, and a digest of the file lists."""
    root = (root or stdlib_root()).resolve()
    train_rel = [relpath(f, root) for f in train]
    eval_rel = [relpath(f, root) for f in held]
    digest = hashlib.sha256("\n".join(train_rel + ["--eval--"] + eval_rel).encode("utf-8")).hexdigest()
    return {
        "python_version": sys.version,
        "stdlib_root": str(root),
        "n_train_files": len(train_rel),
        "n_eval_files": len(eval_rel),
        "file_list_sha256": digest,
        "eval_files": eval_rel,
    }


# --------------------------------------------------------------------------------------
# Prompts


def _line_starts(text: str) -> list[int]:
    starts = [0]
    pos = text.find("\n")
    while pos != -1:
        starts.append(pos + 1)
        pos = text.find("\n", pos + 1)
    return starts


def _is_def_line(line: str) -> bool:
    s = line.strip()
    return (s.startswith("def ") or s.startswith("async def ")) and s.endswith(":")


def _candidates(
    texts: Sequence[str], min_chars: int, max_chars: int, min_continuation: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """All admissible ``(text_idx, start, cut)`` windows, split into (def-line cuts, other line cuts).

    A window ends right after a newline (``cut``) and starts at a line start
    (``start``) so prompts hold whole lines; its length is in
    ``[min_chars, max_chars]``; at least ``min_continuation`` characters follow it,
    so there is a real reference continuation to compare against.
    """
    defs: list[tuple[int, int, int]] = []
    lines: list[tuple[int, int, int]] = []
    for ti, text in enumerate(texts):
        starts = _line_starts(text)
        j = 0  # first line start >= cut - max_chars; monotone in cut
        for k in range(1, len(starts)):
            cut = starts[k]
            if len(text) - cut < min_continuation:
                break
            while starts[j] < cut - max_chars:
                j += 1
            start = starts[j]
            if cut - start < min_chars or not text[start:cut].strip():
                continue
            line = text[starts[k - 1] : cut]
            (defs if _is_def_line(line) else lines).append((ti, start, cut))
    return defs, lines


def _sample_prompts(
    texts: Sequence[str], n: int, seed: int, min_chars: int, max_chars: int, def_fraction: float, min_continuation: int
) -> list[str]:
    if n < 0 or not 0.0 <= def_fraction <= 1.0 or not 0 < min_chars <= max_chars:
        raise ValueError("need n >= 0, 0 <= def_fraction <= 1, 0 < min_chars <= max_chars")
    defs, lines = _candidates(texts, min_chars, max_chars, min_continuation)
    rng = np.random.default_rng(seed)
    n_def = min(len(defs), round(n * def_fraction))
    n_line = n - n_def
    if n_line > len(lines):
        raise ValueError(f"asked for {n} prompts but only {len(defs)} + {len(lines)} windows exist")
    picks = [defs[i] for i in rng.choice(len(defs), size=n_def, replace=False)] if n_def else []
    picks += [lines[i] for i in rng.choice(len(lines), size=n_line, replace=False)] if n_line else []
    order = rng.permutation(len(picks))  # interleave def / plain cuts
    return [texts[picks[i][0]][picks[i][1] : picks[i][2]] for i in order]


def held_out_prompts(
    n: int,
    *,
    seed: int = 0,
    min_chars: int = 100,
    max_chars: int = 300,
    def_fraction: float = 0.5,
    min_continuation: int = 64,
) -> list[str]:
    """``n`` real prompts from the EVAL files, deterministic for a given seed (and Python version).

    Each prompt is a run of whole lines from one file, ``min_chars..max_chars``
    characters long, ending with a newline. About ``def_fraction`` of them end
    right after a ``def ...:`` line (the model must write a function body); the
    rest end at a random line boundary. Used for benchmarks, so the model under
    test never trained on them. Files under ``encodings/`` are left out: their
    long character-mapping tables are trivially predictable and would flatter
    acceptance figures.
    """
    _, held = split_files(stdlib_files())
    held = [f for f in held if not relpath(f).startswith("encodings/")]
    return _sample_prompts(read_texts(held), n, seed, min_chars, max_chars, def_fraction, min_continuation)


def train_prompts(
    n: int,
    seed: int = 0,
    *,
    min_chars: int = 100,
    max_chars: int = 300,
    def_fraction: float = 0.5,
    min_continuation: int = 64,
) -> list[str]:
    """Like :func:`held_out_prompts` but from the TRAIN files (e.g. to generate drafter training data)."""
    train, _ = split_files(stdlib_files())
    return _sample_prompts(read_texts(train), n, seed, min_chars, max_chars, def_fraction, min_continuation)


# --------------------------------------------------------------------------------------
# Token streams and batches


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def token_stream(tokenizer: _Encoder, texts: Sequence[str], eos_id: int) -> np.ndarray:
    """All texts encoded and concatenated as ``doc0 EOS doc1 EOS ... docN EOS`` (int32, 1-D).

    WHY EOS after every document (the last one too): the model learns where a
    file ends, and a window that crosses a boundary sees EOS before the next
    file's first token, as it will at inference time.
    """
    encode_batch = getattr(tokenizer, "encode_batch", None)
    encoded = encode_batch(list(texts)) if encode_batch is not None else [tokenizer.encode(t) for t in texts]
    total = sum(len(ids) + 1 for ids in encoded)
    out = np.empty(total, dtype=np.int32)
    pos = 0
    for ids in encoded:
        out[pos : pos + len(ids)] = ids
        pos += len(ids)
        out[pos] = eos_id
        pos += 1
    return out


def batches(
    tokens: np.ndarray, batch: int, seq_len: int, seed: int, *, steps: int | None = None
) -> Iterator[np.ndarray]:
    """Yield ``[batch, seq_len]`` int32 windows at uniformly random offsets of ``tokens``.

    Deterministic for a given seed; infinite unless ``steps`` is given. For
    next-token training ask for ``seq_len + 1`` and split into inputs/targets.
    WHY random windows rather than epochs of fixed chunks: every offset is a
    valid sample, so the small corpus yields many more distinct examples.
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 1 or batch <= 0 or seq_len <= 0 or len(tokens) < seq_len:
        raise ValueError(f"need 1-D tokens with at least seq_len={seq_len} entries and batch > 0")
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len, dtype=np.int64)
    step = 0
    while steps is None or step < steps:
        starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch)
        yield tokens[starts[:, None] + offsets[None, :]]
        step += 1
