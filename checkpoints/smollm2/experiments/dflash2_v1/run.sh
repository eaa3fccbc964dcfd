#!/bin/sh
# Session 2026-12-08 (23rd): a DFlash2 drafter for SmolLM2 (the grouped convolutions and the candidate selector, rank
# 64, top 16), warm-started from the shipped DFlash drafter v4 (its shared tensors copied; the convolutions start as
# the identity and the selector picks the top logit, so training starts from v4's drafts), over the first datagen
# shards of this session (`python -m dflash_jax.train.datagen --work-dir .train/data23 --max-answer-tokens 300000`:
# the chat requests of the train split, the same ones v4's data began with), the loss over the 8,192-id draft
# vocabulary, a 600-step schedule at lr 7e-4 in chunks of 200 steps (each chunk sees the shards made since), held-out
# tau at D 3 and D 7 at the end of each chunk. Resumable: rerun this script (checkpoint every 50 steps).
cd "$(dirname "$0")/../../../.." || exit 1
for stop in 200 400 600; do
  [ -e .train/d2/report_$stop.json ] && continue
  .venv/bin/python -m dflash_jax.train.drafter_run --kind dflash2 --chat --target smollm2 \
    --data-dir .train/data23 --block-size 8 --layers 1 --batch 8 --anchors 32 --lr 7e-4 --steps 600 --stop-at $stop \
    --loss-vocab draft --draft-vocab 8192 --selector-rank 64 --selector-top-k 16 --seed 23 \
    --init-from checkpoints/smollm2/drafter --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 \
    --work-dir .train/d2 --out .train/d2_out >> .train/d2.log 2>&1 || exit 1
  cp .train/d2_out/train_report.json .train/d2/report_$stop.json
done
# leg 2: from leg 1's drafter (an exact warm start of the same kind), a new 600-step schedule at lr 5e-4, its own
# seed (so it draws other batches than leg 1), over the same shards (datagen had stopped at 292,044 answer tokens)
for stop in 300 600; do
  [ -e .train/d2b/report_$stop.json ] && continue
  .venv/bin/python -m dflash_jax.train.drafter_run --kind dflash2 --chat --target smollm2 \
    --data-dir .train/data23 --block-size 8 --layers 1 --batch 8 --anchors 32 --lr 5e-4 --steps 600 --stop-at $stop \
    --loss-vocab draft --draft-vocab 8192 --selector-rank 64 --selector-top-k 16 --seed 24 \
    --init-from .train/d2_out --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 \
    --work-dir .train/d2b --out .train/d2b_out >> .train/d2b.log 2>&1 || exit 1
  cp .train/d2b_out/train_report.json .train/d2b/report_$stop.json
done
