#!/bin/bash
# Device call 13 (fourth session, final): every GPU test of the changed code, then the samplers: Qwen3-8B at
# batch 1, 8, 32 (fused step on / off, mma16 decode copies for W4A16 and W4A4) and Qwen3-30B-A3B (12 of 48
# layers) at batch 1, 8 with the fused step.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${T_T:-420} python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gpu_decode.py \
  tests/test_fused_kernels.py tests/test_triton_attention.py tests/test_triton_quantize.py tests/test_triton_gemm.py \
  2>&1 | tee $OUT/gputests13.log | grep -v "^$" | tail -20
echo "tests exit ${PIPESTATUS[0]}"
timeout ${T_B:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --fusion on,off --out $OUT/sampler13_8b.json \
  > $OUT/sampler13_8b.log 2>&1
echo "exit $?"; grep '^|\|^profile\|Traceback\|Error' $OUT/sampler13_8b.log | cut -c1-400 | tail -30
timeout ${T_C:-110} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --out $OUT/sampler13_30b.json \
  > $OUT/sampler13_30b.log 2>&1
echo "exit $?"; grep '^|\|Traceback\|Error' $OUT/sampler13_30b.log | tail -12
