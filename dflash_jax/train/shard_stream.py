"""Training batches from a datagen work dir (`train.datagen`, `train.shards`), reproducible across resumes while
the data grows.

The rows a step draws from are fixed by the run's data plan (`<work>/data_plan.json`): a list of segments, each
"from step s on, the first n rows of these shards, in this order". A run that starts (or resumes) at step s and
finds more complete shards than the segment in force starts a new segment at s; steps before s keep theirs. So a
resumed run sees the new shards, and a run resumed on unchanged data is bit for bit the run that was never
stopped. Within a segment the rows are visited epoch by epoch, each epoch a permutation drawn from
(seed, segment, epoch), `batch` rows per step; anchors come from (seed, step) as for the cached data.

Every shard a plan names is checked when the run opens it: it must come from this target (the manifest's
fingerprint and the shard's own), hold complete files (a truncated file is named), and be the shard the plan
recorded (same answers and sizes): a shard replaced under a run is refused rather than silently read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import numpy as np

from dflash_jax.train import shards
from dflash_jax.train.drafter_data import sample_anchors
from dflash_jax.train.loop import batch_rng
from dflash_jax.train.shards import DataError, DataSpec, RaggedFeatures

PLAN = "data_plan.json"


@dataclasses.dataclass(frozen=True)
class Segment:
    """From step `start` on: the first `rows` rows of `shards` (name, answers, feature bytes), in that order."""

    start: int
    shards: tuple[tuple[str, int, int], ...]
    rows: int

    def as_json(self) -> dict:
        return {"start": self.start, "shards": [list(s) for s in self.shards], "rows": self.rows}

    @classmethod
    def from_json(cls, d: dict) -> "Segment":
        return cls(start=int(d["start"]), shards=tuple(tuple(s) for s in d["shards"]), rows=int(d["rows"]))


def is_datagen_dir(path) -> bool:
    return (Path(path) / shards.MANIFEST).exists()


def data_spec(data_dir: Path, *, target_fingerprint: str, vocabulary: str, layer_ids) -> DataSpec:
    """The work dir's spec, after refusing data made with another target or vocabulary, or without the taps."""
    spec = DataSpec.from_json(shards.read_manifest(data_dir)["spec"])
    if spec.target_fingerprint != target_fingerprint:
        raise DataError(f"{data_dir} holds data of another target (fingerprint {spec.target_fingerprint}, this "
                        f"target {target_fingerprint}): train against the target the data was made with")
    if spec.vocabulary != vocabulary:
        raise DataError(f"{data_dir} was tokenized with another vocabulary (fingerprint {spec.vocabulary}, this "
                        f"tokenizer {vocabulary})")
    missing = [i for i in layer_ids if i not in spec.layer_ids]
    if missing:
        raise DataError(f"{data_dir} holds features of target layers {spec.layer_ids}; the drafter taps "
                        f"{tuple(layer_ids)} ({missing} missing)")
    return spec


def complete_shards(data_dir: Path, spec: DataSpec, max_answer_tokens: int | None = None
                    ) -> tuple[tuple[tuple[str, int, int], ...], int]:
    """(shard entries, rows) of the complete shards in order, every one checked (`shards.check_shard`); with
    max_answer_tokens, only the shards and rows up to the first row that reaches that many answer tokens."""
    entries, rows, total = [], 0, 0
    for path in shards.shard_dirs(data_dir):
        meta = shards.check_shard(path, spec)
        if max_answer_tokens is not None and total >= max_answer_tokens:
            break
        entries.append((path.name, int(meta["answers"]), int(meta["bytes"]["features"])))
        if max_answer_tokens is None or total + meta["answer_tokens"] <= max_answer_tokens:
            rows, total = rows + meta["answers"], total + meta["answer_tokens"]
            continue
        answer = np.load(path / "lengths.npy") - np.load(path / "prompt_lens.npy")
        take = int(np.searchsorted(np.cumsum(answer), max_answer_tokens - total)) + 1
        rows, total = rows + take, total + int(answer[:take].sum())
    return tuple(entries), rows


def read_plan(work: Path) -> list[Segment]:
    path = Path(work) / PLAN
    return [Segment.from_json(d) for d in json.loads(path.read_text())["segments"]] if path.exists() else []


def update_plan(work: Path, start: int, entries, rows: int) -> list[Segment]:
    """The plan for a run (re)starting at step `start`: segments that begin after it are dropped (their steps are
    redone), and a new segment begins at `start` when the data offers more rows than the one in force."""
    plan = [s for s in read_plan(work) if s.start <= start]
    if plan:  # shards are immutable once complete: the data in force must still be there, in its order
        old = plan[-1].shards
        for have, want in zip(tuple(entries) + (None,) * len(old), old):
            if have != want:
                raise DataError(f"shard {want[0]}, which this run's data plan uses, is gone or changed (found "
                                f"{have[0] if have else 'nothing'} in its place): use another --work-dir")
    if not plan or rows > plan[-1].rows:
        if plan and plan[-1].start == start:
            plan.pop()
        plan.append(Segment(start=start, shards=tuple(entries), rows=rows))
    tmp = Path(work) / (PLAN + ".tmp")
    tmp.write_text(json.dumps({"segments": [s.as_json() for s in plan]}, indent=1) + "\n")
    os.replace(tmp, Path(work) / PLAN)
    return plan


def open_rows(data_dir: Path, entries, rows: int, spec: DataSpec, layer_ids) -> dict:
    """The first `rows` rows of the shards `entries`, in order, as `build_data` returns data: tokens [N, L]
    (0-padded), lengths [N], prompt_lens [N], features [N, L, K*H] (lazy, the drafter's taps only)."""
    parts, lens, plens, part, start = [], [], [], [], []
    for name, answers, feat_bytes in entries:
        path = Path(data_dir) / name
        if not path.is_dir():
            raise DataError(f"shard {name} of {data_dir}, which this run's data plan uses, is gone")
        meta = shards.check_shard(path, spec)
        if meta["answers"] != answers or meta["bytes"]["features"] != feat_bytes:
            raise DataError(f"shard {name} of {data_dir} changed since this run's data plan recorded it "
                            f"({meta['answers']} answers, {answers} recorded): use another --work-dir")
        ln = np.load(path / "lengths.npy")
        lens.append(ln)
        plens.append(np.load(path / "prompt_lens.npy"))
        part.append(np.full(len(ln), len(parts)))
        start.append(np.concatenate([[0], np.cumsum(ln)[:-1]]).astype(np.int64))
        parts.append((np.load(path / "tokens.npy", mmap_mode="r"), np.load(path / "features.npy", mmap_mode="r")))
    lens, plens = np.concatenate(lens)[:rows], np.concatenate(plens)[:rows]
    part, start = np.concatenate(part)[:rows], np.concatenate(start)[:rows]
    tokens = np.zeros((rows, spec.seq_len), np.int32)
    for i in range(rows):
        tokens[i, :lens[i]] = parts[part[i]][0][start[i]:start[i] + lens[i]]
    feats = RaggedFeatures([p[1] for p in parts], part, start, lens, spec.seq_len)
    cols = None
    if tuple(layer_ids) != spec.layer_ids:  # a subset of the data's taps: their column blocks, in the drafter's order
        H = spec.hidden_size
        cols = np.concatenate([np.arange(H) + spec.layer_ids.index(i) * H for i in layer_ids])
    return {"tokens": tokens, "lengths": lens.astype(np.int32), "prompt_lens": plens.astype(np.int32),
            "features": feats, "feature_columns": cols}


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, segment: int, epoch: int, rows: int) -> np.ndarray:
    return np.random.default_rng([seed, segment, epoch]).permutation(rows)


def rows_at(plan: list[Segment], step: int, batch: int, seed: int) -> tuple[int, np.ndarray]:
    """(segment index, the rows of step `step`): epoch by epoch through the segment's rows."""
    k = max(i for i, s in enumerate(plan) if s.start <= step)
    seg = plan[k]
    j = (step - seg.start) * batch + np.arange(batch)
    epoch, pos = j // seg.rows, j % seg.rows
    return k, np.asarray([_epoch_order(seed, k, int(e), seg.rows)[p] for e, p in zip(epoch, pos)], np.int64)


class ShardStream:
    """batch_fn(step) over a data plan: a pure function of the step, the plan and the shards it names."""

    def __init__(self, data_dir: Path, plan: list[Segment], spec: DataSpec, layer_ids, *, batch: int,
                 num_anchors: int, seed: int):
        self.plan, self.batch, self.num_anchors, self.seed = plan, batch, num_anchors, seed
        last = plan[-1]  # every segment's shards are a prefix of the last one's (`update_plan`)
        self.data = open_rows(data_dir, last.shards, last.rows, spec, layer_ids)

    @property
    def answer_tokens(self) -> int:
        d = self.data
        return int((d["lengths"] - d["prompt_lens"]).sum())

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch of `step` as host arrays (tokens, lengths, anchors, keep, features)."""
        _, idx = rows_at(self.plan, step, self.batch, self.seed)
        d = self.data
        anchors, keep = sample_anchors(d["lengths"][idx], d["prompt_lens"][idx], self.num_anchors,
                                       batch_rng(self.seed, step))
        feats = d["features"][idx]
        if d["feature_columns"] is not None:
            feats = feats[..., d["feature_columns"]]
        return {"tokens": d["tokens"][idx], "lengths": d["lengths"][idx], "anchors": anchors, "keep": keep,
                "features": feats}


__all__ = ["PLAN", "Segment", "is_datagen_dir", "data_spec", "complete_shards", "read_plan", "update_plan",
           "open_rows", "rows_at", "ShardStream"]
