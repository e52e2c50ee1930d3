#!/bin/bash
# Thirty-sixth session, after device_run109: the GPU tests of the MoE route and the fused decode with the CUDA
# router + route on by default at one token, then Qwen3-30B-A3B at batch 1 / 2 / 4 / 8 in BF16 and with the
# defaults (the ratios in one call), then the defaults with device_run105's FILL 3 (q / k / v and the other dense
# GEMMs at ~3 CTAs per SM) at batch 1 / 8. Each arm a fresh process. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/test_moe_route.py tests/test_gpu_decode_fused.py -x \
  > $OUT/tests110.log 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 $OUT/tests110.log
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler110
arm bf16 170 1,2,4,8 "--profile-batch= --presets bf16" X=0
arm defaults 150 1,2,4,8 "--profile-batch=" X=0
if [ $SECONDS -lt 470 ]; then
  arm fill3 $((585 - SECONDS)) 1,8 "--profile-batch=" FP4RL_MMA16_FILL=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler110_*.json 2>&1 | tail -30
