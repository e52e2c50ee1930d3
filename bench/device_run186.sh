#!/bin/bash
# Fifty-sixth session, eighth: the WARPS rule refitted (17-32 rows: up to three 8-warp CTAs a SM, so the 8B's
# gate/up 24576x4096 takes WARPS 4 too). 1) 24576x4096 and 19456x2560 at 17-32 rows, 8 warps against 4;
# 2) Qwen3-8B at batch 24 / 32 (every 32-row GEMM now WARPS 4) against FP4RL_WIDE_WARPS=8, fresh processes,
# in pairs: compare with device_run184's -2.1 / -2.2% (gate/up at 8 warps). Up to END (default 400) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 60 python3 bench/mma16_sweep.py --rows 17,24,32 --variants wide+wp8,wide+wp4 \
  --shapes 24576x4096,19456x2560 --out $OUT/sweep186.json > $OUT/sweep186.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep ' us ' $OUT/sweep186.log | cut -c1-60
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler186_8b
for i in 1 2; do
  left=$((${END:-400} - SECONDS)); [ $left -gt 90 ] || break
  arm rule_$i 60 24,32 "--profile-batch=" X=0
  arm w8_$i 60 24,32 "--profile-batch=" FP4RL_WIDE_WARPS=8
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler186_*.json
