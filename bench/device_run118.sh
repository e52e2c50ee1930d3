#!/bin/bash
# Thirty-eighth session, H100: device_run117 found the three folds together slower at batch 1 (30B at 24 layers
# +8.8%, 8B with ATTN_ROPE + DENSE_NORM +7.1%). Each flag alone at batch 1, against the defaults measured again in
# this call: the 30B (24 layers) with ATTN_ROPE / ROUTER_NORM / DENSE_NORM; the 8B with ATTN_ROPE / DENSE_NORM,
# its defaults and DENSE_NORM with the replay chain (--profile-batch=1: each kernel's time per step). ~400 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler118_30b
arm defaults 90 1 "--profile-batch=" X=0
arm rope 90 1 "--profile-batch=" FP4RL_ATTN_ROPE=1
arm router_norm 90 1 "--profile-batch=" FP4RL_MOE_ROUTER_NORM=1
arm dense_norm 90 1 "--profile-batch=" FP4RL_DENSE_NORM=1
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler118_8b
arm defaults 70 1 "--profile-batch=1" X=0
arm rope 60 1 "--profile-batch=" FP4RL_ATTN_ROPE=1
arm dense_norm 70 1 "--profile-batch=1" FP4RL_DENSE_NORM=1
grep -i "disabled\|failed" $OUT/sampler118_*.log | sort | uniq -c | head
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler118_30b_*.json | grep -v "^sampler118.*checks"
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler118_8b_*.json | grep -v "^sampler118.*checks" | head -80
