#!/bin/bash
# Forty-eighth session: the BF16 cache's 32-token tiles past one wave (attention._bf16_block) at a rollout's
# batches and contexts, which device_run151 did not cover: batch 128 / 256 with the 8B's and the 30B's heads,
# and short rows in a 2048-slot cache (a rollout's cache is sized for its longest sequence). 'default' is the new
# rule, bt128 the old tile, bt64 for reference; outputs checked against float32 and SDPA first. Up to ~300 s.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
V=default,bt128,bt64
timeout 120 python3 bench/attention_bf16.py --heads 32,8 --batch 128,256 --context 512,1024,2048 --variants $V \
    --rounds 5 --out $OUT/attn153_8b_large.json 2>&1 | grep "^|"
timeout 90 python3 bench/attention_bf16.py --heads 32,4 --batch 128,256 --context 512,2048 --variants $V \
    --rounds 5 --out $OUT/attn153_30b_large.json 2>&1 | grep "^|"
timeout 90 python3 bench/attention_bf16.py --heads 32,8 --tcap 2048 --batch 32,64,128 --context 256,1024 \
    --variants $V --rounds 5 --out $OUT/attn153_8b_tcap2048.json 2>&1 | grep "^|"
