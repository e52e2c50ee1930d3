#!/bin/bash
# Device call 12 (fourth session): GPU tests of everything changed (fused decode kernels, the mma16 kernel and
# its dispatch, the split attention/quantize packages), then the Qwen3-8B sampler: fused step on/off with the
# mma16 decode copies, and the fused step with the Gluon gemv32 copies instead (FP4RL_MMA16=0).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
timeout ${T_T:-170} python3 -m pytest -q -m gpu tests/test_fused_kernels.py tests/test_gpu_decode.py \
  tests/test_gemv_cuda.py tests/test_triton_attention.py tests/test_triton_quantize.py tests/test_triton_gemm.py \
  2>&1 | tee $OUT/gputests12.log | grep -v "^$" | tail -25
timeout ${T_B:-240} python3 -m fp4rl.benchmarks.sampler_gpu --shapes ${SHAPES:-qwen3-8b:36} --batch ${BATCH:-1,8} \
  --kv bf16 --repeats 1 --tokens 8,40 --profile-batch ${PROF:-1} --fusion ${FUSION:-on,off} \
  --out $OUT/sampler12.json > $OUT/sampler12.log 2>&1
echo "exit $?"; grep '^|\|Traceback\|Error' $OUT/sampler12.log | tail -24
if [ -n "$NO_MMA16_RUN" ]; then
  FP4RL_MMA16=0 timeout ${T_C:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8 \
    --kv bf16 --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --out $OUT/sampler12_gemv32.json \
    > $OUT/sampler12_gemv32.log 2>&1
  echo "exit $?"; grep '^|\|Traceback\|Error' $OUT/sampler12_gemv32.log | tail -12
fi
