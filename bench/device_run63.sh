#!/bin/bash
# Seventeenth session, last call (~6 minutes of device time were left): Qwen3-30B-A3B at a rollout's
# 4096-token context, batch 8 and 32, BF16 (weights and cache) against W4A16 with a BF16 and with the NVFP4 KV
# cache (its write fused in the RoPE kernel), one timed generate per row.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --w4a16-last 0 --batch 8,32 --kv bf16,nvfp4 --prompt 4096 --repeats 1 --tokens 8,24 --profile-batch '' \
  --out $OUT/sampler63_30b_4k.json > $OUT/sampler63_30b_4k.log 2>&1
echo "30b exit $?"; grep '^|\|rror' $OUT/sampler63_30b_4k.log | cut -c1-300 | tail -14
