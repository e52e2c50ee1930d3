#!/bin/bash
# Seventeenth session. The NVFP4 KV cache written by the fused step's q/k-norm + RoPE kernel (gpu_decode.
# FUSED_KV_FP4) instead of store_kv's quantize + six index copies per layer: its GPU tests, then Qwen3-8B at
# 4096-token context with both writes (--kv-write fused,separate), BF16 in the same process.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 120 python3 -m pytest -q -m "gpu or not slow" tests/test_fused_kernels.py tests/test_gpu_decode.py \
  -k "nvfp4_cache or graphs_replay_the_eager" > $OUT/tests62.log 2>&1
echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests62.log | tail -12
timeout 400 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
  --w4a16-last 0 --batch 1,8,32 --kv bf16,nvfp4 --kv-write fused,separate --prompt 4096 --repeats 2 \
  --tokens 8,40 --profile-batch '' --out $OUT/sampler62_8b_4k.json > $OUT/sampler62_8b_4k.log 2>&1
echo "8b exit $?"; grep '^|\|rror' $OUT/sampler62_8b_4k.log | cut -c1-300 | tail -24
