#!/bin/bash
# Fifty-sixth session, fifth: 1) WARPS 4 in the mma.sync builds (2-16 rows; the same bits: each warp's tiles and
# the split's reduction unchanged) against the rule's 8 warps, its split doubled / halved, on eight shapes;
# 2) Qwen3-30B-A3B (24 layers) at batch 32 (its attention's 5120x2048 / 2048x4096 take WARPS 4 at 32 rows):
# choose_wide's rule against FP4RL_WIDE_WARPS=8, fresh processes. Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 bench/mma16_sweep.py --rows 2,4,8,12,16 --variants auto,wp4,wp4+s2x,wp4+sh \
  --shapes 4096x4096,6144x4096,24576x4096,4096x12288,14336x4096,4096x14336,5120x2048,2048x4096 \
  --out $OUT/sweep183.json > $OUT/sweep183.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -c FAILED $OUT/sweep183.log
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler183_30b32
for i in 1 2; do
  left=$((${END:-560} - SECONDS)); [ $left -gt 200 ] || break  # both arms of the pair fit
  arm rule_$i 100 32 "--profile-batch=" X=0
  arm w8_$i 100 32 "--profile-batch=" FP4RL_WIDE_WARPS=8
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler183_*.json
