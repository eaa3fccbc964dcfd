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

import dataclasses
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
            # a linked file (Debian's sitecustomize.py -> /etc/python3.x/) lives outside the stdlib: skipped, as
            # linked directories are
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
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
# Third-party pure-Python packages (the `[corpus]` extra)

# Distribution -> pinned version. pyproject.toml's `corpus` extra pins exactly these (a test checks), so the corpus
# is the same on every machine that installs it. All are permissively licensed (the manifest records each licence).
# WHY these: well-known, mostly pure-Python libraries of many kinds (web, parsing, data structures, numerics, CLI,
# async networking, ORMs); none ships a data set of coding problems.
CORPUS_PACKAGES: dict[str, str] = {
    "attrs": "26.1.0", "beautifulsoup4": "4.15.0", "boltons": "26.2.0", "click": "8.5.1", "django": "5.2.19",
    "docutils": "0.23", "flask": "3.1.3", "html5lib": "1.1", "idna": "3.20", "itsdangerous": "2.2.0",
    "jedi": "0.20.1", "jinja2": "3.1.6", "marshmallow": "4.4.0", "more-itertools": "11.2.1", "mpmath": "1.3.0",
    "networkx": "3.6.1", "openpyxl": "3.1.5", "packaging": "26.4", "parso": "0.8.7", "pexpect": "4.9.0",
    "ply": "3.11", "prompt-toolkit": "3.0.53", "pycparser": "3.12", "pygments": "2.21.0", "pyparsing": "3.3.3",
    "python-dateutil": "4.0.0", "pyyaml": "6.0.4", "requests": "2.34.2", "rich": "15.0.0", "setuptools": "84.2.1",
    "six": "1.17.0", "sortedcontainers": "2.4.0", "soupsieve": "4.1.3", "sqlalchemy": "2.1.9",
    "sqlparse": "0.6.1", "sympy": "1.14.0", "tabulate": "0.10.0", "toolz": "1.2.0", "tornado": "6.6.1",
    "twisted": "26.10.0", "urllib3": "2.8.0", "webencodings": "0.6.1", "werkzeug": "3.1.9",
}
# Directories left out of package sources: test suites (as for the stdlib), vendored copies of other packages (they
# duplicate what is listed above at other versions) and generated database migrations.
_PACKAGE_EXCLUDED_DIRS = _EXCLUDED_DIRS | {"testing", "_vendor", "vendor", "vendored", "migrations"}
# Lines longer than this mark generated tables (unicode maps, lexer name tables), not code anyone writes.
MAX_LINE_CHARS = 400
# Refuse coding-benchmark data anywhere in the corpus: a file naming one of these is dropped and counted.
BENCHMARK_MARKERS = ("HumanEval", "humaneval", "human_eval", "mbpp", "MBPP", "LiveCodeBench", "codeparrot/apps")


class CorpusError(RuntimeError):
    """The corpus cannot be built as asked (an extra not installed, a wrong version, nothing to train on)."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    rel: str  # "json/decoder.py" for the stdlib, "<dist>/<path in the wheel>" for a package
    origin: str  # "stdlib" or the distribution name
    text: str


def _dist_files(dist_name: str, version: str) -> list[tuple[str, Path]]:
    import importlib.metadata as md

    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise CorpusError(f"corpus package {dist_name!r} is not installed: install the corpus extra with "
                          "`pip install -e '.[corpus]'` (or train on the stdlib alone with --no-packages)") from None
    if dist.version != version:
        raise CorpusError(f"corpus package {dist_name!r} is installed at version {dist.version}, the corpus pins "
                          f"{version}: reinstall the corpus extra with `pip install -e '.[corpus]'`")
    out = []
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if not str(f).endswith(".py") or any(_excluded_dir(p) or p in _PACKAGE_EXCLUDED_DIRS for p in parts[:-1]):
            continue
        if any(p.endswith((".dist-info", ".egg-info", ".data")) for p in parts):
            continue
        path = Path(dist.locate_file(f))
        if path.is_file():
            out.append((f"{dist_name}/{Path(str(f)).as_posix()}", path))
    return sorted(out)


def _admissible(text: str) -> str | None:
    """Why a package file is left out (None = keep)."""
    if any(m in text for m in BENCHMARK_MARKERS):
        return "benchmark"
    if max((len(line) for line in text.splitlines()), default=0) > MAX_LINE_CHARS:
        return "generated"
    if not text.strip():
        return "empty"
    return None


def package_sources(packages: dict[str, str] | None = None) -> tuple[list[SourceFile], dict]:
    """Source files of the pinned corpus packages (filtered; not yet deduplicated) and per-package facts."""
    import importlib.metadata as md

    packages = CORPUS_PACKAGES if packages is None else packages
    files: list[SourceFile] = []
    facts: dict = {}
    for name in sorted(packages):
        kept, dropped = 0, {}
        for rel, path in _dist_files(name, packages[name]):
            raw = path.read_bytes()
            if len(raw) > MAX_FILE_BYTES:
                dropped["too_big"] = dropped.get("too_big", 0) + 1
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] = dropped.get("not_utf8", 0) + 1
                continue
            why = _admissible(text)
            if why:
                dropped[why] = dropped.get(why, 0) + 1
                continue
            files.append(SourceFile(rel, name, text))
            kept += 1
        meta = md.distribution(name).metadata
        licence = meta.get("License-Expression") or (meta.get("License") or "").split("\n")[0][:60]
        if not licence:
            licence = "; ".join(c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if "License" in c)
        facts[name] = {"version": packages[name], "licence": licence, "files": kept, "dropped": dropped}
    return files, facts


class _NearCopies:
    """Finds training files that are edited copies of a held-out file, by shared distinctive lines.

    WHY: exact-hash dedup misses a held-out module copied with small edits into a package (setuptools vendors the
    stdlib's distutils), and training on it would leak held-out text into the held-out loss.
    """

    MIN_CHARS = 25  # shorter lines (`return None`, `else:`) are shared by unrelated code
    MIN_SHARED = 10
    FRACTION = 0.3

    def __init__(self, held: Sequence["SourceFile"]):
        self.owners: dict[str, set[str]] = {}
        self.sizes: dict[str, int] = {}
        for f in held:
            lines = self._lines(f.text)
            self.sizes[f.rel] = len(lines)
            for line in lines:
                self.owners.setdefault(line, set()).add(f.rel)

    @classmethod
    def _lines(cls, text: str) -> set[str]:
        return {line.strip() for line in text.splitlines() if len(line.strip()) >= cls.MIN_CHARS}

    def of(self, text: str) -> str | None:
        lines = self._lines(text)
        shared: dict[str, int] = {}
        for line in lines:
            for rel in self.owners.get(line, ()):
                shared[rel] = shared.get(rel, 0) + 1
        for rel, n in shared.items():
            if n >= self.MIN_SHARED and n >= self.FRACTION * min(self.sizes[rel], len(lines)):
                return rel
        return None


def build_corpus(*, packages: bool | dict[str, str] = True) -> tuple[list[SourceFile], list[SourceFile], dict]:
    """(train, held_out, manifest) over the stdlib and, unless packages=False, the pinned corpus packages.

    The held-out split is by path hash for both sources; the stdlib's held-out files are exactly `split_files`'s, so
    held-out losses stay comparable across corpus versions. Exact duplicates (by content) are trained on once, and
    a training file whose text equals a held-out file is dropped, so held-out text is never trained on.
    """
    std = stdlib_files()
    if not std:
        raise CorpusError(f"no stdlib sources found under {stdlib_root()}: the corpus is empty")
    sources = [SourceFile(relpath(f), "stdlib", t) for f, t in zip(std, read_texts(std))]
    facts: dict = {}
    if packages:
        pkg_files, facts = package_sources(None if packages is True else packages)
        sources += pkg_files
    held = [f for f in sources if is_eval_file(f.rel)]
    seen = {hashlib.sha256(f.text.encode("utf-8")).hexdigest() for f in held}
    near = _NearCopies(held)
    train: list[SourceFile] = []
    duplicates, near_copies = 0, []
    for f in sources:
        if is_eval_file(f.rel):
            continue
        digest = hashlib.sha256(f.text.encode("utf-8")).hexdigest()
        if digest in seen:
            duplicates += 1
            continue
        copied = near.of(f.text)
        if copied is not None:  # an edited copy of held-out text (setuptools ships the stdlib's distutils)
            near_copies.append(f"{f.origin}:{f.rel} ~ {copied}")
            continue
        seen.add(digest)
        train.append(f)
    if not train:
        raise CorpusError("the corpus has no training files")
    names = [f"{f.origin}:{f.rel}" for f in train] + ["--eval--"] + [f"{f.origin}:{f.rel}" for f in held]
    man = {
        "python_version": sys.version,
        "packages": facts,
        "n_train_files": len(train),
        "n_eval_files": len(held),
        "train_chars": {"stdlib": sum(len(f.text) for f in train if f.origin == "stdlib"),
                        "packages": sum(len(f.text) for f in train if f.origin != "stdlib")},
        "duplicates_dropped": duplicates,
        "near_copies_of_held_out_dropped": near_copies,
        "file_list_sha256": hashlib.sha256("\n".join(names).encode("utf-8")).hexdigest(),
    }
    return train, held, man


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
    # The final newline is left to the model: the BPE merges a newline with the next line's indent ("\n   "), so a
    # prompt ending in a bare "\n" token says "the next line starts at column 0" and pushes the model out of the
    # function it is writing (a prompt-boundary artefact, not the model's choice).
    return [texts[picks[i][0]][picks[i][1] : picks[i][2]].rstrip("\n") for i in order]


def held_out_prompts(n: int, *, seed: int = 0, **shape) -> list[str]:
    """``n`` real prompts from the EVAL files, deterministic for a given seed (and Python version).

    Each prompt is a run of whole lines from one file, ``min_chars..max_chars``
    characters long, without its final newline (see ``_sample_prompts``). About ``def_fraction`` of them end
    right after a ``def ...:`` line (the model must write a function body); the
    rest end at a random line boundary. Used for benchmarks, so the model under
    test never trained on them. Files under ``encodings/`` are left out: their
    long character-mapping tables are trivially predictable and would flatter
    acceptance figures. Keywords (defaults): min_chars 100, max_chars 300, def_fraction 0.5, min_continuation 64.
    """
    _, held = split_files(stdlib_files())
    held = [f for f in held if not relpath(f).startswith("encodings/")]
    return _prompts_from(held, n, seed, **shape)


def _prompts_from(files, n: int, seed: int, *, min_chars: int = 100, max_chars: int = 300, def_fraction: float = 0.5,
                  min_continuation: int = 64) -> list[str]:
    """The prompt shape both samplers share (and its defaults): see `held_out_prompts`."""
    return _sample_prompts(read_texts(files), n, seed, min_chars, max_chars, def_fraction, min_continuation)


def train_prompts(n: int, seed: int = 0, **shape) -> list[str]:
    """Like :func:`held_out_prompts` (same keywords) but from the TRAIN files (e.g. drafter training data)."""
    train, _ = split_files(stdlib_files())
    return _prompts_from(train, n, seed, **shape)


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
