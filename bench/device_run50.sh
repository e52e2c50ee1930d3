#!/bin/bash
# Eleventh session, call 2 (the last: helpers spent most of the device time on the kernels' own GPU tests and
# benches): the MoE MLP in four launches (router GEMM inside the route kernel, combine inside the next
# add_rmsnorm, SiLU inside the down GEMM's x staging) and the BF16-cache decode attention in the engine: their
# GPU tests, then Qwen3-30B-A3B at full depth (48 layers), BF16 and W4A16, same engine, same run.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 110 python3 -m pytest -q -m "gpu or not gpu" tests/test_moe_route.py tests/test_gpu_decode.py \
  -k "route or moe or fold or graph or fused or padding" -x -rf 2>&1 | tail -4
timeout 35 python3 -m pytest -q -m gpu tests/test_fused_kernels.py -k moe -rf 2>&1 | tail -2
timeout 280 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --out $OUT/sampler50_30b48.json \
  > $OUT/sampler50_30b48.log 2>&1
echo "exit $?"; grep '^|\|rror\|arn' $OUT/sampler50_30b48.log | cut -c1-300 | tail -10
