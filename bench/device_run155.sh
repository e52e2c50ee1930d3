#!/bin/bash
# Prepared in the forty-eighth session (no device time left), for the next: the FP8 cache's decode attention at
# batch 32-64, where its grid may run in waves (bench/gpu_kernels.md, forty-eighth session, Next item 3): 128-token
# tiles x 3 stages take 75776 B a CTA (bench/attn_smem.py), three a multiprocessor, and `_splits` aims at four
# programs a multiprocessor, so Qwen3-8B's heads at batch 32 with >= 512 slots run 512 programs (1.3 waves).
# Launch settings swept as device_run151 did for the BF16 cache (outputs checked first). Up to ~300 s.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
V=default,sp1,sp2,bt64,bt32,s2,bt64-sp1
timeout 170 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 8,32,64 --context 192,512,1024,4096 \
    --variants $V --rounds 5 --kernel-info --out $OUT/attn155_fp8_8b.json 2>&1 | grep "^|\|MISMATCH\|rror"
timeout 120 python3 bench/attention_bf16.py --kv fp8 --heads 32,4 --batch 32,64,128 --context 512,2048 \
    --variants $V --rounds 5 --out $OUT/attn155_fp8_30b.json 2>&1 | grep "^|\|MISMATCH\|rror"
