#!/bin/bash
# Thirty-eighth session, on an H100 (80 GB: the full 48-layer 30B's NVFP4 arm ran out of memory there in
# device_run116). The three launch folds against the defaults in one call: Qwen3-30B-A3B at half depth (24 of its
# 48 layers: the A/B and the BF16 ratio of that model, same call) at batch 1 / 8, defaults / all three flags /
# BF16; then Qwen3-8B (36 layers) at batch 1 / 8, defaults against FP4RL_ATTN_ROPE + FP4RL_DENSE_NORM (its
# applicable folds). Each arm a fresh process; folds that fell back are printed. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler117_30b
arm defaults 115 1,8 "--profile-batch=" X=0
arm all3 115 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1 FP4RL_MOE_ROUTER_NORM=1 FP4RL_DENSE_NORM=1
grep -i "disabled\|failed" $OUT/sampler117_30b_all3.log | sort | uniq -c | head
arm bf16 130 1,8 "--profile-batch= --presets bf16" X=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler117_8b
arm defaults 105 1,8 "--profile-batch=" X=0
arm folds $((588 - SECONDS)) 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1 FP4RL_DENSE_NORM=1
grep -i "disabled\|failed" $OUT/sampler117_8b_folds.log | sort | uniq -c | head
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler117_30b_*.json
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler117_8b_*.json
