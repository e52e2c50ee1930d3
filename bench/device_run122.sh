#!/bin/bash
# Thirty-ninth session, device_run121's sampler arms alone, in what ~300 s of device time allowed (as it ran:
# the defaults' arm 140 s, everything 250 s): Qwen3-30B-A3B's defaults at batch 1 with the BF16 and the NVFP4
# lm_head, then BF16, each a fresh process (full depth on an H200, 24 layers on an H100). DEF_LIMIT / END
# (seconds) give more; PREFIX names the files.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
source bench/sampler_arm.sh
depth=24; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && depth=48
ARM_SHAPE=qwen3-30b-a3b:$depth ARM_PREFIX=${PREFIX:-sampler122_30b}
arm defaults "${DEF_LIMIT:-140}" 1 "--profile-batch= --lm-head bf16,w4a16" X=0
arm bf16 $((${END:-250} - SECONDS)) 1 "--profile-batch= --presets bf16" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/${ARM_PREFIX}_*.json
