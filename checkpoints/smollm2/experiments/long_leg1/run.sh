#!/bin/sh
# Session 2026-12-05: warm-started from the shipped drafter, all 15 shards (573,906 answer tokens), loss over the
# 8192-id draft vocabulary, a 1,200-step schedule in chunks of 300 (each ends with held-out tau at D 3 and D 7).
# Resumable: rerun this script.
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
for stop in 300 600 900 1200; do
  [ -e .train/big/report_$stop.json ] && continue
  .venv/bin/python -m dflash_jax.cli train-drafter --chat --target smollm2 \
    --data-dir /work/data/smollm2_answers --block-size 8 --layers 1 --batch 8 --anchors 32 --lr 1e-3 \
    --steps 1200 --stop-at $stop --init-from checkpoints/smollm2/drafter --loss-vocab draft --draft-vocab 8192 \
    --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 \
    --work-dir .train/big --out .train/big_out >> .train/big.log 2>&1 || exit 1
  cp .train/big_out/train_report.json .train/big/report_$stop.json
done
