#!/bin/bash
# Fifty-sixth session, third: where WARPS 4 (one warpgroup a CTA) wins, for a rule: the mma.sync rule (auto), the
# wgmma rule (wide) and WARPS 4 with the wide rule's split, twice it, and a 3-deep ring, on six Qwen3-8B-class
# shapes at 1-64 rows (device_run180: -5% summed at 32 rows, -8% against auto at 8 rows). Up to ~240 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 400 python3 bench/mma16_sweep.py --rows 1,4,8,12,16,24,32,48,64 \
  --variants auto,wide,wide+wp4,wide+wp4+s2x,wide+wp4+d3,wide+wp4+s2x+d3,wide+wp4+sh \
  --shapes 4096x4096,6144x4096,24576x4096,4096x12288,14336x4096,4096x14336 --out $OUT/sweep181.json > $OUT/sweep181.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -c us $OUT/sweep181.log; grep FAILED $OUT/sweep181.log | head
