#!/bin/bash
# Twenty-eighth session: where the 4/6 row kernel's instructions go. ncu counted ~583 warp instructions per
# 32-element warp block for RELOAD 1 (32768x4096 MSE), against ~450 on the common path of the static SASS:
# instruction counts per SASS line (SourceCounters), exported as CSV.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 200 ncu --section SourceCounters --section InstructionStats --kernel-name nvfp4_quant_rows \
    -o "$OUT/src77" -f python3 bench/quant46_ncu.py 3 2>&1 | tail -3
  ncu --import "$OUT/src77.ncu-rep" --page source --print-source sass --csv > "$OUT/src77_sass.csv" 2> "$OUT/err.txt" \
    || ncu --import "$OUT/src77.ncu-rep" --page source --csv > "$OUT/src77_sass.csv" 2>> "$OUT/err.txt"
  cat "$OUT/err.txt" | head -5
  wc -l "$OUT/src77_sass.csv"; head -3 "$OUT/src77_sass.csv" | cut -c1-600
  ncu --import "$OUT/src77.ncu-rep" --page details 2>&1 | grep -iE "executed|instructions|branch|divergen" | head -20
  ;;
*) echo "mode a"; exit 2 ;;
esac
