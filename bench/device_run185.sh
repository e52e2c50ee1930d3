#!/bin/bash
# Fifty-sixth session, seventh: what separates the WARPS rule's misses (19456x2560: WARPS 4 -8 to -11% at 304
# CTAs) from 24576x4096 / 5120x17408 (WARPS 4 up to +23% / +33%)? WARPS 8 against 4 on wide weights (N 12288,
# 19456, 24576) over K 2048-5120, and on N 5120 / 7168 over K 8192-17408, at 32 and 64 rows. Up to ~120 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 bench/mma16_sweep.py --rows 32,64 --variants wide+wp8,wide+wp4 \
  --shapes 12288x2048,12288x2560,12288x4096,12288x5120,19456x2048,19456x2560,19456x4096,19456x5120,24576x2048,24576x2560,24576x5120,5120x8192,5120x12288,7168x8192,7168x12288 \
  --out $OUT/sweep185.json > $OUT/sweep185.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -c ' us ' $OUT/sweep185.log
