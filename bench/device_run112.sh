#!/bin/bash
# Prepared in the thirty-seventh session (no device lent), after device_run111. With the CUDA router + route the
# default up to 4 tokens (thirty-sixth session, 30B batch 1 at 1.96 ms, 2.38x), where the 30B's batch-1 step
# goes now: the graph replay's chain (each kernel's advance per call: the thirtieth session's was mma16 5.6 us,
# router_route 6.2, add_rmsnorm 2.8, attention 5.1, q/k-norm + RoPE 1.6) and the in-kernel stamps, at batch 1,
# each in a fresh process; then the 8B FILL 3 (device_run105 b's arms) if the time is there. Up to ~560 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler112
arm chain 150 1,8 "--profile-batch=1" X=0
arm stamps 140 1 "--profile-batch=1 --mma16-stamps" X=0
if [ $SECONDS -lt 330 ]; then
  ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler112_8b
  arm defaults 110 1,8 "--profile-batch=" X=0
  arm fill3 $((555 - SECONDS)) 1,8 "--profile-batch=" FP4RL_MMA16_FILL=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler112*.json
for f in $OUT/sampler112_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f"; done
