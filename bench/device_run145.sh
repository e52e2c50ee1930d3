#!/bin/bash
# Forty-seventh session: Qwen3-30B-A3B at 24 of its 48 layers (the full model does not fit an H100 in the NVFP4 arm) at batch 1 / 8 / 32, BF16 / the defaults (W4A16 every
# decoder linear, BF16 lm_head) / the defaults with an NVFP4 lm_head, each arm a fresh process, on whichever card
# comes (batch 8 and 32 last measured in the seventeenth to twenty-third sessions on an H200). Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler145_30b
arm bf16 190 1,8,32 "--profile-batch= --presets bf16" X=0
arm defaults 190 1,8,32 "--profile-batch= --lm-head bf16" X=0
arm head $((588 - SECONDS)) 1,8,32 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler145_30b_*.json
