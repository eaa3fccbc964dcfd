#!/bin/sh
# Session 2026-12-05 (3rd): the issue-34 experiments not yet measured, each against base_200_steps (same data: the
# first 150k answer tokens, 200 steps, lr 2e-3, loss over the data's vocabulary, 1 layer, random init):
#   b16: block 16 instead of 8 (16 anchors: the same 256 label slots a step);  kl: loss = KL to the target's distribution (weight 1.0) instead of CE;
#   text: the target's own greedy predictions over function sources (--text-answers) instead of generated answers.
# Resumable: rerun this script (each run checkpoints every 50 steps; a finished one is skipped).
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
COMMON="--chat --target smollm2 --layers 1 --batch 8 --anchors 32 --lr 2e-3 --loss-vocab data --eval-every 0 --ckpt-every 50 --steps 200"
run() {  # name, extra args
  name=$1; shift
  [ -e .train/exp/$name/report_200.json ] && return 0
  nice -n 10 .venv/bin/python -m dflash_jax.cli train-drafter $COMMON --work-dir .train/exp/$name --out .train/exp/${name}_out "$@" \
    >> .train/exp/$name.log 2>&1 || return 1
  cp .train/exp/${name}_out/train_report.json .train/exp/$name/report_200.json
}
mkdir -p .train/exp
run b16 --block-size 16 --anchors 16 --data-dir /work/data/smollm2_answers --max-data-tokens 150000 --eval-draft-lengths 3 7 15 || exit 1
run kl --block-size 8 --data-dir /work/data/smollm2_answers --max-data-tokens 150000 --kl-weight 1.0 --eval-draft-lengths 3 7 || exit 1
run text --block-size 8 --text-answers 1000 --new-tokens 256 --max-prompt-tokens 96 --eval-draft-lengths 3 7 || exit 1
