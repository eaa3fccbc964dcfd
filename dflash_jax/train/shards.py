"""A work dir of generated training data: the prompt queue, shards of finished answers with their features, and a
manifest; written by `train.datagen`, read back in the dict format `train.drafter` trains on.

    <work>/manifest.json       what the data is (`DataSpec`: target fingerprint, taps, vocabulary, sampling, ...),
                               the prompt sources, totals and one record per run (rate, counts)
    <work>/prompts.npz         the prompt queue: ids (flat int32) and offsets [n+1]; extended, never reordered
    <work>/shard_00000/        one shard: index.npy [n] (queue indices), prompt_lens.npy, lengths.npy [n],
                               tokens.npy [T] int32 and features.npy [T, K*H] float16 (flat, memory-mappable;
                               row i is offsets i..i+1 of both), meta.json (counts, file sizes; written last)
    <work>/shard_00007.partial/  a shard being written: a killed run leaves one; the next run discards it

A shard becomes visible by one rename, after its files are flushed, so a run killed at any point leaves complete
shards and at most one `.partial` folder; the queue indices the complete shards hold are done, every other one is
(re)done by the next run. A shard is refused (with its name) when it comes from another target or tap set, or when a
file is shorter than its meta.json records (truncated).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

MANIFEST, QUEUE = "manifest.json", "prompts.npz"
ARRAYS = ("index", "prompt_lens", "lengths", "tokens", "features")


class DataError(ValueError):
    """A work dir, shard or run request that cannot be used as it is (the message names what and why)."""


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What the data is: a run that appends to a work dir must ask for exactly this."""

    target_fingerprint: str  # `train.drafter.target_fingerprint`
    layer_ids: tuple[int, ...]  # the tapped target layers (the drafter's target_layer_ids)
    hidden_size: int
    vocab_size: int
    vocabulary: str  # the tokenizer's vocabulary fingerprint (`datagen.vocabulary_fingerprint`)
    block_size: int  # of the drafter the data is for
    max_prompt_tokens: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    sampled_fraction: float  # of the prompts (by queue index, `datagen.temperature_of`)
    temperature: float  # of the sampled ones
    seed: int  # sampling keys: prompt i draws from fold_in(key(seed), i)
    feature_dtype: str = "float16"

    @property
    def feature_width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def seq_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens

    def as_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict) -> "DataSpec":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


_NAMES = {"target_fingerprint": "target (fingerprint)", "layer_ids": "tap layer ids", "vocabulary": "vocabulary",
          "vocab_size": "vocabulary size", "block_size": "block size", "hidden_size": "hidden size"}


def check_spec(have: DataSpec, want: DataSpec, where: Path) -> None:
    """Refuses `want` unless it equals the work dir's spec, naming every field that differs."""
    diffs = [f"{_NAMES.get(f.name, f.name.replace('_', ' '))}: {getattr(have, f.name)!r} in the work dir, "
             f"{getattr(want, f.name)!r} asked" for f in dataclasses.fields(DataSpec)
             if getattr(have, f.name) != getattr(want, f.name)]
    if diffs:
        raise DataError(f"{where} holds data of another recipe ({'; '.join(diffs)}): use another work dir")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_manifest(work: Path) -> dict:
    path = Path(work) / MANIFEST
    if not path.exists():
        raise DataError(f"{work}: no {MANIFEST} (not a data work dir, or never started)")
    return json.loads(path.read_text())


def write_manifest(work: Path, manifest: dict) -> None:
    _write_json(Path(work) / MANIFEST, manifest)


# -- the prompt queue --------------------------------------------------------------------------------------------

def read_queue(work: Path) -> list[tuple[int, ...]]:
    with np.load(Path(work) / QUEUE) as z:
        ids, off = z["ids"], z["offsets"]
    return [tuple(ids[off[i]:off[i + 1]].tolist()) for i in range(len(off) - 1)]


def write_queue(work: Path, prompts: list[tuple[int, ...]]) -> None:
    off = np.zeros(len(prompts) + 1, np.int64)
    off[1:] = np.cumsum([len(p) for p in prompts])
    ids = np.fromiter((t for p in prompts for t in p), np.int32, int(off[-1]))
    tmp = Path(work) / (QUEUE + ".tmp.npz")
    np.savez(tmp, ids=ids, offsets=off)
    os.replace(tmp, Path(work) / QUEUE)


# -- shards ------------------------------------------------------------------------------------------------------

def shard_dirs(work: Path) -> list[Path]:
    return sorted(p for p in Path(work).glob("shard_*") if p.is_dir() and not p.name.endswith(".partial"))


def write_shard(work: Path, number: int, answers: list, spec: DataSpec) -> dict:
    """answers (`refill.Answer`, in any order) -> <work>/shard_<number>/, made visible by one rename; its meta."""
    final = Path(work) / f"shard_{number:05d}"
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = np.asarray([len(a.tokens) for a in answers], np.int32)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    arrays = {"index": np.asarray([a.index for a in answers], np.int64),
              "prompt_lens": np.asarray([a.prompt_len for a in answers], np.int32), "lengths": lengths,
              "tokens": np.concatenate([a.tokens for a in answers]).astype(np.int32)}
    for name, arr in arrays.items():
        np.save(tmp / f"{name}.npy", arr)
    feats = np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=spec.feature_dtype,
                                      shape=(int(off[-1]), spec.feature_width))
    nonfinite = 0
    for a, lo, hi in zip(answers, off[:-1], off[1:]):
        feats[lo:hi] = a.features
        nonfinite += int(np.count_nonzero(~np.isfinite(a.features)))
    feats.flush()
    del feats
    meta = {"answers": len(answers), "tokens": int(off[-1]),
            "answer_tokens": int((lengths - arrays["prompt_lens"]).sum()), "nonfinite_features": nonfinite,
            "target_fingerprint": spec.target_fingerprint, "layer_ids": list(spec.layer_ids),
            "feature_width": spec.feature_width, "feature_dtype": spec.feature_dtype,
            "bytes": {n: (tmp / f"{n}.npy").stat().st_size for n in ARRAYS}, "written": time.strftime("%FT%T")}
    for name in ARRAYS:  # the data reaches the disk before the rename makes the shard count
        with open(tmp / f"{name}.npy", "rb") as f:
            os.fsync(f.fileno())
    _write_json(tmp / "meta.json", meta)
    os.replace(tmp, final)
    return meta


def check_shard(path: Path, spec: DataSpec) -> dict:
    """A complete shard's meta, after checking that it belongs to `spec` and that no file is short."""
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise DataError(f"shard {path.name} in {path.parent} is incomplete (no meta.json): delete the folder "
                        "and its prompts are done again")
    meta = json.loads(meta_file.read_text())
    if meta["target_fingerprint"] != spec.target_fingerprint:
        raise DataError(f"shard {path.name} in {path.parent} was made with another target (fingerprint "
                        f"{meta['target_fingerprint']}, the work dir's {spec.target_fingerprint})")
    if tuple(meta["layer_ids"]) != spec.layer_ids or meta["feature_width"] != spec.feature_width:
        raise DataError(f"shard {path.name} in {path.parent} taps layers {tuple(meta['layer_ids'])}, the work "
                        f"dir's are {spec.layer_ids}")
    for name, size in meta["bytes"].items():
        f = path / f"{name}.npy"
        have = f.stat().st_size if f.exists() else 0
        if have != size:
            raise DataError(f"shard {path.name} in {path.parent} is truncated: {name}.npy holds {have} bytes, "
                            f"its meta.json records {size}: delete the folder and its prompts are done again")
    return meta


def discard_partial(work: Path) -> list[str]:
    """Removes the shards a killed run left half-written; returns their names."""
    gone = [p.name for p in Path(work).glob("shard_*.partial")]
    for name in gone:
        shutil.rmtree(Path(work) / name)
    return gone


def done_indices(work: Path, spec: DataSpec) -> tuple[set[int], int]:
    """(queue indices the complete shards hold, next shard number); every shard checked (`check_shard`)."""
    done: set[int] = set()
    last = -1
    for path in shard_dirs(work):
        check_shard(path, spec)
        idx = np.load(path / "index.npy")
        dup = done.intersection(idx.tolist())
        if dup:
            raise DataError(f"shard {path.name} in {work} repeats prompt {min(dup)} of an earlier shard")
        done.update(idx.tolist())
        last = max(last, int(path.name.split("_")[1]))
    return done, last + 1


# -- reading -----------------------------------------------------------------------------------------------------

class RaggedFeatures:
    """Features [N, L, K*H] of every sequence, 0-padded to L, read lazily from the shards' memory-mapped flat
    arrays: `x[idx]` (an int, a slice, or an index array, as `make_batch_fn` takes a batch) builds only those rows."""

    def __init__(self, parts: list[np.ndarray], part: np.ndarray, start: np.ndarray, lengths: np.ndarray,
                 seq_len: int):
        self._parts, self._part, self._start, self._len = parts, part, start, lengths
        self.shape = (len(lengths), seq_len, parts[0].shape[1] if parts else 0)
        self.dtype = parts[0].dtype if parts else np.dtype(np.float16)
        self.ndim = 3

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self[np.asarray([idx])][0]
        rows = np.arange(self.shape[0])[idx]
        out = np.zeros((len(rows),) + self.shape[1:], self.dtype)
        for i, r in enumerate(rows):
            n = int(self._len[r])
            out[i, :n] = self._parts[self._part[r]][self._start[r]:self._start[r] + n]
        return out

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def read_dataset(work: Path, *, spec: DataSpec | None = None, **require) -> dict:
    """The whole work dir as `build_data` returns data: tokens [N, L] (0-padded, L = max prompt + max new tokens),
    lengths [N], prompt_lens [N], features [N, L, K*H] (`RaggedFeatures`, lazy), plus prompt_index [N] (the rows
    are in queue order). spec: refuse the data unless it was made exactly so; require: refuse it unless these
    `DataSpec` fields have these values (a trainer's check: target_fingerprint=, layer_ids=, block_size=, ...)."""
    work = Path(work)
    have = DataSpec.from_json(read_manifest(work)["spec"])
    if spec is not None:
        check_spec(have, spec, work)
    if require:
        check_spec(have, dataclasses.replace(have, **{k: tuple(v) if isinstance(v, (list, tuple)) else v
                                                      for k, v in require.items()}), work)
    parts, index, plens, lens, part, start = [], [], [], [], [], []
    for path in shard_dirs(work):
        check_shard(path, have)
        idx, ln = np.load(path / "index.npy"), np.load(path / "lengths.npy")
        index.append(idx)
        plens.append(np.load(path / "prompt_lens.npy"))
        lens.append(ln)
        part.append(np.full(len(idx), len(parts)))
        start.append(np.concatenate([[0], np.cumsum(ln)[:-1]]).astype(np.int64))
        parts.append((np.load(path / "tokens.npy", mmap_mode="r"), np.load(path / "features.npy", mmap_mode="r")))
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    index, plens, lens = cat(index, np.int64), cat(plens, np.int32), cat(lens, np.int32)
    part, start = cat(part, np.int64), cat(start, np.int64)
    if len(np.unique(index)) != len(index):
        raise DataError(f"{work}: a prompt appears in two shards")
    order = np.argsort(index, kind="stable")
    index, plens, lens, part, start = index[order], plens[order], lens[order], part[order], start[order]
    L = have.seq_len
    tokens = np.zeros((len(index), L), np.int32)
    for i in range(len(index)):
        tokens[i, :lens[i]] = parts[part[i]][0][start[i]:start[i] + lens[i]]
    feats = RaggedFeatures([p[1] for p in parts], part, start, lens, L)
    return {"tokens": tokens, "lengths": lens, "prompt_lens": plens, "features": feats, "prompt_index": index}
