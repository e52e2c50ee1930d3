#!/bin/bash
# Prepared in the fifty-first session for the next (bench/gpu_kernels.md, its Next items 1 and 4): 1) the Gluon
# NVFP4 attention's split counts with the warps merged in the CTA (the default since that session; the rule
# `_splits_gluon` was fitted when the last CTA merged splits x warps partials): bench/attn_splits.py at batch 1-8,
# 4 / 8 KV heads (the 30B's / the 8B's), 1K-32K, 1-48 splits; 2) the 8B at 4K in the sampler at batch 32 (one
# split) with and without the CTA merge. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
CASES="1:8:1024,1:8:2048,1:8:4096,1:8:8192,1:8:16384,1:8:32768,1:4:1024,1:4:2048,1:4:4096,1:4:8192,1:4:16384,\
2:8:4096,4:8:4096,4:4:4096,8:4:4096,8:4:16384,8:8:4096,8:8:16384" SPLITS=1,2,3,4,6,8,12,16,24,32,48 ROUNDS=3 \
  timeout 330 python3 bench/attn_splits.py 2>&1 | grep -v "^ \|^$" | tail -40
echo "splits at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler168_8b4k
left=$((${END:-575} - SECONDS)); [ $left -gt 150 ] && arm cta $((left / 2)) 32 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
left=$((${END:-575} + 10 - SECONDS)); [ $left -gt 70 ] && arm cta0 $left 32 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_CTA_MERGE=0
