#!/bin/bash
# Fifty-sixth session, sixth: the 8B's headline at batch 24 / 32 with choose_wide's WARPS 4 rule: BF16 weights,
# W4A16 with the rule, W4A16 with FP4RL_WIDE_WARPS=8, each a fresh process (128-token prompts, BF16 KV, full
# depth). Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler184_8b
arm rule 90 24,32 "--profile-batch=" X=0
arm bf16 120 24,32 "--profile-batch= --presets bf16" X=0
arm w8 90 24,32 "--profile-batch=" FP4RL_WIDE_WARPS=8
left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm rule_2 90 24,32 "--profile-batch=" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler184_*.json
