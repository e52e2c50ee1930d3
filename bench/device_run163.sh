#!/bin/bash
# Prepared in the fiftieth session for the next: the GPU-marked tests device_run162's 390 s did not reach
# (test_packed, test_quant_cuda, test_stamps, test_triton_attention, test_triton_gemm, test_triton_quantize),
# with (fifty-first session) the grouped switches' tests the EARLY removal rewrote; failures and errors by name (-v: each test's outcome as it ends, so a timeout keeps them).
# tests/test_nvfp4_oracles.py needs the `fouroversix` oracle package, which the device image lacks. Up to ~560 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout ${T_T:-540} python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gemv_cuda_grouped_switches.py tests/test_packed.py tests/test_quant_cuda.py \
    tests/test_stamps.py tests/test_triton_attention.py tests/test_triton_gemm.py tests/test_triton_quantize.py \
    -rfE --durations=8 > $OUT/gpu_suite163.log 2>&1
echo "pytest exit $? at ${SECONDS}s"
grep -E " passed| failed| error|FAILED|ERROR|XPASS|s call" $OUT/gpu_suite163.log | tail -30
