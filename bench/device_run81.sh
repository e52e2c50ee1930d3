#!/bin/bash
# Twenty-eighth session, final: the quantize kernels at the session's end (cuda) against its start (commit
# 1a9473a's quant.cu, bench/data/s28/quant_1a9473a.cu, "prev") in the same run, every row checked against the
# reference; then the quantize GPU tests.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 240 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,16384x4096,4096x4096 \
    --modes "row 4/6 mse,row 4/6 mae,tensor 4/6 mse,tensor 4/6 mae,row 6,tensor 6" --variants cuda,prev \
    --check-rows 0 --prev-source bench/data/s28/quant_1a9473a.cu --out "$OUT/quant81_a.json"
  timeout 220 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py 2>&1 | tail -4
  ;;
*) echo "mode a"; exit 2 ;;
esac
