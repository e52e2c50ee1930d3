#!/bin/bash
# Forty-seventh session: the full 48-layer Qwen3-30B-A3B's BF16 arm on an 80 GB card after fuse_linears frees
# each group's unfused weights as it goes (device_run147: the BF16 copy peaked at 57.8 + 36 GiB inside
# fuse_linears). BF16 at batch 1 / 8 / 32; the NVFP4 arms are device_run146's (the same session, an H100).
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler148_30b48
arm bf16 ${LIMIT:-330} 1,8,32 "--profile-batch= --presets bf16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler148_30b48_*.json
