#!/bin/bash
# Fifty-third session: the 8B's 32-row W4A16 GEMMs (2.9 ms of its batch-32 step; the eighteenth session's item 1).
# On an H100: 1) the wgmma build with NT 2 (two m64 tiles a warpgroup: the step's fixed instructions over twice
# the weights, half the CTAs) timed again now that XPRE is in, with its split doubled / halved and XPRE 2, on
# Qwen3-8B's four shapes and the 14336x4096 at 24 / 32 rows, against cuBLAS BF16 in the same run; 2) the
# 8B at batch 32 (128-token prompts, BF16 KV) with the rule's NT 1 against FP4RL_WIDE_NT=2, fresh processes.
# On an H200 instead: the 48-layer 30B (device_run149's arms, owed since the forty-first session). Up to END
# (default 560) s: a call of its own.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  END=${END:-560} bash bench/device_run149.sh
  exit
fi
timeout ${T_W:-170} python3 bench/mma16_sweep.py --rows 24,32 \
  --variants wide,wide+nt2,wide+nt2+s2x,wide+nt2+sh,wide+nt2+xp2,wide+s2x,wide+sh \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep170_32.json > $OUT/sweep170_32.log 2>&1
echo "sweep32 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep170_32.log | grep -v '^copy' | cut -c1-140 | tail -75
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler170_8b32
for i in 1 2; do
  left=$((${END:-560} - SECONDS)); [ $left -gt 150 ] || break  # both arms of the pair fit
  arm nt1_$i 75 32 "--profile-batch=" X=0
  arm nt2_$i 75 32 "--profile-batch=" FP4RL_WIDE_NT=2
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler170_*.json
