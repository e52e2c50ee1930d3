#!/bin/bash
# Fiftieth session: 1) GPU tests of the forty-ninth session's post-call fixes (the FP8 cache write's NaN / inf
# handling, FP8KVCache.quantize's full_like divisor under graph capture with FP4RL_FUSED_KV=0, the shared
# _kv_quant_store); 2) the FP8 cache's split count at batch 1-4 over 1K-16K (the capacity cap sqrt(t / (4 g))
# of `_splits_fp8`: 'default' against 2-64 splits), Qwen3-8B heads (g 4) and the 30B's (g 8); 3) Qwen3-8B at
# 4K context, FP8 cache, batch 1: the cap (default) against FP4RL_FP8_SPLIT_COST=0 (the grid rule alone).
# Up to ~480 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fused_kernels.py \
    -k "fp8 or e4m3 or nvfp4" 2>&1 | tail -1
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_decode_fused.py tests/test_triton_attention.py \
    -k "fp8" 2>&1 | tail -1
FP4RL_FUSED_KV=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_decode_fused.py \
    -k "fp8" 2>&1 | tail -1
echo "tests at ${SECONDS}s"
V=default,sp2,sp4,sp8,sp16,sp32,sp64
timeout 120 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 1,2,4 --context 1024,2048,4096,8192,16384 \
    --variants $V --rounds 5 --out $OUT/attn159_fp8_g4.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror" | cut -d'|' -f1-13
timeout 80 python3 bench/attention_bf16.py --kv fp8 --heads 32,4 --batch 1,2 --context 1024,2048,4096,8192,16384 \
    --variants $V --rounds 5 --out $OUT/attn159_fp8_g8.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror" | cut -d'|' -f1-13
echo "attention at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler159_8b4k
arm fp8kv 100 1 "--kv fp8 --prompt 4096 --profile-batch=" X=0
arm fp8kv_cost0 100 1 "--kv fp8 --prompt 4096 --profile-batch=" FP4RL_FP8_SPLIT_COST=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler159_8b4k_*.json 2>&1 | grep "step ms"
