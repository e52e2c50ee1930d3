#!/bin/bash
# Device call 28 (seventh session): GPU regression with the CUDA quantize kernels as the default on CUDA
# (the fused decode kernels, W4A4 GEMMs, the sampler, the model and the reference all meet quantize_2d).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_A:-300} python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_kernels.py tests/test_triton_gemm.py \
  tests/test_nvfp4_reference.py 2>&1 | grep -v "^$" | tail -${T_LINES:-4}
timeout ${T_B:-280} python3 -m pytest -q -m gpu tests/test_gpu_decode.py tests/test_model.py tests/test_gemv_cuda.py \
  tests/test_triton_attention.py 2>&1 | grep -v "^$" | tail -${T_LINES:-4}
