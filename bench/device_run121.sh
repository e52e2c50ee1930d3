#!/bin/bash
# Thirty-ninth session. 1) The defaults against BF16 on Qwen3-30B-A3B at batch 1 (3 generates per arm now; a
# regression check of the default path, untimed on an H200 since the thirty-sixth session), with the preset's
# BF16 lm_head and with the NVFP4 one (the rule ('lm_head', 'w4a16'); 0.1 ms of the step in the seventeenth
# session): full depth on an H200, 24 layers on an H100 (80 GB). 2) If time is left, device_run120's ncu of the
# PRENORM mma16 GEMM against the plain launch (Qwen3-8B's gate/up and q/k/v at one row, isolated launches).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
source bench/sampler_arm.sh
depth=24; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && depth=48
ARM_SHAPE=qwen3-30b-a3b:$depth ARM_PREFIX=sampler121_30b
arm defaults 220 1 "--profile-batch= --lm-head bf16,w4a16" X=0
arm bf16 150 1 "--profile-batch= --presets bf16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler121_*.json
left=$((${CAP:-585} - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis -k regex:w4a16 --launch-count 12 \
      python3 bench/prenorm_ncu.py > $OUT/prenorm_ncu.log 2>&1
  echo "ncu exit $? at ${SECONDS}s"
  grep -v "^==PROF==" $OUT/prenorm_ncu.log | grep -E "w4a16_mma16|Duration|Stall|Warp Cycles Per Issued|Registers Per|Dynamic Shared|Theoretical Occupancy|Achieved Occupancy|Grid Size|L2 Hit|Mem Busy|Max Bandwidth|Memory Throughput" | cut -c1-140 | head -150
fi
