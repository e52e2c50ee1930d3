#!/bin/bash
# Device call 9 (session 3): Gluon NVFP4 decode attention: checks, timing vs SDPA / Triton / FP8; GPU tests.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tail -1
timeout ${T_A:-330} python3 bench/attn9.py --out $OUT/attn9.json ${ATTN_ARGS} > $OUT/attn9.log 2>&1
grep -v "^check {\|^bench {" $OUT/attn9.log | tail -30 | cut -c1-260
if [ -n "$RUN_TESTS" ]; then
  timeout ${T_T:-200} python3 -m pytest -q -m gpu $RUN_TESTS > $OUT/gputests.log 2>&1
  tail -5 $OUT/gputests.log
fi
if [ -n "$RUN_QUANT" ]; then
  timeout ${T_Q:-200} python3 bench/quant9.py --out $OUT/quant9.json > $OUT/quant9.log 2>&1
  grep -v "^bench {" $OUT/quant9.log | tail -22 | cut -c1-200
fi
if [ -n "$NCU" ]; then
  timeout ${T_N:-200} ncu --clock-control none --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:decode_attn python3 bench/attn9_ncu.py > $OUT/ncu.log 2>&1
  grep -E "decode_attn|duration|warps_active|dram__" $OUT/ncu.log | tail -40 | cut -c1-160
fi
if [ -n "$ATTN2_ARGS" ]; then
  timeout ${T_A2:-200} python3 bench/attn9.py --out $OUT/attn9b.json ${ATTN2_ARGS} > $OUT/attn9b.log 2>&1
  grep -v "^check {\|^bench {" $OUT/attn9b.log | tail -30 | cut -c1-260
fi
if [ -n "$RUN_GK" ]; then
  timeout ${T_G:-200} python3 -m fp4rl.benchmarks.gpu_kernels --sections copy,quantize,attention --workers 0 \
    --out $OUT/gpu_kernels9.json > $OUT/gpu_kernels9.log 2>&1
  grep -A30 "^## quantize\|^## decode attention" $OUT/gpu_kernels9.log | cut -c1-200 | head -30
fi
if [ -n "$QNCU" ]; then
  timeout ${T_N:-200} ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,launch__registers_per_thread,launch__occupancy_limit_registers -k regex:quantize\|amax python3 bench/quant9_ncu.py > $OUT/qncu.log 2>&1
  grep -E "_kernel|duration|throughput|warps_active|issue_active|bytes|registers" $OUT/qncu.log | tail -48 | cut -c1-130
fi
