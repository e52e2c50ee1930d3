#!/bin/bash
# Device call 27 (seventh session): the CUDA quantize kernels (fp4rl/kernels/quantize/quant.cu). GPU tests of
# the new kernels and of every quantize test (they take the CUDA path on the GPU), then bench/quant_cuda.py
# (CUDA ALG 2 / ALG 1 / Triton in one run) and the standard quantize section (CUDA vs Triton columns).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout ${T_T:-240} python3 -m pytest -q -x -m "gpu or not gpu" tests/test_quant_cuda.py tests/test_triton_quantize.py 2>&1 \
  | grep -v "^$" | tail -${T_LINES:-6}
timeout ${T_B:-200} python3 bench/quant_cuda.py ${QC_ARGS} --out $OUT/quant_cuda_s7.json 2>&1 | tail -40
if [ -n "$RUN_GK" ]; then
  timeout ${T_G:-150} python3 -m fp4rl.benchmarks.gpu_kernels --sections quantize --workers 0 --out $OUT/quant27_gk.json 2>&1 \
    | grep "^|\|copy" | tail -12
fi
if [ -n "$QC2_ARGS" ]; then
  timeout ${T_B2:-120} python3 bench/quant_cuda.py ${QC2_ARGS} --out $OUT/quant_cuda_s7_2.json 2>&1 | tail -12
fi
