#!/bin/bash
# Ninth session: Qwen3-30B-A3B at 24 of 48 layers, BF16 and W4A16, batch 8 and 32, best of 3 repeats per point.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:24 --presets bf16,nvfp4-w4a16 --batch 8,32 \
  --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler41_30b24.json \
  > $OUT/sampler41_30b24.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler41_30b24.log | cut -c1-300 | tail -6
