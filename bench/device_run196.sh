#!/bin/bash
# Prepared in the sixtieth session (not run: no device time left), after device_run195 (RESNORM -0.6% on
# Qwen3-8B at batch 1 against a bound of -7.0%, +0.2% on the 14B, -4.7% on the 4B) and the producer's fix found in
# the SASS after it (the residual's L2 round trip no longer before each producer CTA's stream): 1) at batch 1,
# each arm a fresh process: the defaults, RESNORM (rstd before the stream, RN_IN 1) and RESNORM with rstd after
# the stream (FP4RL_RN_IN=2) on Qwen3-8B, and the gate | up's row scales read early (FP4RL_GU_SILU_GSR=1, GSU),
# then the three RESNORM arms on the 14B / 4B; 2) the RN and GU_SILU GPU tests (tests/test_resnorm.py: the
# consumer bit for bit on exact sums, both RN_IN builds; GSU's bits); 3) the 8B stamped
# (--mma16-stamps) with and without RESNORM, summarized per GEMM shape. Up to END (default 500) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
step() {  # step SHAPE:LAYERS NAME BATCHES EXTRA VAR=VALUE...: one arm if END leaves room
  ARM_SHAPE=$1 ARM_PREFIX=sampler196_${1%%:*}
  local left=$((${END:-500} - SECONDS))
  [ $left -gt 50 ] && arm "$2" $((left < 75 ? left - 5 : 75)) "$3" "$4" "${@:5}"
}
step qwen3-8b:36 rule 1 "--profile-batch=" X=0
step qwen3-8b:36 rn 1 "--profile-batch=" FP4RL_RESNORM=1
step qwen3-8b:36 rn_late 1 "--profile-batch=" FP4RL_RESNORM=1 FP4RL_RN_IN=2
step qwen3-8b:36 gsu 1 "--profile-batch=" FP4RL_GU_SILU_GSR=1
for shape in qwen3-14b:40 qwen3-4b:36; do
  step $shape rule 1 "--profile-batch=" X=0
  step $shape rn 1 "--profile-batch=" FP4RL_RESNORM=1
  step $shape rn_late 1 "--profile-batch=" FP4RL_RESNORM=1 FP4RL_RN_IN=2
done
for shape in qwen3-8b qwen3-14b qwen3-4b; do
  ls $OUT/sampler196_${shape}_*.json > /dev/null 2>&1 && python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler196_${shape}_*.json | tail -1
done
if [ $((${END:-500} - SECONDS)) -gt 90 ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_resnorm.py tests/test_gemv_cuda_gu_silu.py -k "not greedy" \
    -p no:cacheprovider > $OUT/test196.log 2>&1
  echo "test exit $? at ${SECONDS}s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/test196.log | tail -8
fi
step qwen3-8b:36 rn_stamps 1 "--profile-batch=1 --mma16-stamps" FP4RL_RESNORM=1
step qwen3-8b:36 rule_stamps 1 "--profile-batch=1 --mma16-stamps" X=0
for f in $OUT/sampler196_*stamps*.json.gz; do [ -e "$f" ] && echo "== $f" && python3 -m fp4rl.benchmarks.stamps "$f" | head -30; done
