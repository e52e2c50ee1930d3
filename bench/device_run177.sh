#!/bin/bash
# Fifty-fifth session, last call: ncu on the rule's 32-row wgmma build (24576x4096, NT 1, MG 4, SPLIT 2, DEPTH 2),
# as device_run64 c did before XPRE: its speed-of-light, warp-state and scheduler sections, and the SASS with each
# instruction's stall samples (what bounds it, now that neither fewer instructions, more x reuse nor more steps in
# flight helped: bench/gpu_kernels.md, fifty-fifth session). Up to ~150 s.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 70 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section MemoryWorkloadAnalysis -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py \
  --shapes 24576x4096 --rows 32 --variants wide > $OUT/ncu177_wide32.txt 2>&1
echo "ncu exit $? at ${SECONDS}s"
grep -E 'Duration|Stall|Warp Cycles|Issued Warp|Achieved Occ|Memory Throughput|DRAM Th|L2 Cache Th|Registers|Eligible|Active Warps' \
  $OUT/ncu177_wide32.txt | head -24
timeout 70 ncu --clock-control none --set full --import-source no --page source --print-source sass \
  -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py --shapes 24576x4096 --rows 32 --variants wide \
  > $OUT/ncu177_sass_wide32.txt 2>&1
echo "sass exit $? at ${SECONDS}s"; wc -l $OUT/ncu177_sass_wide32.txt
