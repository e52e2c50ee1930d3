#!/bin/bash
# Device call 16 (fifth session): the grouped mma16 experts. GPU tests of the GEMM and the decode engine, then
# Qwen3-30B-A3B (12 of 48 layers) at batch 1 and 8 (BF16, W4A16, W4A4 experts; fused step, PDL on).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-240} python3 -m pytest -q -m gpu ${TESTS:-tests/test_gemv_cuda.py tests/test_gpu_decode.py} \
  2>&1 | tee $OUT/gputests16.log | grep -v "^$" | tail -25
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_C:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch ${BATCH:-1,8} --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch ${PROF:-1} --fusion on --pdl on --out $OUT/sampler16_30b.json \
  > $OUT/sampler16_30b.log 2>&1
echo "exit $?"; grep '^|\|^profile\|Traceback\|Error' $OUT/sampler16_30b.log | cut -c1-600 | tail -14
