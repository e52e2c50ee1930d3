#!/bin/bash
# Thirty-fifth session, after device_run106 / 107: the CUDA router + route (FP4RL_MOE_ROUTER_CUDA=1) took batch 1
# from 2.12 to 1.98 ms (batch 8: 4.25 -> 4.34). Here that arm at batch 1, BF16 at batch 1 for the ratio in the same
# session, then the defaults of then (the Triton route), each in a fresh process. Up to ~470 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler108
arm router_cuda 170 1 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=1
arm bf16 150 1 "--profile-batch= --presets bf16" X=0
arm defaults 150 1 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=0  # the Triton route: the default then
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler108_*.json 2>&1 | tail -12
