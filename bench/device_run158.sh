#!/bin/bash
# Forty-ninth session, the validation call: 1) GPU tests of the FP8 cache write fused into the q/k-norm + RoPE
# kernel, the attention's operand checks and the Gluon kernel; 2) the Gluon NVFP4 attention's dispatcher
# ("auto": 2 warps a CTA where one wave of 4-warp CTAs overflows) against 1-2 splits at 2 / 4 warps; 3) the FP8
# cache's new split rule (default) against 1-32 splits; 4) Qwen3-8B at 4K context: the FP8 cache (fused write
# and new splits) against FP4RL_FUSED_KV=0 (its torch write), the NVFP4 cache at batch 64 against
# FP4RL_GLUON_WARPS=4, BF16 at batch 64 if time is left. Up to ~440 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/test_fused_kernels.py -k "fp8 or e4m3" \
    2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_attention.py \
    tests/test_gpu_decode_fused.py -k "gluon or fp8 or nvfp4 or long" 2>&1 | tail -1
echo "tests at ${SECONDS}s"
CASES="64:8:1024,64:8:4096,64:8:192,128:4:2048,48:8:1024,100:4:2048,32:8:1024" SPLITS=1,2 WARPS=4,2 ROUNDS=3 \
    timeout 90 python3 bench/attn_splits.py 2>&1 | grep "^b \|rror\|total"
mv -f $OUT/attn_splits.json $OUT/attn158_nvfp4.json 2>/dev/null
V=default,sp1,sp2,sp4,sp8,sp16,sp32
timeout 100 python3 bench/attention_bf16.py --kv fp8 --heads 32,8 --batch 1,8,32,64 --context 1024,4096 \
    --variants $V --rounds 5 --out $OUT/attn158_fp8_8b.json 2>&1 | grep "^| [0-9]\|MISMATCH\|rror" | cut -d'|' -f1-13
echo "attention at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler158_8b4k
arm fp8kv 110 1,8,32 "--kv fp8 --prompt 4096 --profile-batch=" X=0
arm fp8kv_torchwrite 90 1,8 "--kv fp8 --prompt 4096 --profile-batch=" FP4RL_FUSED_KV=0
arm nvfp4kv 80 64 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
arm nvfp4kv_w4 80 64 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_WARPS=4
left=$((${END:-430} - SECONDS)); [ $left -gt 50 ] && arm bf16 $left 64 "--presets bf16 --prompt 4096 --profile-batch=" X=0
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler158_8b4k_*.json 2>&1 | grep "step ms"
