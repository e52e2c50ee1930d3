#!/bin/bash
# The code these calls measured (moe_route.norm_router_route, sampler_gpu --norm-router) was reverted after
# them: it did not pay (bench/RESULTS.md, sampler on H200, sixteenth session); it is in commit 3cf7c95.
# Sixteenth session. `nr`: the MoE layers' add + RMSNorm in the router's launch (moe_route.norm_router_route):
# its GPU tests (bit identity with add_rmsnorm then router_route, compiled; the fused step's logits with and
# without it), then Qwen3-30B-A3B at batch 1 and 8 with it on and off (BF16 in the same process).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = nr ]; then
  timeout 240 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py tests/test_fused_moe_fold.py \
    tests/test_gpu_decode.py > $OUT/tests_nr_s16.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests_nr_s16.log | tail -12
  timeout 300 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0,0.15 --batch 1,8 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --norm-router on,off --out $OUT/sampler58_30b_nr.json > $OUT/sampler58_30b_nr.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler58_30b_nr.log | cut -c1-300 | tail -14
  exit 0
fi
if [ "$1" = nr1 ]; then  # after the first call: the weight slice loaded before the statistics, one token only
  timeout 200 python3 -m pytest -q -m "gpu or not slow" tests/test_moe_route.py tests/test_gpu_decode.py \
    -k "router or folds_the_moe" > $OUT/tests_nr1_s16.log 2>&1
  echo "tests exit $?"; grep -E 'passed|failed|Error|assert' $OUT/tests_nr1_s16.log | tail -12
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch 1 \
    --norm-router on,off --out $OUT/sampler58_30b_nr1.json > $OUT/sampler58_30b_nr1.log 2>&1
  echo "30b exit $?"; grep -v '^{' $OUT/sampler58_30b_nr1.log | grep -v Warn | cut -c1-200 | tail -60
  exit 0
fi
echo "usage: bash bench/device_run58.sh nr|nr1"; exit 2
