#!/bin/bash
# Ninth session, second call: the MoE route and combine kernels (fp4rl/kernels/moe_route.py) on the GPU (their
# tests and the decode engine's MoE GPU tests), then Qwen3-30B-A3B (12 layers) at batch 1, 8, 32 with the fused
# route and, in a second process of the same call, with the torch route (FP4RL_MOE_ROUTE=0).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 -m pytest -q -m "not slow" tests/test_moe_route.py -rf 2>&1 | tail -3
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_decode.py -rf 2>&1 | tail -4
timeout 100 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k grouped -rf 2>&1 | tail -3
for route in 1 0; do
  FP4RL_MOE_ROUTE=$route timeout ${T_M:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:${LAYERS:-12} \
    --batch 1,8,32 --kv bf16 --repeats 1 --tokens 8,40 --profile-batch ${PROF:-32} --fusion on --pdl on \
    --out $OUT/sampler36_30b_route$route.json > $OUT/sampler36_30b_route$route.log 2>&1
  echo "route $route exit $?"; grep '^|' $OUT/sampler36_30b_route$route.log | cut -c1-300 | tail -9
  grep -A6 '^profile' $OUT/sampler36_30b_route$route.log | cut -c1-330 | head -${PL:-28}
done
