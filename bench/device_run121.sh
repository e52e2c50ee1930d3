#!/bin/bash
# Thirty-ninth session. 1) The defaults against BF16 on Qwen3-30B-A3B at batch 1 with the preset's BF16 lm_head
# and with the NVFP4 one (the rule ('lm_head', 'w4a16'); 0.1 ms of the step in the seventeenth session):
# device_run122's arms with the time the NVFP4-head row needs. 2) If time is left (CAP, seconds), device_run120's
# ncu of the PRENORM mma16 GEMM against the plain launch (Qwen3-8B's gate/up and q/k/v at one row, isolated).
SECONDS=0
DEF_LIMIT=220 END=370 PREFIX=sampler121_30b bash bench/device_run122.sh
left=$((${CAP:-585} - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis -k regex:w4a16 --launch-count 12 \
      python3 bench/prenorm_ncu.py > $OUT/prenorm_ncu.log 2>&1
  echo "ncu exit $? at ${SECONDS}s"
  grep -v "^==PROF==" $OUT/prenorm_ncu.log | grep -E "w4a16_mma16|Duration|Stall|Warp Cycles Per Issued|Registers Per|Dynamic Shared|Theoretical Occupancy|Achieved Occupancy|Grid Size|L2 Hit|Mem Busy|Max Bandwidth|Memory Throughput" | cut -c1-140 | head -150
fi
