#!/bin/bash
# Fiftieth session: 1) GPU tests of the forty-ninth session's post-call fixes (the FP8 cache write's NaN / inf
# handling, FP8KVCache.quantize's full_like divisor under graph capture with FP4RL_FUSED_KV=0, the shared
# _kv_quant_store) and of the Gluon NVFP4 attention's one-split merge (no counter, no fence); 2) that merge
# timed against the counter (attn_s8 'counter1') where the dispatcher takes one split; 3) the FP8 cache's
# split count at batch 1-4 over 1K-16K (the capacity cap sqrt(t / (4 g)) of `_splits_fp8`: 'default' against
# 2-64 splits), Qwen3-8B heads (g 4) and the 30B's (g 8); 4) Qwen3-8B at 4K context, FP8 cache, batch 1: the
# cap (default) against FP4RL_FP8_SPLIT_COST=0 (the grid rule alone). Up to ~560 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fused_kernels.py \
    -k "fp8 or e4m3 or nvfp4" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_decode_fused.py tests/test_triton_attention.py \
    -k "fp8 or gluon" 2>&1 | tail -1
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
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler159_8b4k
left=$((${END:-555} - SECONDS)); [ $left -gt 150 ] && arm fp8kv $((left / 2)) 1 "--kv fp8 --prompt 4096 --profile-batch=" X=0
left=$((${END:-555} - SECONDS)); [ $left -gt 70 ] && arm fp8kv_cost0 $left 1 "--kv fp8 --prompt 4096 --profile-batch=" FP4RL_FP8_SPLIT_COST=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler159_8b4k_*.json 2>&1 | grep "step ms"
