#!/bin/bash
# Sixtieth session: 1) the GPU tests of the split residual add + RMSNorm (tests/test_resnorm.py: RN_OUT / RN_IN
# against fp4rl.kernels.resnorm, decoding with RESNORM on / off) and the GU_SILU tests as the fifty-ninth
# session's review left them (never run on a GPU); 2) at batch 1, each arm a fresh process: the defaults,
# FP4RL_RESNORM=1 (71 of the 8B's 73 add_rmsnorm launches a step gone, 79 of the 14B's 81) and the bound
# (bench/norm_bound.py: no add_rmsnorm launch before a W4A16 consumer, wrong outputs), Qwen3-8B then
# Qwen3-14B, then the 8B's two again (their spread), then Qwen3-4B's two. Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 240 python3 -m pytest -q -m gpu tests/test_resnorm.py tests/test_gemv_cuda_gu_silu.py -p no:cacheprovider \
  > $OUT/test195.log 2>&1
echo "test exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/test195.log | tail -12
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler195_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 60 ] && arm "$2" $((left < 80 ? left - 5 : 80)) "$3" "$4" "$5"
}
for shape in qwen3-8b:36 qwen3-14b:40; do
  step $shape rule 1 "--profile-batch=" X=0
  step $shape rn 1 "--profile-batch=" FP4RL_RESNORM=1
  ARM_RUN=bench/norm_bound.py step $shape nonorm 1 "--profile-batch=" X=0
done
step qwen3-8b:36 rule2 1 "--profile-batch=" X=0
step qwen3-8b:36 rn2 1 "--profile-batch=" FP4RL_RESNORM=1
step qwen3-4b:36 rule 1 "--profile-batch=" X=0
step qwen3-4b:36 rn 1 "--profile-batch=" FP4RL_RESNORM=1
for shape in qwen3-8b qwen3-14b qwen3-4b; do
  ls $OUT/sampler195_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler195_${shape}_*.json
done
