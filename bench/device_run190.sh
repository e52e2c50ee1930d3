#!/bin/bash
# Fifty-eighth session: choose_narrow's rule in the decode step of the dense Qwen3s it was not fitted on
# (Qwen3-4B, 36 layers; Qwen3-14B, 40 layers), where depth 2 lost up to 11% a call at 2-8 rows: the rule
# (default) against FP4RL_NARROW_WGMMA=9 (9-16 rows only) and =0 (mma.sync), batch 4 / 8 / 16, fresh processes,
# then a second round of the rule and =0. Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
for shape in qwen3-4b:36 qwen3-14b:40; do
  ARM_SHAPE=$shape ARM_PREFIX=sampler190_${shape%%:*}
  left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm rule 90 4,8,16 "--profile-batch=" X=0
  left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n9 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=9
  left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n0 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
done
for shape in qwen3-4b:36 qwen3-14b:40; do
  ARM_SHAPE=$shape ARM_PREFIX=sampler190_${shape%%:*}
  left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm rule2 90 4,8,16 "--profile-batch=" X=0
  left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n0_2 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler190_qwen3-4b_*.json
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler190_qwen3-14b_*.json
