#!/bin/bash
# Tenth session, call 3: where a decode step goes beyond its graph replay (bench/step_gap.py), Qwen3-30B-A3B at
# 12 layers, W4A16 and BF16, batch 1, 8, 32.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
for p in nvfp4-w4a16 bf16; do
  timeout 100 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset $p --batch 1,8,32 \
    --out $OUT/step_gap45_$p.json 2>&1 | grep -v Warn | cut -c1-1500
done
