#!/bin/bash
# Thirty-sixth session, after device_run109 (the CUDA router + route faster up to 4 tokens, now the default there):
# the GPU tests of the MoE route with that default, then Qwen3-30B-A3B at batch 1 / 8 with
# the defaults and with device_run105's FILL 3 (the dense GEMMs at ~3 CTAs per SM). Each arm a fresh process.
# Up to ~400 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu tests/test_moe_route.py > $OUT/tests110.log 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 $OUT/tests110.log
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler110
arm defaults 150 1,8 "--profile-batch=" X=0
if [ $SECONDS -lt 260 ]; then
  arm fill3 $((395 - SECONDS)) 1,8 "--profile-batch=" FP4RL_MMA16_FILL=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler110_*.json 2>&1 | tail -12
