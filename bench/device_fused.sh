#!/bin/bash
# The fused decode kernels (fp4rl/kernels/fused.py) on the H200: their GPU tests (bit-equality at Qwen3-8B
# widths, fused vs module step under CUDA graphs) and the Qwen3-8B sampler A/B, fused step vs module step,
# BF16 / W4A16 / W4A4 in one run (~6 minutes at most; every step under `timeout`). Run from the repo root.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline -1
echo "== GPU tests: fused kernels (all of the file: the CPU tests' bit-equality claims checked on the GPU too)"
timeout ${T_K:-60} python3 -m pytest -q -m "gpu or not gpu" tests/test_fused_kernels.py 2>&1 | tail -15
echo "== sampler A/B: fused on / off"
timeout ${T_B:-240} python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-8b:36 --batch 1,8 --kv bf16 \
  --repeats 1 --tokens 8,40 --profile-batch 1 --fusion on,off --out $OUT/sampler_8b_fused.json \
  > $OUT/sampler_8b_fused.log 2>&1
echo "exit $?"
grep '^|\|^profile\|Traceback\|"error"' $OUT/sampler_8b_fused.log | tail -30
echo "== GPU tests: decode engine"
timeout ${T_E:-60} python3 -m pytest -q -s -m gpu tests/test_gpu_decode.py 2>&1 | grep -v "^$" | tail -20
} 2>&1 | tee $OUT/device_fused.txt
