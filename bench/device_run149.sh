#!/bin/bash
# Forty-eighth session: the full 48-layer Qwen3-30B-A3B on an H200 with the current defaults (owed since the
# forty-first session; the forty-seventh measured it on an H100 only). BF16 / the defaults / an NVFP4 lm_head at
# batch 1 / 8 / 32, each arm a fresh process with the trainer in host memory while its sampler is built, as long
# as the call allows (END: its last second, 588 by default); the defaults' arm also profiles batch 1 (the kernels of a 48-layer step, for the H100 /
# H200 comparison). Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler149_30b48
arm bf16 200 1,8,32 "--profile-batch= --presets bf16" X=0
arm defaults 210 1,8,32 "--profile-batch=1 --lm-head bf16" X=0
left=$((${END:-588} - SECONDS)); [ $left -gt 60 ] && arm head $left 1,8,32 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler149_30b48_*.json
