#!/bin/bash
# Thirty-sixth session, after device_run107 / 108: the CUDA router + route (FP4RL_MOE_ROUTER_CUDA=1) took the
# 30B's batch-1 step from 2.13 to 1.97 ms but batch 8 from 4.25 to 4.34 (now the default at one token). Here the
# Triton route and that arm (up to 8 tokens) at batch 1 / 2 / 4 / 8, each a fresh process, to find the token count
# up to which it should be the default (gpu_experts.ROUTER_CUDA_MAX_TOKENS); then, if time is left, BF16 at the
# same batches. Up to ~595 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler109
arm router_cuda 230 1,2,4,8 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=1 FP4RL_MOE_ROUTER_CUDA_MAX=8
arm triton_route 190 1,2,4,8 "--profile-batch=" FP4RL_MOE_ROUTER_CUDA=0
if [ $SECONDS -lt 440 ]; then  # BF16 at the same batches for the ratios (~66 s of the arms is the build)
  arm bf16 $((590 - SECONDS)) 1,2,4,8 "--profile-batch= --presets bf16" X=0
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler109_*.json 2>&1 | tail -30
