#!/bin/sh
# Session 2026-12-05 (2nd): from v4 (.train/big2_out), on the 2.01M answer tokens of the extended data: leg 3 = one
# more 1-layer leg (lr 7e-4, a 600-step schedule); grow2 = v4 grown to 2 layers (`--grow`: the added layer starts as
# the identity), the same data and schedule. Each ends with held-out tau at D 3 and D 7. Resumable (checkpoint every
# 50 steps: rerun this script).
cd /work/wt-train || exit 1
export JAX_COMPILATION_CACHE_DIR=/work/wt-train/.train/xla
run() {
  name=$1; stop=$2; shift 2
  [ -e .train/$name/report_$stop.json ] && return 0
  .venv/bin/python -m dflash_jax.cli train-drafter --chat --target smollm2 \
    --data-dir /work/data/smollm2_answers --block-size 8 --batch 8 --anchors 32 --lr 7e-4 \
    --steps $stop --stop-at $stop --loss-vocab draft --draft-vocab 8192 \
    --eval-every 0 --ckpt-every 50 --eval-draft-lengths 3 7 "$@" \
    --work-dir .train/$name --out .train/${name}_out >> .train/$name.log 2>&1 || exit 1
  cp .train/${name}_out/train_report.json .train/$name/report_$stop.json
}
run leg3 600 --layers 1 --init-from .train/big2_out
run grow2 600 --layers 2 --init-from .train/big2_out --grow
