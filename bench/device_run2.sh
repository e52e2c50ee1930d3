#!/bin/bash
# Device call 2: Gluon GEMV variants (FP32-FMA and tensor-core, standard and gemv32 layouts) sweep.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
timeout ${T_SWEEP:-420} python3 bench/gemv_sweep.py --out $OUT/sweep2.json > $OUT/sweep2.log 2>&1
grep -v "^[0-9]*x[0-9]* m" $OUT/sweep2.log | tail -20
for s in 4096x14336 14336x4096 4096x6144; do for m in m1 m2; do grep "^$s $m" $OUT/sweep2.log | sort -k3 -n | head -4; done; done
