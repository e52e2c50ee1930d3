#!/bin/bash
# Device call 20 (fifth session, last): the WGMMA variant (weights as register A, x^T from shared memory as B) of the
# mma16 kernel: its GPU correctness test at every split and depth, then a sweep at 16, 24 and 32 rows.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 110 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "kernel_matches_reference" -x 2>&1 | grep -v "^$" | tail -12
timeout 60 python3 bench/mma16_sweep.py --rows 32,24,16 --variants auto,xs1+d3+s4,wg1+xs1+d2,wg1+xs1+d3,wg1+xs1+d2+s2,wg1+xs1+d2+s4,wg1+xs1+d2+s8 --shapes 4096x4096,24576x4096,4096x12288,6144x4096 --out $OUT/sweep22.json 2>&1 | grep -v "^\[" | awk '{print $1, $2, $3, $4, $6, $7, $9, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22}'
