#!/bin/bash
# Device call 6: GPU tests (decode engine incl. gemv32 copies, Gluon GEMV), sampler_gpu 8B and 30B.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${T_TEST:-150} python3 -m pytest tests/test_gpu_decode.py tests/test_triton_gemm.py -q -m gpu \
  -k "decode or gluon or graphs or gemv32" 2>&1 | tail -4
timeout ${T_S8:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --out $OUT/sampler_8b.json > $OUT/sampler_8b.log 2>&1
grep "^|\|^profile\|tokens_equal" $OUT/sampler_8b.log | tail -16
timeout ${T_S30:-95} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --out $OUT/sampler_30b.json > $OUT/sampler_30b.log 2>&1
grep "^|" $OUT/sampler_30b.log | tail -10
