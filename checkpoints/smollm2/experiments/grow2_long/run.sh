#!/bin/sh
# Session 2026-12-05 (4th): the 2-layer drafter (grow2_300: v4 grown to 2 layers, 300 steps) trained on: a 1,200-step
# schedule at lr 5e-4 over the 2.02M answer tokens, in chunks of 300 steps, each ending with held-out tau at D 3 and
# D 7. Resumable (checkpoint every 50 steps: rerun this script).
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
for stop in 300 600 900 1200; do  # this session stopped it at 900 (session time)
  [ -e .train/grow2l/report_$stop.json ] && continue
  .venv/bin/python -m dflash_jax.cli train-drafter --chat --target smollm2 \
    --data-dir /work/data/smollm2_answers --block-size 8 --batch 8 --anchors 32 --lr 5e-4 \
    --steps 1200 --stop-at $stop --loss-vocab draft --draft-vocab 8192 \
    --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 --layers 2 --init-from .train/grow2s_out \
    --work-dir .train/grow2l --out .train/grow2l_out >> .train/grow2l.log 2>&1 || exit 1
  cp .train/grow2l_out/train_report.json .train/grow2l/report_$stop.json
done
