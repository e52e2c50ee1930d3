#!/bin/bash
# Fifty-seventh session, second: choose_narrow (2-16 rows on the wgmma build, WARPS 4, the one-row split) in the
# 8B decode step: FP4RL_NARROW_WGMMA=2 (when run: every 2-16-row GEMM at depth 2; since: choose_narrow's rule from
# 2 rows) against 0 (mma.sync), fresh processes in pairs, at
# batch 4 / 8 / 16 (128-token prompts, BF16 KV, full depth), and BF16 weights at the same batches for the ratio.
# Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler188_8b
arm n2_1 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=${NARROW:-2}
arm n0_1 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
arm bf16 120 4,8,16 "--profile-batch= --presets bf16" X=0
left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n2_2 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=${NARROW:-2}
left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n0_2 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler188_*.json
