#!/bin/bash
# Seventeenth session. The decode step at a rollout's context: Qwen3-8B with 4096-token prompts at batch 1 / 8 /
# 32, BF16 (weights and KV cache) against W4A16 with a BF16 and with an NVFP4 KV cache (the rollout's FP4
# cache), the lm_head BF16 or NVFP4; every ratio against BF16 weights + BF16 KV in the same process.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 570 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 \
  --w4a16-last 0 --batch 1,8,32 --kv bf16,nvfp4 --prompt 4096 --repeats 2 --tokens 8,40 --profile-batch '' \
  --lm-head bf16,w4a16 --out $OUT/sampler61_8b_4k.json > $OUT/sampler61_8b_4k.log 2>&1
echo "8b exit $?"; grep '^|\|rror' $OUT/sampler61_8b_4k.log | cut -c1-300 | tail -24
