#!/bin/bash
# Forty-eighth session: the BF16-cache decode attention at short contexts and large grids. device_run150's
# batch-32 profile of Qwen3-8B (8 KV heads, T_cap 192) put the attention at 15.2 us a layer, ~2x its bytes at
# the copy bandwidth: 256 programs of 139 KB shared memory each (128-token tiles, 3 stages) are one CTA an SM,
# two waves, while a 192-slot cache has only 2 tiles to pipeline. Launch settings swept on both models' heads
# (graph replay, rotated caches, outputs checked against float32 and SDPA first). Up to ~400 s.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
V=default,s2,bt64,bt64-s2,bt32,bt64-sp2,w8,bt64-w8
timeout 260 python3 bench/attention_bf16.py --heads 32,8 --batch 8,16,32,64 --context 192,512,1024,4096 \
    --variants $V --rounds 5 --kernel-info --out $OUT/attn151_8b.json 2>&1 | tail -80
timeout 150 python3 bench/attention_bf16.py --heads 32,4 --batch 1,32,64 --context 192,1024,4096 \
    --variants $V --rounds 5 --out $OUT/attn151_30b.json 2>&1 | tail -40
