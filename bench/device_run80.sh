#!/bin/bash
# Twenty-eighth session: the RELOAD row kernel's second read without the next block prefetched into registers
# (bench/data/s28/quant_noprefetch.cu, "prev": each block loaded at the top of its iteration; 8 moves a block
# fewer) against HEAD's (cuda), every row checked against the reference.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 200 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,16384x4096 \
    --modes "row 4/6 mse,row 4/6 mae" --variants cuda,prev --check-rows 0 \
    --prev-source bench/data/s28/quant_noprefetch.cu --out "$OUT/quant80_a.json"
  ;;
*) echo "mode a"; exit 2 ;;
esac
