#!/bin/bash
# Prepared in the thirty-eighth session (no device lent). Qwen3-30B-A3B (48 layers, W4A16, BF16 KV) at batch 1 / 8
# with all three launch-folding flags against its defaults: FP4RL_ATTN_ROPE=1 (q/k-norm + RoPE + cache write in the
# attention), FP4RL_MOE_ROUTER_NORM=1 (the post-attention add + RMSNorm in the CUDA router), FP4RL_DENSE_NORM=1 (the
# input add + RMSNorm, with the previous layer's MoE combine, in the q/k/v mma16 GEMM: PRENORM 2): three launches
# fewer a layer at batch 1 (2.5x BF16 needs the step at ~1.86 ms from 1.96). Then DENSE_NORM alone at batch 1 / 8,
# and BF16 for the ratios if the time is there. Up to ~590 s. Run after device_run114 (whose GPU tests cover the
# PRENORM 2 build) or device_run111.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler115
arm defaults 130 1,8 "--profile-batch=" X=0
arm all3 130 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1 FP4RL_MOE_ROUTER_NORM=1 FP4RL_DENSE_NORM=1
arm dense_norm 130 1,8 "--profile-batch=" FP4RL_DENSE_NORM=1
if [ $SECONDS -lt 440 ]; then
  arm bf16 $((588 - SECONDS)) 1,8 "--profile-batch= --presets bf16" X=0
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler115_*.json
