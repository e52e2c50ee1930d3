#!/bin/bash
# Eighth session: Nsight Compute on the Gluon NVFP4 decode attention at 32K (default mode 4, no-unpack mode 5).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
for m in 4 5; do
  timeout 200 ncu --clock-control none -k regex:decode_attn -s 1 -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    python3 bench/attn_ncu.py 32768 $m > $OUT/ncu_attn_m$m.txt 2>&1
  grep -E "Duration|Throughput|Stall|Issue|Eligible|Active Warps|Warp Cycles|Pipe|Registers|Achieved|Busy|Hit Rate|Bandwidth" \
    $OUT/ncu_attn_m$m.txt | head -60
done
timeout 200 ncu --clock-control none -k regex:decode_attn -s 1 -c 1 --metrics \
  smsp__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio \
  python3 bench/attn_ncu.py 32768 4 2>&1 | tail -16
