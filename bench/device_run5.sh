#!/bin/bash
# Device call 5: GPU GEMM tests (Gluon GEMV 1-16 rows), gpu_kernels copy+gemm, sampler_gpu (8B, 30B).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
timeout ${T_TEST:-110} python3 -m pytest tests/test_triton_gemm.py -x -q -m gpu -k "gluon or asm" 2>&1 | tail -3
timeout ${T_K:-200} python3 bench/gemv_sweep.py --rows 1,2,4,8,16 --max-cfg 3 --max-triton 2 \
  --out $OUT/sweep5.json > $OUT/sweep5.log 2>&1; grep -v "^[0-9]*x[0-9]* m" $OUT/sweep5.log | tail -4
timeout ${T_S8:-150} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --out $OUT/sampler_8b.json > $OUT/sampler_8b.log 2>&1
grep "^|\|^profile" $OUT/sampler_8b.log | tail -14
timeout ${T_S30:-95} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --out $OUT/sampler_30b.json > $OUT/sampler_30b.log 2>&1
grep "^|" $OUT/sampler_30b.log | tail -10
