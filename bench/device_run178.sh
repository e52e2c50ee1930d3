#!/bin/bash
# Fifty-fifth session, last: does x's L2 traffic keep the 32-row wgmma build from deeper rings? The rule's build
# and depths 3 / 4 with and without x's copies (TIMING 1: x never staged, wrong results, the err column says so)
# on the 8B's two largest shapes at 32 rows. If depth 3-4 wins only without x, x's bytes are the lever
# (bench/gpu_kernels.md, fifty-fifth session, Next 1). Up to ~60 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 60 python3 bench/mma16_sweep.py --rows 32 --variants wide,wide+d3,wide+d4+mb3,wide+t1,wide+d3+t1,wide+d4+mb3+t1 \
  --shapes 24576x4096,4096x12288 --out $OUT/sweep178.json > $OUT/sweep178.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep178.log | grep -v '^copy' | cut -c1-100 | tail -14
