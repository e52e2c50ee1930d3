#!/bin/bash
# Fifty-eighth session (prepared in the fifty-seventh, widened in the fifty-eighth): 1) the GPU tests rewritten
# after device_run187 (choose_narrow within a build, the PRENORM / stamps tests on the mma.sync build);
# 2) choose_narrow's rule (default: from 2 rows) against FP4RL_NARROW_WGMMA=0 (mma.sync) in the decode step at
# batch 4 / 8 / 16, fresh processes: Qwen3-8B (36 layers, where the rule was fitted), then Qwen3-4B (36) and
# Qwen3-14B (40), where depth 2 lost up to 11% a call at 2-8 rows; 3) as time allows, =9 (9-16 rows only) on
# the three, a second round of the rule and =0, and the 30B (24 layers) at batch 8 / 16 (its attention GEMMs
# take the rule; its routed experts do not). Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_wide.py tests/test_gemv_cuda_prenorm.py \
  tests/test_stamps.py -p no:cacheprovider -k 'narrow or kernel_matches_reference or prenorm or stamps' > $OUT/test189.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test189.log
step() {  # step SHAPE:LAYERS NAME BATCHES VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler189_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 90 ? left - 5 : 90)) "$3" "--profile-batch=" "$4"
}
for shape in qwen3-8b:36 qwen3-4b:36 qwen3-14b:40; do
  step $shape rule 4,8,16 X=0; step $shape n0 4,8,16 FP4RL_NARROW_WGMMA=0
done
for shape in qwen3-8b:36 qwen3-4b:36 qwen3-14b:40; do step $shape n9 4,8,16 FP4RL_NARROW_WGMMA=9; done
for shape in qwen3-4b:36 qwen3-14b:40; do
  step $shape rule2 4,8,16 X=0; step $shape n0_2 4,8,16 FP4RL_NARROW_WGMMA=0
done
step qwen3-30b-a3b:24 rule 8,16 X=0; step qwen3-30b-a3b:24 n0 8,16 FP4RL_NARROW_WGMMA=0
for shape in qwen3-8b qwen3-4b qwen3-14b qwen3-30b-a3b; do
  ls $OUT/sampler189_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler189_${shape}_*.json
done
