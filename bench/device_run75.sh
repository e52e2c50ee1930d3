#!/bin/bash
# Superseded in the twenty-eighth session (not run): device_run76.sh took the ncu of RELOAD (mode b), device_run82.sh
# and device_run83.sh where RELOAD pays (mode a).
# Prepared in the twenty-seventh session for the next one (not yet run): the 4/6 row kernel reading each block
# twice (quant.cu RELOAD, on by default from 2 waves of threads).
#   mode a: where RELOAD starts to pay (sizes between the measured 4096x4096 and 32768x4096), 8 and 4 blocks a
#     thread against the blocks held in registers (fast3), MSE and MAE, bytes checked against the reference.
#   mode b: ncu on the RELOAD kernel (32768x4096): stall reasons per issued instruction and pipe use, as call b of
#     bench/device_run74.sh took them for the kernel before it.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 300 python3 bench/quant_cuda.py --shapes 6144x4096,8192x4096,12288x4096,16384x4096,2048x14336 \
    --modes "row 4/6 mse,row 4/6 mae" --variants cuda,reload_bpt8,reload_bpt4,fast3,fast2 \
    --out "$OUT/quant75_a.json"
  ;;
b)
  timeout 200 ncu --clock-control none --kernel-name nvfp4_quant_rows --section LaunchStats --section Occupancy \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_(alu|fma|fmaheavy|fmalite|lsu)\.avg\.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum" \
    python3 bench/quant46_ncu.py 3 > "$OUT/ncu_reload75.txt" 2>&1
  grep -vE "^\s*$|----" "$OUT/ncu_reload75.txt" | grep -E "launched|Registers|Achieved Occ|stalled|pipe|issue_active|inst_exec|duration" | \
    awk '$NF != "0" && $NF != "0.00"' | head -40
  ;;
*) echo "mode a or b"; exit 2 ;;
esac
