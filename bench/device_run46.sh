#!/bin/bash
# Tenth session, call 4: GPU tests of what changed (the grouped kernel's gather and every mma16 launch, the
# sampling kernel, the MoE route, the decode engine), where a step goes now (bench/step_gap.py, 12 layers), and
# the full-depth Qwen3-30B-A3B table (48 layers, BF16 with the trainer in host memory, and W4A16).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 200 python3 -m pytest -q -m "gpu or not gpu" tests/test_gemv_cuda.py tests/test_sample_head.py \
  tests/test_moe_route.py -rf 2>&1 | tail -3
timeout 130 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rf 2>&1 | tail -3
timeout 60 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset nvfp4-w4a16 --batch 1,8,32 \
  --out $OUT/step_gap46_nvfp4-w4a16.json 2>&1 | grep -v Warn | cut -c1-700
timeout 290 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --out $OUT/sampler46_30b48.json \
  > $OUT/sampler46_30b48.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler46_30b48.log | cut -c1-300 | tail -8
