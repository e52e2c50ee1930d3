#!/bin/bash
# Prepared in the fifty-ninth session (not run yet): 1) the GU_SILU GPU tests as the review left them (random
# per-row scales, the step's launch checked to take silu_out; they ran on a GPU before that change only);
# 2) where GU_SILU's remaining ~1.2 us a layer at batch 1 goes (bench/gpu_kernels.md, fifty-ninth session, Next
# 2): Qwen3-8B and Qwen3-14B at batch 1 with the in-kernel stamps (--mma16-stamps; each GEMM CTA's start / wait
# / x staged / stream end / exit), GU_SILU on and off, the stamps summarized per GEMM shape (the gate | up is
# 24576x4096 / 34816x5120: its exit minus its stream end is the epilogue). Stamped rows are for the spans, not
# the step times (stamps slow the GEMMs). Up to END (default 560) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 220 python3 -m pytest -q -m gpu tests/test_gemv_cuda_gu_silu.py -p no:cacheprovider > $OUT/test194.log 2>&1
echo "test exit $? at ${SECONDS}s"; tail -3 $OUT/test194.log
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler194_${1%%:*}
  local left=$((${END:-560} - SECONDS))
  [ $left -gt 75 ] && arm "$2" $((left < 100 ? left - 5 : 100)) "$3" "--profile-batch=1 --mma16-stamps $4" "$5"
}
for shape in qwen3-8b:36 qwen3-14b:40; do
  step $shape gu1_stamps 1 "" X=0; step $shape gu0_stamps 1 "" FP4RL_GU_SILU=0
done
for f in $OUT/sampler194_*stamps*.json.gz; do [ -e "$f" ] && python3 -m fp4rl.benchmarks.stamps "$f" | head -40; done
