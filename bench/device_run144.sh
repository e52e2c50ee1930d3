#!/bin/bash
# Forty-seventh session: Qwen3-8B at full depth (36 layers) at batch 1 / 8 / 32, BF16 / the defaults (W4A16 every
# decoder linear, BF16 lm_head) / the defaults with an NVFP4 lm_head, each arm a fresh process, on whichever card
# comes (the README's 8B row is from the seventeenth session on an H200: 1.91x / 1.72x / 1.31x). Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler144_8b
arm bf16 190 1,8,32 "--profile-batch= --presets bf16" X=0
arm defaults 190 1,8,32 "--profile-batch= --lm-head bf16" X=0
arm head $((588 - SECONDS)) 1,8,32 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler144_8b_*.json
