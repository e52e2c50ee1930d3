#!/bin/bash
# Thirty-eighth session, H100: where DENSE_NORM's batch-1 time goes (device_run118: its mma16 launches' advance
# 15.4 us a call against 12.1 us without it, 144 a step). Qwen3-8B at batch 1 with the in-kernel stamps
# (--mma16-stamps: each GEMM CTA's time from start / wait / x staged (PRENORM: after the norm) / stream end),
# defaults and DENSE_NORM; then the corrected GPU tests of the three flags. ~350 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler119_8b
arm defaults_stamps 90 1 "--profile-batch=1 --mma16-stamps" X=0
arm dense_norm_stamps 90 1 "--profile-batch=1 --mma16-stamps" FP4RL_DENSE_NORM=1
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler119_*.json | grep -v "checks" | head -60
for f in $OUT/sampler119_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f" | head -40; done
timeout $((585 - SECONDS)) python3 -m pytest -q -m "gpu or not gpu" tests/test_gpu_decode_fused.py \
  -k "router_norm or one_launch or dense_norm" > $OUT/tests119.log 2>&1
echo "tests exit $? at ${SECONDS}s"; grep -E "passed|failed|FAILED|^E " $OUT/tests119.log | tail -12
