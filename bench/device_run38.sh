#!/bin/bash
# Ninth session, final call: the route kernel's final defaults (tests, bench/moe_route_bench.py), then the sampler
# table: Qwen3-30B-A3B 12 layers (every preset) and 24 layers (BF16, W4A16; 48 do not fit BF16 twice), Qwen3-8B.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 60 python3 -m pytest -q -m "not slow" tests/test_moe_route.py -rf 2>&1 | tail -2
timeout 50 python3 bench/moe_route_bench.py 2>&1 | tail -6
timeout 140 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 --repeats 2 \
  --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler38_30b12.json > $OUT/sampler38_30b12.log 2>&1
echo "exit $?"; grep '^|' $OUT/sampler38_30b12.log | cut -c1-300 | tail -9
timeout 140 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:24 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
  --kv bf16 --repeats 1 --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler38_30b24.json \
  > $OUT/sampler38_30b24.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler38_30b24.log | cut -c1-300 | tail -6
timeout 160 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8,32 --kv bf16 --repeats 1 \
  --tokens 8,40 --profile-batch 8 --fusion on --pdl on --out $OUT/sampler38_8b.json > $OUT/sampler38_8b.log 2>&1
echo "exit $?"; grep '^|' $OUT/sampler38_8b.log | cut -c1-300 | tail -9; grep -A8 '^profile' $OUT/sampler38_8b.log | cut -c1-300
