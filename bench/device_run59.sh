#!/bin/bash
# Sixteenth session, last call. `ncu`: where a one-row decode GEMM and the router + route kernel spend their
# time (gpu_kernels.md, sixteenth session, items 1-2): Nsight Compute's warp-state and source counters on
# Qwen3-30B-A3B's q/k/v GEMM (5120x2048, 1 row, the chosen in-CTA split) and on router_route at 1 token.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
NCU="ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SourceCounters"
if [ "$1" = ncu ]; then
  timeout 200 $NCU -k regex:w4a16_mma16 -c 2 python3 bench/mma16_sweep.py --shapes 5120x2048 --rows 1 \
    --variants auto > $OUT/ncu_mma16_qkv_1row.txt 2>&1
  echo "gemm exit $?"; grep -E 'Duration|Stall|Warp Cycles|Issued Warp|Achieved Occ|Memory Throughput|DRAM Th|Registers|Block Size|Grid Size' \
    $OUT/ncu_mma16_qkv_1row.txt | head -40
  timeout 150 $NCU -k regex:router_route -c 2 python3 bench/moe_route_bench.py router > $OUT/ncu_router.txt 2>&1
  echo "router exit $?"; grep -E 'Duration|Stall|Warp Cycles|Issued Warp|Achieved Occ|Registers|Block Size|Grid Size' \
    $OUT/ncu_router.txt | head -30
  exit 0
fi
if [ "$1" = keyed ]; then  # the route's top-k on packed keys: GPU tests, then its time against the two-pass form
  timeout 150 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py > $OUT/tests_keyed_s16.log 2>&1
  echo "tests exit $?"; tail -3 $OUT/tests_keyed_s16.log
  timeout 150 python3 bench/moe_route_bench.py keyed > $OUT/route_keyed_s16.log 2>&1
  echo "bench exit $?"; tail -8 $OUT/route_keyed_s16.log
  exit 0
fi
if [ "$1" = bal ]; then  # ncu: q/k/v's 160 CTAs on 132 SMs keep SMs idle 36% of the call; twice the split
  timeout 140 python3 bench/mma16_sweep.py --shapes 5120x2048,6144x4096,2048x4096 --rows 1,4,8,16 \
    --variants auto,s2x,pdl,pdl+s2x --out $OUT/mma16_bal_s16.json > $OUT/mma16_bal_s16.log 2>&1
  echo "sweep exit $?"; grep -v '^{' $OUT/mma16_bal_s16.log | cut -c1-150 | tail -52
  exit 0
fi
if [ "$1" = sass ]; then  # warp-stall samples per SASS instruction of the one-row q/k/v GEMM (next session's item 1)
  timeout 150 ncu --clock-control none --set full --import-source no --page source --print-source sass \
    -k regex:w4a16_mma16 -c 1 python3 bench/mma16_sweep.py --shapes 5120x2048 --rows 1 --variants auto \
    > $OUT/ncu_sass_qkv_1row.txt 2>&1
  echo "sass exit $?"; wc -l $OUT/ncu_sass_qkv_1row.txt; grep -v '^ *$' $OUT/ncu_sass_qkv_1row.txt | head -5
  exit 0
fi
echo "usage: bash bench/device_run59.sh ncu|keyed|bal|sass"; exit 2
