#!/bin/bash
# Fortieth session: the step's inputs in one launch (fp4rl.kernels.step_inputs, e5743c5) on the GPU. 1) Its
# test and the engine's tests on CUDA (kernel steps against the torch steps, graphs against eager, the RoPE
# table). 2) If time is left (END, seconds): Qwen3-30B-A3B's defaults at batch 1 (24 layers on an H100, 48 on
# an H200): the step's distance from its graph replay is what the seven launches were part of (67 us at 24
# layers on an H100, 46 us at 48 on an H200, this session before the change).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
SECONDS=0
timeout 110 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/test_step_inputs.py \
    tests/test_gpu_decode.py -k "step_inputs or one_launch or bad_inputs or kernel_decode_steps or graphs_replay or rope_rows" \
    2>&1 | tail -4
echo "tests at ${SECONDS}s"
source bench/sampler_arm.sh
depth=24; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && depth=48
ARM_SHAPE=qwen3-30b-a3b:$depth ARM_PREFIX=sampler126_30b
left=$((${END:-170} - SECONDS))
[ $left -gt 50 ] && arm defaults $left 1 "--profile-batch=" X=0
