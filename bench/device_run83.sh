#!/bin/bash
# Twenty-eighth session: RELOAD for long rows (>= 512 blocks, K >= 8192) from 1 wave of threads
# (cuda.RELOAD46_MIN_WAVES_LONG) instead of 2: cuda (the launcher's choice) against 8 and 4 blocks a thread read
# twice and the blocks held in registers (fast3).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 300 python3 bench/quant_cuda.py --shapes 1024x14336,2048x14336,4096x14336,8192x14336,2048x8192,4096x8192 \
    --modes "row 4/6 mse" --variants cuda,reload_bpt8,reload_bpt4,fast3 --check-rows 0 --out "$OUT/quant83_a.json"
  ;;
*) echo "mode a"; exit 2 ;;
esac
