#!/bin/bash
# Fifty-fifth session, third call: the plain wgmma build with its registers bounded (MINB; offline at 32 rows: 60
# registers unbounded, 4 CTAs a SM; MINB 5 48 registers with 40 B of spills, 5 CTAs; depth 3 with MINB 4 64
# registers, no spills, 4 CTAs in 225 KB, where the unbounded depth 3 has fewer) on the 8B's four shapes at 32
# rows (two at 64), cuBLAS BF16 in the same run. Up to ~120 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 100 python3 bench/mma16_sweep.py --rows 32 --variants wide,wide+mb5,wide+d3,wide+d3+mb4,wide+d4+mb3 \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288 --out $OUT/sweep176_32.json > $OUT/sweep176.log 2>&1
echo "sweep exit $? at ${SECONDS}s"
timeout 50 python3 bench/mma16_sweep.py --rows 64 --variants wide,wide+d3+mb4 \
  --shapes 24576x4096,4096x12288 --out $OUT/sweep176_64.json >> $OUT/sweep176.log 2>&1
echo "sweep64 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep176.log | grep -v '^copy' | cut -c1-100 | tail -26
