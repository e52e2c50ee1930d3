#!/bin/bash
# Fifty-ninth session: 1) the GU_SILU GPU tests (SiLU * up in the gate/up GEMM's epilogue) and the plain
# mma16 builds' bit tests (the tile mapping is new in their source too); 2) Qwen3-8B at batch 1 / 4 / 8 / 32
# with the epilogue (default) and without it (FP4RL_GU_SILU=0: the silu_mul launch); 3) Qwen3-4B / 14B: BF16
# and the defaults at batch 1 / 4 / 8 / 16 (their ratios), FP4RL_GU_SILU=0 at the same batches; 4) the 8B
# without the silu_mul launch at all (bench/silu_bound.py, wrong outputs: the bound). Up to END (default
# 560) s; the 30B's arms are bench/device_run192.sh.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 220 python3 -m pytest -q -m gpu tests/test_gemv_cuda_gu_silu.py tests/test_gemv_cuda.py -p no:cacheprovider \
  -k 'gu_silu or silu_out or epilogue or kernel_matches_reference' > $OUT/test191.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test191.log
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler191_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 100 ? left - 5 : 100)) "$3" "--profile-batch= $4" "$5"
}
step qwen3-8b:36 gu1 1,4,8,32 "" X=0
step qwen3-8b:36 gu0 1,4,8,32 "" FP4RL_GU_SILU=0
for shape in qwen3-4b:36 qwen3-14b:40; do
  step $shape bf16 1,4,8,16 "--presets bf16" X=0; step $shape rule 1,4,8,16 "" X=0
  step $shape gu0 1,4,8,16 "" FP4RL_GU_SILU=0
done
ARM_RUN=bench/silu_bound.py step qwen3-8b:36 nosilu 1,4,8,32 "" FP4RL_GU_SILU=0
for shape in qwen3-8b qwen3-4b qwen3-14b; do
  ls $OUT/sampler191_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler191_${shape}_*.json
done
