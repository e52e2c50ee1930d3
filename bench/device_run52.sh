#!/bin/bash
# Thirteenth session. `diag`: where batch 1's time goes on Qwen3-30B-A3B W4A16 at full depth (device_run51's
# base run read a step of 3.64 ms against a graph replay of 2.44 ms at batch 1, the steps scattering 2.7-4.0 ms,
# while batch 8's step equalled its replay): host_split (graph launch cost, the host-only cycle, the top CPU
# ops) at batch 1 and 8, and the kernel split at batch 1; then the recipe's W4A16 row with its BF16 last layers
# (7 of 48) against BF16 in a process of its own (base ran out of memory building it as its third sampler:
# 30 GB reserved but unallocated; expandable segments now).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = diag ]; then
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --batch 1,8 --kv bf16 --repeats 3 --tokens 8,40 --profile-batch 1 --host-batch 1,8 \
    --out $OUT/sampler52_diag.json > $OUT/sampler52_diag.log 2>&1
  echo "diag exit $?"; grep -v '^{' $OUT/sampler52_diag.log | cut -c1-200 | tail -60
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0.15 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler52_last15.json > $OUT/sampler52_last15.log 2>&1
  echo "last15 exit $?"; grep '^|\|rror' $OUT/sampler52_last15.log | cut -c1-300 | tail -8
  exit 0
fi
if [ "$1" = tests ]; then  # device_run51's tests: the GPU tests cut short in the eleventh session (fold, router)
  # or changed without a GPU since (the SILU test, graph capture mode thread_local, the PTX fallback's scope)
  timeout 520 python3 -m pytest -q -m gpu tests/test_moe_route.py tests/test_fused_kernels.py tests/test_gemv_cuda.py \
    tests/test_gpu_decode.py tests/test_triton_attention.py tests/test_sampler.py -rf --durations=8 2>&1 | tail -30
  exit 0
fi
if [ "$1" = final ]; then  # the session's figures: tokens/s from the step clock (decode cadence), 64 timed steps
  timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
    --w4a16-last 0,0.15 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --host-batch 1 \
    --out $OUT/sampler52_30b.json > $OUT/sampler52_30b.log 2>&1
  echo "30b exit $?"; grep -v '^{' $OUT/sampler52_30b.log | cut -c1-220 | tail -30
  timeout 180 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
    --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' --out $OUT/sampler52_8b.json > $OUT/sampler52_8b.log 2>&1
  echo "8b exit $?"; grep '^|\|rror' $OUT/sampler52_8b.log | cut -c1-300 | tail -8
  exit 0
fi
echo "usage: bash bench/device_run52.sh diag|tests|final"; exit 2
