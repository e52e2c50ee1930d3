#!/bin/bash
# Forty-eighth session (an H100; no H200 came): Qwen3-8B at full depth, batch 1 / 8 / 32, each arm a fresh
# process: BF16; the defaults with a profile of batch 32 (where the 1.57x is lost: the step's kernels on this
# card with the current code); the dense split of K at ~3 CTAs an SM (FP4RL_MMA16_FILL=3, untried on the 8B since
# the thirty-third session; other bits than the default, the 8-part sums); the tuner timing every GEMM candidate
# per shape (--tune) instead of taking the first untuned. Up to ~420 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gemv_cuda.py -k "in_cta_split_gives" 2>&1 | tail -2
echo "tests at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler150_8b
arm bf16 100 1,8,32 "--profile-batch= --presets bf16" X=0
arm defaults 110 1,8,32 "--profile-batch=32" X=0
arm fill3 90 1,8,32 "--profile-batch=" FP4RL_MMA16_FILL=3
arm tune 130 1,8,32 "--profile-batch= --tune" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler150_8b_*.json
