#!/bin/bash
# Device call 23 (sixth session): where the wgmma configuration's time goes (ncu: speed of light, warp stalls,
# pipes, shared-memory wavefronts) at 128 and 256 rows of 14336x4096.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_NCU:-240} ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section Occupancy -k regex:w4a16 --launch-skip 1 --launch-count 4 \
    python3 bench/wide_ncu.py > $OUT/wide_ncu.log 2>&1
grep -v "^==PROF==" $OUT/wide_ncu.log | grep -vE "^\s*$|----" | cut -c1-160 | head -${NL:-260}
