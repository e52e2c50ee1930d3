#!/bin/bash
# Forty-ninth session: Qwen3-8B at a rollout's 4096-token context with the current defaults (last measured in
# the seventeenth to nineteenth sessions, before the wgmma, attention and fusion work since): BF16 weights and
# KV (the baseline), W4A16 with the NVFP4 cache (the mission's rollout: profiled at batch 32), with the BF16
# and with the FP8 cache, batch 1 / 8 / 32, each arm a fresh process. Up to ~480 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler157_8b4k
arm bf16 120 1,8,32 "--presets bf16 --prompt 4096 --profile-batch=" X=0
arm nvfp4kv 140 1,8,32 "--kv nvfp4 --prompt 4096 --profile-batch=32 --profile-kv nvfp4" X=0
arm bf16kv 110 1,8,32 "--prompt 4096 --profile-batch=" X=0
left=$((${END:-585} - SECONDS)); [ $left -gt 70 ] && arm fp8kv $left 1,8,32 "--kv fp8 --prompt 4096 --profile-batch=" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler157_8b4k_*.json 2>&1 | grep -v "^  " | tail -40
