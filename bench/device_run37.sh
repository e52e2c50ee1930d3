#!/bin/bash
# Ninth session, third call: the route kernel's warps / sort width (bench/moe_route_bench.py), then Qwen3-30B-A3B
# at its full depth (48 layers) in BF16 and W4A16 at batch 1, 8, 32 (two repeats per point), profile at batch 1.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 100 python3 bench/moe_route_bench.py 2>&1 | tail -8
timeout ${T_M:-420} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:${LAYERS:-48} --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch ${PROF:-1} --fusion on --pdl on \
  --out $OUT/sampler37_30b.json > $OUT/sampler37_30b.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler37_30b.log | cut -c1-300 | tail -9
grep -A14 '^profile' $OUT/sampler37_30b.log | cut -c1-330 | head -32
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
