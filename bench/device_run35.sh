#!/bin/bash
# Ninth session, first call: where a decode step's time goes at batch 1-32 (top kernels per step) on Qwen3-30B-A3B
# (12 layers) and Qwen3-8B at batch 32, and whether prefetching a GEMM's weights into L2 during DRAM-idle kernels
# pays (bench/l2_prefetch.py).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 120 python3 bench/l2_prefetch.py 2>&1 | grep -v '^{' | tail -12
timeout ${T_M:-220} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1,8,32 --fusion on --pdl on --out $OUT/sampler35_30b.json \
  > $OUT/sampler35_30b.log 2>&1
echo "exit $?"; grep -v '^{' $OUT/sampler35_30b.log | cut -c1-400 | tail -130
timeout ${T_D:-200} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 32 --fusion on --pdl on --out $OUT/sampler35_8b.json \
  > $OUT/sampler35_8b.log 2>&1
echo "exit $?"; grep -v '^{' $OUT/sampler35_8b.log | cut -c1-400 | tail -60
