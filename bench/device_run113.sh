#!/bin/bash
# Prepared in the thirty-seventh session (no device lent). Qwen3-8B (36 layers, W4A16, BF16 KV) at batch 1 / 8:
# the defaults, FP4RL_ATTN_ROPE=1 (q/k-norm + RoPE + the cache write inside the attention's launch: one launch
# fewer a layer, Qwen3 has q/k-norm) and device_run105 b's FILL 3 (the dense GEMMs at ~3 CTAs per SM), then BF16
# at the same batches for the ratios if the time is there; each arm a fresh process. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler113
arm defaults 120 1,8 "--profile-batch=" X=0
arm rope 120 1,8 "--profile-batch=" FP4RL_ATTN_ROPE=1
arm fill3 120 1,8 "--profile-batch=" FP4RL_MMA16_FILL=3
if [ $SECONDS -lt 450 ]; then
  arm bf16 $((588 - SECONDS)) 1,8 "--profile-batch= --presets bf16" X=0
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler113_*.json
