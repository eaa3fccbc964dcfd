"""What a training run is, recorded in its work dir (`run.json`) when it starts and checked when it resumes: a
resumed run must be the same run (same drafter layout, target, vocabulary, data and optimizer), or its checkpoints
would be restored into another model or continue another schedule. Every field that differs is named."""

from __future__ import annotations

import json
import os
from pathlib import Path

RECORD = "run.json"

# the fields a resumed run may not change, with the words that name them in a refusal
FIELDS = {
    "kind": "drafter kind", "block_size": "block size", "layers": "drafter layers", "target_layer_ids": "tap set",
    "mask_token_id": "mask token", "target": "target (fingerprint)", "vocabulary": "vocabulary (fingerprint)",
    "vocab_size": "vocabulary size", "data": "training data", "max_data_tokens": "data budget",
    "loss_vocab": "loss vocabulary", "kl_weight": "KL weight", "steps": "schedule length (--steps)",
    "lr": "learning rate", "batch": "batch", "anchors": "anchors per sequence", "seed": "seed",
    "init": "initialisation",
}


class RunMismatch(ValueError):
    pass


def check_or_record(work: Path, record: dict, *, resuming: bool) -> None:
    """Writes `record` to <work>/run.json for a new run; for a resumed one (checkpoints exist) refuses any field of
    FIELDS that differs from the recorded one. A work dir with checkpoints but no record (a run from before the
    record) is accepted as it is, with the record written now."""
    path = Path(work) / RECORD
    if resuming and path.exists():
        old = json.loads(path.read_text())
        diffs = [f"{FIELDS[k]}: {old.get(k)!r} in the run, {record.get(k)!r} asked" for k in FIELDS
                 if k in old and json.loads(json.dumps(record.get(k))) != old.get(k)]
        if diffs:
            raise RunMismatch(f"{work} holds a run with other settings ({'; '.join(diffs)}): resume it with its own "
                              "settings, or use another --work-dir")
        return
    tmp = path.with_name(RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


__all__ = ["RECORD", "FIELDS", "RunMismatch", "check_or_record"]
