#!/bin/bash
# Device call 11 (fourth session): the CUDA mma16 W4A16 kernel: GPU tests, then the sweep.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, hasattr(torch.cuda, '_compile_kernel'))"
timeout ${T_TEST:-150} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -x 2>&1 | tee $OUT/mma16_tests11.log | tail -40
timeout ${T_SWEEP:-330} python3 bench/mma16_sweep.py --gluon --rows ${ROWS:-1,8,16,32,64} \
    ${SWEEP_ARGS:-} --out $OUT/mma16_sweep11_h200.json 2>&1 | tee $OUT/mma16_sweep11.log
if [ -n "$NCU" ]; then
  timeout ${T_NCU:-150} ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis -k regex:w4a16 \
      --launch-skip 1 --launch-count 4 python3 bench/mma16_ncu.py > $OUT/mma16_ncu.log 2>&1
  grep -v "^==PROF==" $OUT/mma16_ncu.log | grep -E "w4a16|Duration|Throughput|Busy|Issue|Stall|Warp Cycles|Eligible|Active Warps|Achieved|Theoretical|Block Limit|Cluster|Registers|Shared Memory Config|Waves|L1|L2 Hit|Mem Pipes|No Eligible" | cut -c1-150 | head -150
fi
