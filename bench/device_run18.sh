#!/bin/bash
# Device call 18 (fifth session): XSTREAM (x in 128-k chunks through a CTA ring with the weights) for 17-32
# rows: its GPU correctness test, then a sweep at 16 and 32 rows on the Qwen3-8B decode shapes.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-120} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "kernel_matches_reference" -x \
  2>&1 | tee $OUT/gputests18.log | grep -v "^$" | tail -8
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_SWEEP:-150} python3 bench/mma16_sweep.py --rows ${ROWS:-16,32} \
    --variants ${VARIANTS:-auto,xs1+d2,xs1+d3,xs1+d4,xs1+d3+s1,xs1+d3+s2,xs1+d3+s4,xs1+d3+s8} \
    --shapes ${SHAPES:-4096x4096,6144x4096,24576x4096,4096x12288} --out $OUT/mma16_sweep18.json 2>&1 \
    | tee $OUT/mma16_sweep18.log | grep -v "^\[" | awk '{print $1, $2, $3, $4, $6, $7, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21}'
