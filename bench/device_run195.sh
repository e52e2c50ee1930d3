#!/bin/bash
# Sixtieth session: 1) the GU_SILU GPU tests as the fifty-ninth session's review left them (random per-row scales,
# the step's launch checked to take silu_out; never run on a GPU); 2) the bound of folding the residual add +
# RMSNorm into the GEMMs (bench/norm_bound.py: no add_rmsnorm launch before a W4A16 consumer, wrong outputs)
# against the defaults, Qwen3-8B at batch 1 / 4 / 8 / 32 and Qwen3-14B at 1 / 8, each arm a fresh process;
# 3) if END (default 560) s leave room, device_run194's stamped 8B batch-1 arms (GU_SILU on / off).
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 220 python3 -m pytest -q -m gpu tests/test_gemv_cuda_gu_silu.py -p no:cacheprovider > $OUT/test195.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test195.log
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler195_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 110 ? left - 5 : 110)) "$3" "$4" "$5"
}
step qwen3-8b:36 rule 1,4,8,32 "--profile-batch=" X=0
ARM_RUN=bench/norm_bound.py step qwen3-8b:36 nonorm 1,4,8,32 "--profile-batch=" X=0
step qwen3-14b:40 rule 1,8 "--profile-batch=" X=0
ARM_RUN=bench/norm_bound.py step qwen3-14b:40 nonorm 1,8 "--profile-batch=" X=0
for shape in qwen3-8b qwen3-14b; do
  ls $OUT/sampler195_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler195_${shape}_*.json
done
step qwen3-8b:36 gu1_stamps 1 "--profile-batch=1 --mma16-stamps" X=0
step qwen3-8b:36 gu0_stamps 1 "--profile-batch=1 --mma16-stamps" FP4RL_GU_SILU=0
for f in $OUT/sampler195_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f" | head -40; done
