#!/bin/bash
# Fifty-fifth session, second call: device_run174 found the warp-specialized build (WS) bit-exact but 10-40%
# slower; offline its registers (67 at depth 2, 77-81 at 3-4: 288 threads a CTA) leave 2-3 CTAs per SM against
# the plain build's 4. 1) the WS GPU test's first failure in full; 2) the 8B's four shapes at 32 rows (two at
# 64): the plain build against WS with its registers bounded for 3 / 4 CTAs a SM (WS_MINB; at 4, 40-68 B of
# spills), depths 2 / 3, cuBLAS BF16 in the same run. Up to ~200 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 60 python3 -m pytest -q -x -m gpu tests/test_gemv_cuda_wide.py -k "warp_specialized and 1008" 2>&1 \
  | grep -v "^ \|^$" | grep -i "error\|assert\|fail\|passed" | head -20
echo "test at ${SECONDS}s"
timeout 150 python3 bench/mma16_sweep.py --rows 32 \
  --variants wide,wide+ws1+d2,wide+ws1+d2+minb3,wide+ws1+d2+minb4,wide+ws1+d3+minb3,wide+ws1+d3+minb4 \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288 --out $OUT/sweep175_32.json > $OUT/sweep175.log 2>&1
echo "sweep exit $? at ${SECONDS}s"
timeout 60 python3 bench/mma16_sweep.py --rows 64 --variants wide,wide+ws1+d2+minb3,wide+ws1+d2+minb4 \
  --shapes 24576x4096,4096x12288 --out $OUT/sweep175_64.json >> $OUT/sweep175.log 2>&1
echo "sweep64 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep175.log | grep -v '^copy' | cut -c1-112 | tail -32
