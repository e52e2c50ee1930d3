#!/bin/bash
# First device call of the next session (prepared in the seventh, not yet run): the GPU tests that the seventh
# session's device time did not cover (the review fixes of the CUDA quantizer, the cleaned-up attention loop),
# then the final code's quantize and attention figures.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_A:-300} python3 -m pytest -q -m "gpu or not gpu" tests/test_quant_cuda.py tests/test_triton_quantize.py \
  tests/test_triton_attention.py tests/test_cuda_sources.py -rf 2>&1 | grep -v "^$" | tail -${T_LINES:-8}
timeout ${T_B:-150} python3 -m fp4rl.benchmarks.gpu_kernels --sections quantize --workers 0 --out $OUT/quant30_gk.json 2>&1 \
  | grep "^|\|copy" | tail -12
timeout ${T_C:-150} python3 bench/attn_s7.py 32768 2>&1 | tail -8
