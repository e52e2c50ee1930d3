#!/bin/bash
# Fifty-eighth session (prepared in the fifty-seventh): 1) the GPU tests rewritten after device_run187 (choose_narrow
# within a build, the PRENORM / stamps tests on the mma.sync build); 2) choose_narrow's 2-8-row rule in the 8B step
# (default: the rule from 2 rows; =9: 9-16 rows only; =0: mma.sync) at batch 4 / 8 / 16; 3) the 30B (24 layers)
# at batch 8 / 16, the rule against mma.sync (its attention GEMMs take it; its routed experts do not).
# Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py tests/test_gemv_cuda_wide.py tests/test_gemv_cuda_prenorm.py \
  tests/test_stamps.py -p no:cacheprovider -k 'narrow or kernel_matches_reference or prenorm or stamps' > $OUT/test189.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test189.log
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler189_8b
arm rule 90 4,8,16 "--profile-batch=" X=0
arm n9 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=9
arm n0 90 4,8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler189_30b
left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm rule 90 8,16 "--profile-batch=" X=0
left=$((${END:-560} - SECONDS)); [ $left -gt 100 ] && arm n0 90 8,16 "--profile-batch=" FP4RL_NARROW_WGMMA=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler189_8b_*.json
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler189_30b_*.json
