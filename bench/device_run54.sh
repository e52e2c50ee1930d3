#!/bin/bash
# Fourteenth session, last call. `router`: moe_route.router_route with its router GEMV split over the hidden
# columns as well (64 programs at E 128, H 2048 instead of 8), its GPU tests, its microbenchmark against cuBLAS's
# F.linear + the route kernel, and Qwen3-30B-A3B at full depth with it on (FP4RL_MOE_ROUTER=1) in both precisions,
# against bench/data/s14/sampler53_30b_final2.json (router off, same options).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = router ]; then
  timeout 80 python3 -m pytest -q tests/test_moe_route.py -rf -x 2>&1 | tail -4
  timeout 100 python3 bench/moe_route_bench.py router > $OUT/router_bench_s14.log 2>&1
  echo "bench exit $?"; cat $OUT/router_bench_s14.log | tail -8
  FP4RL_MOE_ROUTER=1 timeout 220 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets bf16,nvfp4-w4a16 --batch 1,8,32 --kv bf16 --repeats 3 --tokens 8,72 --profile-batch '' \
    --out $OUT/sampler54_30b_router.json > $OUT/sampler54_30b_router.log 2>&1
  echo "30b exit $?"; grep '^|\|rror' $OUT/sampler54_30b_router.log | cut -c1-300 | tail -10
  exit 0
fi
echo "usage: bash bench/device_run54.sh router"; exit 2
