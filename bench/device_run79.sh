#!/bin/bash
# Twenty-eighth session: the RELOAD row kernel keeping its block maxima from the first read in shared memory
# (no second block max per block) against commit 30d1745's (bench/data/s28/quant_30d1745.cu, "prev").
#   mode a: timings, every row checked against the reference; ncu per-line counts of the row kernel again;
#     the quantize GPU tests.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 200 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,16384x4096,4096x4096 \
    --modes "row 4/6 mse,row 4/6 mae" --variants cuda,prev,fast2 --check-rows 0 \
    --prev-source bench/data/s28/quant_30d1745.cu --out "$OUT/quant79_a.json"
  timeout 100 ncu --section SourceCounters --kernel-name nvfp4_quant_rows -o "$OUT/src79" -f \
    python3 bench/quant46_ncu.py 3 2>&1 | tail -1
  ncu --import "$OUT/src79.ncu-rep" --page source --print-source sass --csv > "$OUT/src79_sass.csv" 2>/dev/null
  rm -f "$OUT/src79.ncu-rep"
  timeout 220 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py 2>&1 | tail -4
  ;;
*) echo "mode a"; exit 2 ;;
esac
