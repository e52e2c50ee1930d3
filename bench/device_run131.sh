#!/bin/bash
# Forty-first session: device_run130 again with the routing record launched after the graph instead of inside
# it (the graph then holds what it held before f541a46): this tree's defaults arm, then the tree before
# f541a46 (bench/old41), Qwen3-30B-A3B at 24 layers, batch 1, each a fresh process.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
source bench/sampler_arm.sh
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler131_30b
arm new 95 1 "--profile-batch= --lm-head bf16" X=0
(cd bench/old41 && arm old 95 1 "--profile-batch= --lm-head bf16" X=0)
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_*.json | grep -v "^|"
