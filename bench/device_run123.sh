#!/bin/bash
# Fortieth session. 1) device_run122's arms at full depth on an H200 (24 layers on an H100): Qwen3-30B-A3B's
# defaults at batch 1 with the BF16 and the NVFP4 lm_head, then BF16, each a fresh process (with the step's RoPE
# rows gathered from the engine's table since 6d0da35). 2) If time is left (CAP, seconds): the PRENORM mma16 GEMM
# against the plain launch under ncu (bench/prenorm_ncu.py; device_run121 gave durations, +3.4 / +4.4 us), now
# each stall reason per issued instruction, to tell L2 loads from barriers in its x staging.
SECONDS=0
DEF_LIMIT=${DEF_LIMIT:-240} END=${END:-380} PREFIX=sampler123_30b bash bench/device_run122.sh
left=$((${CAP:-585} - SECONDS))
if [ $left -gt 45 ]; then
  timeout $left ncu --clock-control none --section WarpStateStats --section SpeedOfLight \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      -k regex:w4a16 --launch-count 12 --page raw --csv python3 bench/prenorm_ncu.py > $OUT/prenorm_stalls.csv 2>&1
  echo "ncu exit $? at ${SECONDS}s"
  python3 bench/ncu_stalls.py $OUT/prenorm_stalls.csv
fi
