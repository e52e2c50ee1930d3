#!/bin/bash
# Fifty-ninth session: 1) what the dense MLP's SiLU * up launch costs a decode step (Qwen3-8B, batch 1 / 2 / 4:
# the defaults against bench/silu_bound.py, the same step without that launch; decides whether to fold it into
# the gate/up GEMM's epilogue); 2) BF16 arms for Qwen3-4B / Qwen3-14B beside choose_narrow's rule (their ratios);
# 3) the 30B (24 layers) at batch 8 / 16 with the rule and with mma.sync (FP4RL_NARROW_WGMMA=0), then its BF16
# arm; 4) as END allows, a second round of the rule against mma.sync on the 4B / 14B. Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler191_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 100 ? left - 5 : 100)) "$3" "--profile-batch= $4" "$5"
}
step qwen3-8b:36 defaults 1,2,4 "" X=0
ARM_RUN=bench/silu_bound.py step qwen3-8b:36 nosilu 1,2,4 "" X=0
for shape in qwen3-4b:36 qwen3-14b:40; do
  step $shape bf16 1,4,8,16 "--presets bf16" X=0; step $shape rule 1,4,8,16 "" X=0
done
step qwen3-30b-a3b:24 rule 8,16 "" X=0; step qwen3-30b-a3b:24 n0 8,16 "" FP4RL_NARROW_WGMMA=0
step qwen3-30b-a3b:24 bf16 8,16 "--presets bf16" X=0
for shape in qwen3-4b:36 qwen3-14b:40; do step $shape n0 4,8,16 "" FP4RL_NARROW_WGMMA=0; done
for shape in qwen3-8b qwen3-4b qwen3-14b qwen3-30b-a3b; do
  ls $OUT/sampler191_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler191_${shape}_*.json
done
