#!/bin/bash
# Forty-first session: is f541a46 (four launches fewer between two replays) what made Qwen3-30B-A3B's
# defaults (BF16 lm_head) replay slower? device_run129 (H200, 48 layers): the defaults' graph 2001 us against
# 1905 in device_run123 (s40), while the NVFP4-head arm's moved 1802 -> 1816 and BF16's 4578 -> 4586. A/B in
# one lease, fresh processes, 24 layers, batch 1: the tree before it (bench/old41, `git archive 82f710c
# fp4rl`, run from that folder) and this one, alternating, with a profile of the first pair.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
source bench/sampler_arm.sh
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler130_30b
old() { (cd bench/old41 && arm "$@"); }
old old1 120 1 "--profile-batch 1 --lm-head bf16" X=0
arm new1 120 1 "--profile-batch 1 --lm-head bf16" X=0
old old2 100 1 "--profile-batch= --lm-head bf16" X=0
arm new2 100 1 "--profile-batch= --lm-head bf16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_*.json | grep -v "^|"
