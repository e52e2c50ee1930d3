#!/bin/bash
# Device call 25 (sixth session): GPU tests of the kernels and the decode engine with the wgmma configuration
# dispatched at 17-64 rows, then Qwen3-8B at batch 1 and 32 (W4A16 / W4A4 / BF16 in the same engine).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout ${T_T:-300} python3 -m pytest -q -m gpu ${TESTS:-tests/test_gemv_cuda.py tests/test_gpu_decode.py} \
  2>&1 | tee $OUT/gputests25.log | grep -v "^$" | tail -12
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_B:-200} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch ${BATCH:-1,32} --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler25_8b.json \
  > $OUT/sampler25_8b.log 2>&1
echo "exit $?"; grep '^|\|^profile\|Traceback\|Error' $OUT/sampler25_8b.log | cut -c1-500 | tail -22
