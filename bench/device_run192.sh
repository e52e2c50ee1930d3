#!/bin/bash
# Fifty-ninth session, second call: the 30B (24 layers) at batch 8 / 16 with choose_narrow's rule and with
# mma.sync (FP4RL_NARROW_WGMMA=0; its attention GEMMs take the rule, its routed experts do not), then its BF16
# arm; as END allows, a second round of the rule against mma.sync on Qwen3-4B / 14B at batch 4 / 8 / 16.
# Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler192_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 120 ? left - 5 : 120)) "$3" "--profile-batch= $4" "$5"
}
step qwen3-30b-a3b:24 rule 8,16 "" X=0; step qwen3-30b-a3b:24 n0 8,16 "" FP4RL_NARROW_WGMMA=0
step qwen3-30b-a3b:24 bf16 8,16 "--presets bf16" X=0
ARM_RUN=bench/silu_bound.py step qwen3-8b:36 nosilu 1,4,8,32 "" FP4RL_GU_SILU=0
step qwen3-8b:36 gu1 1,4,8,32 "" X=0
for shape in qwen3-4b:36 qwen3-14b:40; do
  step $shape rule 4,8,16 "" X=0; step $shape n0 4,8,16 "" FP4RL_NARROW_WGMMA=0
done
for shape in qwen3-30b-a3b qwen3-8b qwen3-4b qwen3-14b; do
  ls $OUT/sampler192_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler192_${shape}_*.json
done
