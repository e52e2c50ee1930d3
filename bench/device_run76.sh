#!/bin/bash
# Run once (mode a) at commit 53abff6, which has RELOAD 2 and the "pipe" variants; they were then taken out
# (slower: bench/gpu_kernels.md, twenty-eighth session). Raw output: bench/data/s28/.
# Twenty-eighth session: the 4/6 row kernel persistent and pipelined (quant.cu RELOAD 2: each group of threads
# loads its next row while it quantizes the current one) against RELOAD 1 and the blocks held in registers.
#   mode a: timings (every row checked against the reference: --check-rows 0), ncu of RELOAD 2 and 1 (stalls,
#     pipes, DRAM bytes, L2 hit rate), then the quantize GPU tests.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "$1" in
a)
  timeout 240 python3 bench/quant_cuda.py --shapes 32768x4096,8192x14336,16384x4096,8192x4096 \
    --modes "row 4/6 mse,row 4/6 mae" --variants cuda,pipe,pipe_bpt4,reload,fast3 --check-rows 0 \
    --out "$OUT/quant76_a.json"
  for r in 2 1; do
    FP4RL_QUANT_RELOAD46=$r timeout 100 ncu --clock-control none --kernel-name nvfp4_quant_rows --section LaunchStats \
      --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_(alu|fma|fmaheavy|lsu)\.avg\.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct" \
      python3 bench/quant46_ncu.py 3 > "$OUT/ncu76_reload$r.txt" 2>&1
    echo "== RELOAD $r"
    grep -vE "^\s*$|----" "$OUT/ncu76_reload$r.txt" | grep -E "launched|Registers|Achieved Occ|Grid Size|stalled|pipe|issue_active|inst_exec|duration|bytes|hit_rate" | \
      awk '$NF != "0" && $NF != "0.00"' | head -40
  done
  timeout 220 python3 -m pytest -q -x -m "gpu or not slow" tests/test_quant_cuda.py 2>&1 | tail -15
  ;;
*) echo "mode a"; exit 2 ;;
esac
