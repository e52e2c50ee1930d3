#!/bin/bash
# Device call 8: Gluon MMA GEMV with 16-byte x loads (one lane: 4 x LDG.128 per tile): check + sweep.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
timeout ${T_K:-175} python3 bench/gemv_sweep.py --shapes 4096x14336,14336x4096 --rows 1,4,8,16 --max-cfg 2 \
  --max-triton 1 --check-cfg 1 --out $OUT/sweep8.json > $OUT/sweep8.log 2>&1
grep -v "^[0-9]*x[0-9]* m" $OUT/sweep8.log | tail -3 | cut -c1-300
grep "^[0-9]*x[0-9]* m" $OUT/sweep8.log | sed 's/bf16 *//; s/err [0-9.e-]*//' | cut -c1-110
