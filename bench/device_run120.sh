#!/bin/bash
# Prepared in the thirty-eighth session (not run: its device time was spent): the PRENORM mma16 GEMM under ncu
# against the plain launch (bench/prenorm_ncu.py: Qwen3-8B's gate/up and q/k/v at one row, isolated launches):
# duration, stall reasons, occupancy. ~150 s.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 170 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --section LaunchStats -k regex:w4a16 --launch-count 12 python3 bench/prenorm_ncu.py > $OUT/prenorm_ncu.log 2>&1
echo "ncu exit $?"
grep -v "^==PROF==" $OUT/prenorm_ncu.log | grep -E "w4a16_mma16|Duration|Stall|Warp Cycles Per Issued|Registers Per|Dynamic Shared|Static Shared|Theoretical Occupancy|Achieved Occupancy|Grid Size|Block Limit Shared|Block Limit Reg" | cut -c1-140 | head -170
