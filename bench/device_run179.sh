#!/bin/bash
# Fifty-sixth session, first: does the weights' DRAM layout bound the decode GEMMs? The rule's builds against WL 1
# (the weight copy re-laid so that a CTA's 8 n-tiles of a 128-k step are one 8 KB run of words and one 2 KB run of
# scales, bench/mma16_sweep.interleave, instead of 8 x 1 KB pieces S KB apart), with the full kernel and its bare
# weight stream (TIMING 3: no x, no unpack / MMA; wrong results), on the 8B's four shapes at 1, 8 and 32 rows
# (bench/gpu_kernels.md, fifty-fifth session, Next 1). Up to ~150 s. WL and the sweep's wl1 / interleave were
# removed after this run (no change: bench/RESULTS.md, fifty-sixth session); they are in commit d5febdb.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 bench/mma16_sweep.py --rows 1,8,32 \
  --variants auto,wl1,t3,t3+wl1,wide,wide+wl1,wide+t3,wide+t3+wl1 \
  --shapes 4096x4096,6144x4096,24576x4096,4096x12288 --out $OUT/sweep179.json > $OUT/sweep179.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep179.log | cut -c1-110 | tail -60
