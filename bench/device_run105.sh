#!/bin/bash
# Thirty-third session, prepared for the next one (device time spent). The stamps' %smid (device_run102/103):
# at one row Qwen3-30B-A3B's q/k/v (5120x2048, K split in 4: 160 CTAs) puts two CTAs on 36 of the 132 SMs,
# which leave 0.7 us after the others (exit 3.23 vs 2.53 us after the release, device_run102); Qwen3-8B's
# q/k/v (6144x4096: 192 CTAs) at least two on 60. FP4RL_MMA16_FILL=3 lets choose's split take ~3 CTAs per SM:
# K in 8 (320 / 384 CTAs), at 1 row (8 warps of a CTA) and at 2-16 rows (a cluster of 8) alike, so batch 8
# pays the larger cluster's reduction: time both (the sixteenth session timed this split for q/k/v alone: 4.4
# vs 4.5 us at one row, slower at 4-16 rows). Other bits than the default (the 8-part sums). Each arm in a
# fresh process.
#   bash bench/device_run105.sh a    # Qwen3-30B-A3B W4A16 at batch 1 / 8: defaults, FILL 3, then FILL 3's stamps
#   bash bench/device_run105.sh b    # Qwen3-8B W4A16 at batch 1 / 8: defaults, FILL 3
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
mode=${1:-a}
if [ "$mode" = a ]; then ARM_SHAPE=qwen3-30b-a3b:48; else ARM_SHAPE=qwen3-8b:36; fi
ARM_PREFIX=sampler105${mode}
timeout 60 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "in_cta_split_gives" > $OUT/tests105.log 2>&1
echo "tests exit $?"; tail -2 $OUT/tests105.log
arm defaults 180 1,8 "--profile-batch=" X=0
arm fill3 140 1,8 "--profile-batch=" FP4RL_MMA16_FILL=3
if [ "$mode" = a ] && [ $SECONDS -lt 460 ]; then
  arm fill3_stamps $((575 - SECONDS)) 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_FILL=3
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler105${mode}_*.json
for f in $OUT/sampler105${mode}_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f"; done
