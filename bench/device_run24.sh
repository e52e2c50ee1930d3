#!/bin/bash
# Device call 24 (sixth session): GPU tests of the mma16/wgmma kernel, then the standard GEMM table (Triton path,
# the CUDA kernel's dispatch through the mma16 copy, cuBLAS BF16, same run) at 1-512 rows.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-200} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -x ${T_K:+-k "$T_K"} 2>&1 | grep -v "^$" | tail -8
timeout ${T_B:-400} python3 -m fp4rl.benchmarks.gpu_kernels --sections gemm ${B_ROWS:+--rows $B_ROWS} \
  ${B_SHAPES:+--shapes $B_SHAPES} --out $OUT/gk24.json 2>&1 | grep -v "^\[\|precompile" | tail -${NL:-60}
