#!/bin/sh
# Session 2026-12-05 (2nd): v4 (.train/big2_out) grown to 2 layers (`--grow`: the added layer starts as the identity,
# so the run starts from exactly v4's drafts), a 300-step schedule at lr 7e-4 over the 2.02M answer tokens; ends with
# held-out tau at D 3 and D 7. Resumable (checkpoint every 50 steps: rerun this script).
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
[ -e .train/grow2s/report_300.json ] && exit 0
.venv/bin/python -m dflash_jax.cli train-drafter --chat --target smollm2 \
  --data-dir /work/data/smollm2_answers --block-size 8 --batch 8 --anchors 32 --lr 7e-4 \
  --steps 300 --stop-at 300 --loss-vocab draft --draft-vocab 8192 \
  --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 --layers 2 --init-from .train/big2_out --grow \
  --work-dir .train/grow2s --out .train/grow2s_out >> .train/grow2s.log 2>&1 || exit 1
cp .train/grow2s_out/train_report.json .train/grow2s/report_300.json
