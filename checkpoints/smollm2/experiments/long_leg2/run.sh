#!/bin/sh
# Session 2026-12-05, second leg: from the first leg's drafter (.train/big_out, 1,200 steps on 573,906 answer tokens,
# held-out tau flat from step 900 on), every shard after 28 more minutes of data generation, the same loss, a fresh
# 1,200-step schedule at lr 7e-4 in chunks of 600 (each ends with held-out tau at D 3 and D 7). Resumable.
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
for stop in 600 1200; do
  [ -e .train/big2/report_$stop.json ] && continue
  .venv/bin/python -m dflash_jax.cli train-drafter --chat --target smollm2 \
    --data-dir /work/data/smollm2_answers --block-size 8 --layers 1 --batch 8 --anchors 32 --lr 7e-4 \
    --steps 1200 --stop-at $stop --init-from .train/big_out --loss-vocab draft --draft-vocab 8192 \
    --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 \
    --work-dir .train/big2 --out .train/big2_out >> .train/big2.log 2>&1 || exit 1
  cp .train/big2_out/train_report.json .train/big2/report_$stop.json
done
