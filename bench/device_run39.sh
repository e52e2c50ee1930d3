#!/bin/bash
# Ninth session, last call: GPU tests of the route review fixes and of the per-step additive attention mask
# (gpu_decode._context), where the 1-row GEMM's fixed cost goes (bench/gemm_fixed.py), and the sampler table
# again (Qwen3-8B BF16 / W4A16; Qwen3-30B-A3B 12 layers, every preset).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 60 python3 -m pytest -q -m "not slow" tests/test_moe_route.py -rf 2>&1 | tail -2
timeout 130 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rf 2>&1 | tail -3
timeout 80 python3 bench/gemm_fixed.py 2>&1 | tail -14
timeout 110 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --presets bf16,nvfp4-w4a16 --batch 1,8,32 \
  --kv bf16 --repeats 1 --tokens 8,40 --profile-batch 1 --fusion on --pdl on --out $OUT/sampler39_8b.json \
  > $OUT/sampler39_8b.log 2>&1
echo "exit $?"; grep '^|' $OUT/sampler39_8b.log | cut -c1-300 | tail -6; grep -A7 '^profile' $OUT/sampler39_8b.log | cut -c1-300
timeout 110 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 --repeats 2 \
  --tokens 8,40 --profile-batch '' --fusion on --pdl on --out $OUT/sampler39_30b.json > $OUT/sampler39_30b.log 2>&1
echo "exit $?"; grep '^|' $OUT/sampler39_30b.log | cut -c1-300 | tail -9
