#!/bin/bash
# Tenth session, call 1: the grouped mma16 kernel reads the MoE gather itself (GPU tests, then an A/B of the
# W4A16 step at 12 layers: FP4RL_MOE_GATHER=1 vs 0 in two processes), then Qwen3-30B-A3B at full depth
# (48 layers; the trainer's BF16 weights go to host memory while the BF16 sampler is measured).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/test_gemv_cuda.py tests/test_moe_route.py \
  tests/test_triton_gemm.py -k "grouped or route or moe or rows" -rf 2>&1 | tail -3
for g in 1 0; do
  FP4RL_MOE_GATHER=$g timeout 80 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 \
    --presets nvfp4-w4a16 --batch 1,8,32 --kv bf16 --repeats 1 --tokens 8,40 --profile-batch '' \
    --out $OUT/sampler43_gather$g.json > $OUT/sampler43_gather$g.log 2>&1
  echo "gather $g exit $?"; grep '^|' $OUT/sampler43_gather$g.log | cut -c1-300 | tail -3
done
timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch 1 --out $OUT/sampler43_30b48.json \
  > $OUT/sampler43_30b48.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler43_30b48.log | cut -c1-300 | tail -8
