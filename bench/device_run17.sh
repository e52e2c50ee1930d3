#!/bin/bash
# Device call 17 (fifth session, final): GPU tests of everything changed this session, then the samplers with
# everything on (DEPTH 2, TRIGGER 2, grouped mma16 experts, the look-ahead generate loop, PDL on the mma16
# and fused Triton kernels): Qwen3-8B at batch 1, 8, 32 with PDL on / off, Qwen3-30B-A3B (12 of 48 layers)
# at batch 1 and 8.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
python3 -c "import triton; from fp4rl.kernels import pdl; print('triton', triton.__version__, 'pdl', pdl.triton_supported())"
timeout ${T_T:-200} python3 -m pytest -q -m gpu ${TESTS:-tests/test_gemv_cuda.py tests/test_gpu_decode.py tests/test_fused_kernels.py} \
  2>&1 | tee $OUT/gputests17.log | grep -v "^$" | tail -15
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_B:-220} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch ${BATCH:-1,8,32} --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch ${PROF:-1} --fusion on --pdl ${PDL:-on,off} --out $OUT/sampler17_8b.json \
  > $OUT/sampler17_8b.log 2>&1
echo "exit $?"; grep '^|\|^profile\|Traceback\|Error' $OUT/sampler17_8b.log | cut -c1-500 | tail -22
timeout ${T_C:-130} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler17_30b.json \
  > $OUT/sampler17_30b.log 2>&1
echo "exit $?"; grep '^|\|Traceback\|Error' $OUT/sampler17_30b.log | cut -c1-400 | tail -10
