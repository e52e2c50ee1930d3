#!/bin/bash
# Prepared in the thirty-seventh session (no device lent), for after device_run111. Set WIN to the flags that
# device_run111 found faster (e.g. WIN="FP4RL_ATTN_ROPE=1 FP4RL_MOE_ROUTER_NORM=1", or X=0 for none) until they
# are the defaults. Qwen3-30B-A3B at batch 1 / 8 with them against BF16 in the same call (the README's ratio),
# then where the batch-1 step goes now: the graph replay's chain (each kernel's advance per call; the thirtieth
# session's: mma16 5.6 us, router_route 6.2, add_rmsnorm 2.8, attention 5.1, q/k-norm + RoPE 1.6) and the
# in-kernel stamps, each arm a fresh process. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
WIN=${WIN:-X=0}
ARM_SHAPE=qwen3-30b-a3b:48 ARM_PREFIX=sampler112
arm win_chain 150 1,8 "--profile-batch=1" $WIN
arm bf16 150 1,8 "--profile-batch= --presets bf16" X=0
if [ $SECONDS -lt 440 ]; then
  arm stamps $((588 - SECONDS)) 1 "--profile-batch=1 --mma16-stamps" $WIN
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler112_*.json
for f in $OUT/sampler112_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f"; done
