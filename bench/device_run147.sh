#!/bin/bash
# Forty-seventh session: why the BF16 sampler of the full 48-layer Qwen3-30B-A3B (57 GiB of weights) runs out of
# an 80 GB card's memory with 78.55 GiB allocated (device_run146, and the thirty-eighth session's device_run116)
# while its NVFP4 arms now fit: bench/sampler_memory.py's GPU memory after each stage, 8 layers BF16 and NVFP4,
# then 48 layers BF16 until it stops.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name --format=csv,noheader
SECONDS=0
timeout 120 python3 bench/sampler_memory.py --shape qwen3-30b-a3b:8 --preset bf16 2>&1 | grep -v Warn | tail -12
echo "at ${SECONDS}s"
timeout 120 python3 bench/sampler_memory.py --shape qwen3-30b-a3b:8 --preset nvfp4-w4a16 2>&1 | grep -v Warn | tail -12
echo "at ${SECONDS}s"
timeout 240 python3 bench/sampler_memory.py --shape qwen3-30b-a3b:48 --preset bf16 --batch 1 2>&1 | grep -v Warn \
    | cut -c1-600 | tail -12
echo "at ${SECONDS}s"
