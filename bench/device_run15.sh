#!/bin/bash
# Device call 15 (fifth session): where the mma16 GEMM's time goes on the four Qwen3-8B decode shapes
# (q/k/v 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288) at 1 and 8 rows: ring depth, split,
# timing-only variants, and PDL with the trigger at the start / after the stream / at exit.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_SWEEP:-300} python3 bench/mma16_sweep.py --rows ${ROWS:-1,8} \
    --variants ${VARIANTS:-auto,d2,d4,d6,d8,s1,s2,s4,s8,t1,t2,t3,pdl+tr0,pdl+tr1,pdl+tr2,pdl+tr2+d6} \
    --shapes ${SHAPES:-4096x4096,6144x4096,24576x4096,4096x12288} --out $OUT/mma16_sweep15.json 2>&1 \
    | tee $OUT/mma16_sweep15.log | grep -v "^\[" | awk '{print $1, $2, $3, $4, $7, $12, $13}'
