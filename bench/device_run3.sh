#!/bin/bash
# Device call 3: tensor-core GEMV sweep (prefetch depth 1/2, layouts 0/1, layout 2 = no unpack) + GPU GEMM tests.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
timeout ${T_SWEEP:-300} python3 bench/gemv_sweep.py --out $OUT/sweep4.json > $OUT/sweep4.log 2>&1
grep -v "^[0-9]*x[0-9]* m" $OUT/sweep4.log | tail -20
for s in 4096x14336 14336x4096 4096x6144; do for m in m1 m2; do grep "^$s $m" $OUT/sweep4.log | sort -k3 -n | head -3; grep "^$s $m" $OUT/sweep4.log | grep "L2" | head -1; done; done
timeout ${T_TEST:-150} python3 -m pytest tests/test_triton_gemm.py -x -q -m gpu -k "gluon or asm" 2>&1 | tail -3
