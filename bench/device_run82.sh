#!/bin/bash
# Twenty-eighth session: where the RELOAD row kernel starts to pay now that its second read is cheaper
# (cuda.reload_bpt: 8 blocks a thread from 2 x 8 x the thread slots, 4 from 2 x 4 x, else 2 held in registers),
# 8 and 4 blocks a thread against the blocks held (fast3), from 2048x4096 to 32768x4096, mse and mae.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 300 python3 bench/quant_cuda.py --shapes 2048x4096,4096x4096,8192x4096,16384x4096,32768x4096,2048x14336 \
    --modes "row 4/6 mse,row 4/6 mae" --variants cuda,reload_bpt8,reload_bpt4,fast3 --check-rows 0 \
    --out "$OUT/quant82_a.json"
  ;;
*) echo "mode a"; exit 2 ;;
esac
