#!/bin/bash
# Forty-first session. Qwen3-30B-A3B at full depth (48 layers; needs an H200: BF16 does not fit an H100) at batch 1,
# with the step's inputs in one launch (e5743c5) and RoPE rows from the engine's table (6d0da35): BF16, the
# defaults (BF16 lm_head) and the NVFP4 lm_head, each arm a fresh process (device_run123 showed a second row in
# one process can differ). Measures next item 1 of bench/gpu_kernels.md's fortieth session.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
source bench/sampler_arm.sh
ARM_SHAPE=qwen3-30b-a3b:${DEPTH:-48} ARM_PREFIX=${PREFIX:-sampler127_30b}
arm bf16 200 1 "--profile-batch= --presets bf16" X=0
arm defaults 200 1 "--profile-batch= --lm-head bf16" X=0
arm head 200 1 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_*.json
