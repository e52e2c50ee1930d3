#!/bin/bash
# Forty-eighth session: the BF16 cache's attention takes 32-token tiles when its grid has more programs than
# multiprocessors (attention._bf16_block; device_run151's sweep). 1) The BF16 cache's GPU tests (new: batch 48 x 4
# KV heads at 192 and 4096 slots) and graph replays. 2) Qwen3-8B at batch 1 / 8 / 32 / 64, BF16 and the W4A16
# defaults, each with the new tile and with FP4RL_ATTN_WIDE_TILE=128 (the old one), fresh processes. 3) As long as
# the call allows: Qwen3-30B-A3B at 24 layers, batch 32 / 64, the same four arms. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_bf16.py -k "gpu_bf16" 2>&1 | tail -2
echo "tests at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler152_8b
arm bf16 90 1,8,32,64 "--profile-batch= --presets bf16" X=0
arm bf16_t128 90 1,8,32,64 "--profile-batch= --presets bf16" FP4RL_ATTN_WIDE_TILE=128
arm defaults 90 1,8,32,64 "--profile-batch=" X=0
arm defaults_t128 90 1,8,32,64 "--profile-batch=" FP4RL_ATTN_WIDE_TILE=128
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler152_8b_*.json
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler152_30b
for a in "defaults X=0" "defaults_t128 FP4RL_ATTN_WIDE_TILE=128" "bf16 X=0 --presets bf16" "bf16_t128 FP4RL_ATTN_WIDE_TILE=128 --presets bf16"; do
  set -- $a
  left=$((585 - SECONDS)); [ $left -lt 70 ] && { echo "no time for $1"; continue; }
  [ $left -gt 110 ] && left=110
  arm $1 $left 32,64 "--profile-batch= $3 $4" $2
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler152_30b_*.json
