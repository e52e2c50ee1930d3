#!/bin/bash
# Fiftieth session, the sampler's A/B arms (Qwen3-8B, W4A16 every linear, 4096-token prompts, each arm a fresh
# process): 1) the NVFP4 cache (Gluon attention, its one-split merge now without the counter) with the default
# PDL kinds against the Gluon attention launched with PDL (FP4RL_PDL_OFF=mma,wide,attn) at batch 1 / 8 / 32;
# 2) the FP8 cache at batch 1: the split cap (default) against FP4RL_FP8_SPLIT_COST=0. Up to ~560 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler160_8b4k
arm nvfp4kv 130 1,8,32 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
arm nvfp4kv_gpdl 130 1,8,32 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_PDL_OFF=mma,wide,attn
left=$((${END:-555} - SECONDS)); [ $left -gt 150 ] && arm fp8kv $((left / 2)) 1 "--kv fp8 --prompt 4096 --profile-batch=" X=0
left=$((${END:-555} - SECONDS)); [ $left -gt 70 ] && arm fp8kv_cost0 $left 1 "--kv fp8 --prompt 4096 --profile-batch=" FP4RL_FP8_SPLIT_COST=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler160_8b4k_*.json 2>&1 | grep "step ms\|pdl\|PDL"
