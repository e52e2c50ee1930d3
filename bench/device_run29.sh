#!/bin/bash
# Device call 29 (seventh session): the CUDA quantize kernels' NaN/Inf bytes without allow_nonfinite (now the
# Triton kernels' and the fused decode kernels'), GPU tests of the fused kernels and of both quantizers; then the
# attention loop variants (bench/attn_s7.py) if time is left.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_A:-200} python3 -m pytest -q -m "gpu or not gpu" tests/test_quant_cuda.py tests/test_fused_kernels.py \
  tests/test_triton_quantize.py -rf 2>&1 | grep -v "^$" | tail -${T_LINES:-8}
if [ -n "$RUN_ATTN" ]; then
  timeout ${T_B:-200} python3 bench/attn_s7.py ${ATTN_ARGS} 2>&1 | tail -30
fi
