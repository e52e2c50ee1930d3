#!/bin/bash
# Prepared in the twenty-eighth session for the next one (not yet run): the GPU tests added after its last device
# call (test_gpu_cuda_nonfinite_unchecked_matches_triton[reload]: NaN / Inf blocks through the RELOAD row kernel,
# whose second read takes the first read's block maxima; an equivalent ad-hoc check passed on the H200 in the
# review), then the whole quantize GPU suite, then ncu's per-line counts of the row kernel after the
# register-prefetch change (bench/data/s28/src79_sass.csv is before it: 522 warp instructions a warp block).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 240 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py tests/test_quant_fast46.py 2>&1 | tail -4
  timeout 100 ncu --section SourceCounters --kernel-name nvfp4_quant_rows -o "$OUT/src84" -f \
    python3 bench/quant46_ncu.py 3 2>&1 | tail -1
  ncu --import "$OUT/src84.ncu-rep" --page source --print-source sass --csv > "$OUT/src84_sass.csv" 2>/dev/null
  rm -f "$OUT/src84.ncu-rep"
  ;;
*) echo "mode a"; exit 2 ;;
esac
