#!/bin/bash
# Eighth session: the CTA's warps combined in shared memory before publishing (6 partials per (b, kv head)
# instead of 24): correctness (attn_s7 cases, GPU tests), then timing against the per-warp publish.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
timeout 100 python3 bench/attn_s7.py 32768 2>&1 | grep "checks\|^| 32768\|Error" | head -5
ROUNDS=9 timeout 100 python3 bench/attn_s8.py 32768 default,per_warp,merge_one,warps2 2>&1 | grep "^|\|context"
ROUNDS=5 timeout 100 python3 bench/attn_s8.py 4096 default,per_warp 2>&1 | grep "^| [dp]\|context"
BATCH=1 ROUNDS=5 timeout 100 python3 bench/attn_s8.py 32768 default,per_warp 2>&1 | grep "^| [dp]\|context"
timeout 240 python3 -m pytest -q -m gpu tests/test_triton_attention.py tests/test_gpu_decode.py -rf 2>&1 | tail -3
