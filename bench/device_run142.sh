#!/bin/bash
# Forty-sixth session: why the strip kernel's 16x16 4/6 takes 0.173 ms with mse against 0.156 with mae
# (imposed g, 32768x4096 bf16) with the same static instruction counts: ncu's warp state, scheduler and
# instruction statistics of both builds (bench/quant_strip46_diag.py --once: mse twice, then mae twice).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 240 ncu --section WarpStateStats --section SchedulerStats --section InstructionStats \
  --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --kernel-name nvfp4_quant_strip16 \
  -o "$OUT/strip46" -f python3 bench/quant_strip46_diag.py --once 2>&1 | tail -3
ncu --import "$OUT/strip46.ncu-rep" --page details > "$OUT/strip46_details.txt" 2>&1
grep -nE "nvfp4_quant_strip16|Duration|Executed Instructions|Issue Slots|Issued Ipc|Warp Cycles Per Issued|Eligible|Active Warps|Registers|Achieved Occupancy|Stall|No Eligible" \
  "$OUT/strip46_details.txt" | head -120
ncu --import "$OUT/strip46.ncu-rep" --page raw --csv --metrics \
  smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_wait,smsp__average_warp_latency_issue_stalled_math_pipe_throttle,smsp__average_warp_latency_issue_stalled_not_selected,smsp__average_warp_latency_issue_stalled_dispatch_stall,smsp__average_warp_latency_issue_stalled_mio_throttle,smsp__average_warp_latency_issue_stalled_lg_throttle,smsp__average_warp_latency_issue_stalled_selected,smsp__average_warp_latency_issue_stalled_no_instruction,smsp__average_warp_latency_issue_stalled_branch_resolving \
  > "$OUT/strip46_stalls.csv" 2>&1; head -8 "$OUT/strip46_stalls.csv" | cut -c1-900
