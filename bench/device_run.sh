#!/bin/bash
# One device call: Gluon GEMV sweep + GPU GEMM tests + sampler_gpu (bench/gpu_kernels.md, 2026-11-29 session 2).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)"
timeout ${T_SWEEP:-200} python3 bench/gemv_sweep.py --out $OUT/sweep.json 2>&1 | tee $OUT/sweep.log | tail -60
timeout ${T_TEST:-90} python3 -m pytest tests/test_triton_gemm.py -x -q -k "not every_config" 2>&1 | tail -3
timeout ${T_S8:-170} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --out $OUT/sampler_8b.json > $OUT/sampler_8b.log 2>&1
tail -25 $OUT/sampler_8b.log
timeout ${T_S30:-100} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:12 --batch 1,8,32 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch '' --out $OUT/sampler_30b.json > $OUT/sampler_30b.log 2>&1
tail -12 $OUT/sampler_30b.log
