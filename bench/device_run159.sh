#!/bin/bash
# Fiftieth session: 1) GPU tests of the forty-ninth session's post-call fixes (the FP8 cache write's NaN / inf
# handling, FP8KVCache.quantize's full_like divisor under graph capture with FP4RL_FUSED_KV=0, the shared
# _kv_quant_store) and of the Gluon NVFP4 attention's one-split merge (no counter, no fence); 2) that merge
# timed against the counter (attn_s8 'counter1') where the dispatcher takes one split; 3) the FP8 cache's
# split count at batch 1-4 over 1K-16K (the capacity cap sqrt(t / (4 g)) of `_splits_fp8`: 'default' against
# 2-64 splits), Qwen3-8B heads (g 4) and the 30B's (g 8). The sampler's A/B arms: device_run160.sh. Up to ~520 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fused_kernels.py \
    -k "fp8 or e4m3 or nvfp4" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_decode_fused.py tests/test_triton_attention.py tests/test_pdl.py \
    -k "fp8 or gluon or pdl" 2>&1 | tail -1
FP4RL_FUSED_KV=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_decode_fused.py \
    -k "fp8" 2>&1 | tail -1
echo "tests at ${SECONDS}s"
for c in "1 8 192" "32 8 192" "64 8 192" "32 8 4096"; do
  set -- $c
  BATCH=$1 HKV=$2 ROUNDS=3 timeout 40 python3 bench/attn_s8.py $3 default,counter1 2>&1 | grep "^context\|^| [dc]"
done
mv -f $OUT/attn_s8_*.json /tmp/ 2>/dev/null
echo "one-split merge at ${SECONDS}s"
V=default,sp2,sp4,sp8,sp16,sp32,sp64
timeout 110 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 1,2,4 --context 1024,2048,4096,8192,16384 \
    --variants $V --rounds 5 --out $OUT/attn159_fp8_g4.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror" | cut -d'|' -f1-13
timeout 50 python3 bench/attention_bf16.py --kv fp8 --heads 32,4 --batch 1 --context 1024,2048,4096,8192,16384 \
    --variants $V --rounds 5 --out $OUT/attn159_fp8_g8.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror" | cut -d'|' -f1-13
echo "attention at ${SECONDS}s"
