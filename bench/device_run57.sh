#!/bin/bash
# Fifteenth session, second half. `check`: the decode path's GPU tests with the in-CTA split-K default (the
# first call's 300 s limit stopped before the last fold tests), then the issue's GEMM shapes at 1-4 rows with the
# split inside the CTA (`kw`) and in a cluster (`cl`), to see where the in-CTA split pays beyond one row.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = check ]; then
  timeout 100 python3 bench/mma16_sweep.py --shapes 4096x14336,14336x4096,4096x6144 --rows 1,2,4 \
    --variants auto,cl,kw,pdl,pdl+cl,pdl+kw --out $OUT/mma16_issue_s15.json > $OUT/mma16_issue_s15.log 2>&1
  echo "dense exit $?"; grep -v '^{' $OUT/mma16_issue_s15.log | cut -c1-200 | tail -40
  timeout 360 python3 -m pytest -q -m gpu tests/test_fused_moe_fold.py tests/test_gpu_decode.py tests/test_pdl.py \
    tests/test_moe_route.py > $OUT/tests_decode_s15.log 2>&1
  echo "tests exit $?"; tail -8 $OUT/tests_decode_s15.log
  exit 0
fi
if [ "$1" = recipe ]; then  # Qwen3-30B-A3B at batch 1 with the in-CTA default: every linear W4A16 and the recipe's
  # 7 BF16 last layers, BF16 in the same process
  timeout 230 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0,0.15 --batch 1 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler57_30b_recipe.json > $OUT/sampler57_30b_recipe.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler57_30b_recipe.log | cut -c1-300 | tail -8
  exit 0
fi
echo "usage: bash bench/device_run57.sh check|recipe"; exit 2
