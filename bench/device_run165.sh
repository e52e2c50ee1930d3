#!/bin/bash
# Fifty-first session: the FP8 cache's one-CTA split rule (FP8_TUNE long_split, fiftieth session) timed in the
# sampler. Qwen3-8B (36 layers), W4A16, FP8 KV cache; at each shape the rule changes (batch 4 / 8 at 1K, batch
# 4 at 2K, batch 2 at 4K) the default against FP4RL_FP8_LONG_SPLIT=0 (the two-CTA grid rule and the cap, as
# timed before), alternating in fresh processes. Up to ~560 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler165_8b_fp8kv
for pb in 1024:4,8 2048:4 4096:2; do
  p=${pb%%:*} b=${pb#*:}
  left=$((${END:-555} - SECONDS)); [ $left -gt 100 ] || break
  arm p${p}_default 90 "$b" "--kv fp8 --prompt $p --profile-batch=" X=0
  arm p${p}_long0 90 "$b" "--kv fp8 --prompt $p --profile-batch=" FP4RL_FP8_LONG_SPLIT=0
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler165_*.json
