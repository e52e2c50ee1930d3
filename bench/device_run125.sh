#!/bin/bash
# Fortieth session (run inline as this script's commands): Qwen3-30B-A3B at full depth on an H200 with the
# NVFP4 lm_head, alone in a fresh process (device_run123 ran it as the second row of the defaults' process,
# where at full depth it came out as slow as the BF16-head row: 1.949 vs 1.951 ms).
source bench/sampler_arm.sh
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler125_30b
arm head_alone 200 1 "--profile-batch= --lm-head w4a16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler125_30b_head_alone.json 2>&1 | grep -v "^|" | head
