#!/bin/bash
# Fifty-sixth session, second: the wgmma build with one warpgroup a CTA (WARPS 4: 64 weight rows a CTA, twice the
# CTAs, a CTA barrier per step over 4 warps instead of 8) against the rule's 8-warp build, its split doubled /
# halved and a deeper ring, on the 8B's four shapes at 8, 32 and 64 rows. Why: device_run179 found the 1-row
# KW builds' bare weight stream (many small CTAs, no cluster) 20-45% faster than the wide build's at the same
# bytes. Up to ~120 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 bench/mma16_sweep.py --rows 8,32,64 \
  --variants wide,wide+wp4,wide+wp4+s2x,wide+wp4+sh,wide+wp4+d3 \
  --shapes 4096x4096,6144x4096,24576x4096,4096x12288 --out $OUT/sweep180.json > $OUT/sweep180.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep180.log | cut -c1-140 | tail -62
