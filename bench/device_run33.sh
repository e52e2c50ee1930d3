#!/bin/bash
# Eighth session, final call: GPU tests of everything the attention change reaches (the kernel, the decode
# engine that calls it), the correctness cases and timing of attn_s7.py, the standard attention section of
# fp4rl.benchmarks.gpu_kernels (new split rule, all contexts), and the 32K batch-8 figure in 9 rounds.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 240 python3 -m pytest -q -m gpu tests/test_triton_attention.py tests/test_gpu_decode.py tests/test_fused_kernels.py \
  -rf 2>&1 | tail -3
timeout 100 python3 bench/attn_s7.py 32768 2>&1 | grep "checks\|^| 32768"
timeout 150 python3 -m fp4rl.benchmarks.gpu_kernels --sections attention --workers 0 --out $OUT/attn33_gk.json 2>&1 \
  | grep "^|\|copy" | tail -12
ROUNDS=9 timeout 100 python3 bench/attn_s8.py 32768 default,tile_max 2>&1 | grep "^|\|context"
