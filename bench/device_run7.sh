#!/bin/bash
# Device call 7: GPU tests only (decode engine with gemv32 copies on tiny models, Gluon GEMV every config).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_TEST:-170} python3 -m pytest tests/test_gpu_decode.py tests/test_triton_gemm.py -q -m gpu \
  -k "gemv32 or gluon or w4a16" 2>&1 | tail -8
