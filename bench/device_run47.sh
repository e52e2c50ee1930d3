#!/bin/bash
# Tenth session, call 5: the sampling kernel split over slices of the vocabulary (GPU tests), the full-depth
# Qwen3-30B-A3B table with it (48 layers; median of 3 back-to-back (N1, N2) pairs), the decode engine's GPU
# tests, and where a 12-layer step goes now (bench/step_gap.py).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 60 python3 -m pytest -q tests/test_sample_head.py -rf 2>&1 | tail -2
timeout 300 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --out $OUT/sampler47_30b48.json \
  > $OUT/sampler47_30b48.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler47_30b48.log | cut -c1-300 | tail -8
timeout 60 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rf 2>&1 | tail -2
timeout 45 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset nvfp4-w4a16 --batch 1,32 \
  --out $OUT/step_gap47_nvfp4-w4a16.json 2>&1 | grep -v Warn | cut -c1-400
