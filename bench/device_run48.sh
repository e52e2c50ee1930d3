#!/bin/bash
# Prepared in the tenth session (no device time left to run it): the GPU runs the sampling kernel still owes.
# GPU tests of the final sample_head (after the review's rounding fix), the kernel alone against torch's path
# (bench/sample_head_bench.py), where a 12-layer step goes now (bench/step_gap.py), and the Qwen3-8B table with it.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 -m pytest -q tests/test_sample_head.py tests/test_moe_route.py -rf 2>&1 | tail -2
timeout 90 python3 bench/sample_head_bench.py --batch 1,8,32 --out $OUT/sample_head48.json 2>&1 | tail -6
timeout 60 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset nvfp4-w4a16 --batch 1,8,32 \
  --out $OUT/step_gap48_nvfp4-w4a16.json 2>&1 | grep -v Warn | cut -c1-500
timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
  --kv bf16 --repeats 3 --tokens 8,40 --profile-batch '' --out $OUT/sampler48_8b.json > $OUT/sampler48_8b.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler48_8b.log | cut -c1-300 | tail -8
