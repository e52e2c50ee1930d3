#!/bin/bash
# Device call 26 (sixth session, last): GPU tests of the final wgmma configuration (async-proxy fence, split per
# band of rows) and of the register-lean 4/6 quantizer, then the quantize benchmark with the new 4/6 kernels and,
# in the same call, with the previous blocks.py (bench/_old_blocks_s6.py, shipped untracked for this call).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-110} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "wide or dispatch or w4a4" 2>&1 | grep -v "^$" | tail -4
timeout ${T_Q:-80} python3 -m pytest -q -m gpu tests/test_triton_quantize.py 2>&1 | grep -v "^$" | tail -4
timeout ${T_B:-120} python3 -m fp4rl.benchmarks.gpu_kernels --sections quantize --workers 0 --out $OUT/quant26_new.json 2>&1 \
  | grep "^|\|copy" | tail -12
if [ -f bench/_old_blocks_s6.py ]; then
  cp bench/_old_blocks_s6.py fp4rl/kernels/quantize/blocks.py
  timeout ${T_B:-120} python3 -m fp4rl.benchmarks.gpu_kernels --sections quantize --workers 0 --out $OUT/quant26_old.json 2>&1 \
    | grep "^|\|copy" | tail -12
fi
