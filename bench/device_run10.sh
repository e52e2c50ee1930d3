#!/bin/bash
# Device call 10 (session 3, last minutes of device time): the CUDA sampler on Qwen3-8B shapes with this
# session's kernels (Gluon NVFP4 attention, one-block quantizer) - BF16 / W4A16 / W4A4 in the same run.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${T_S8:-200} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --out $OUT/sampler_8b_s3.json > $OUT/sampler_8b_s3.log 2>&1
grep "^|\|^profile\|^-\|step" $OUT/sampler_8b_s3.log | tail -24
