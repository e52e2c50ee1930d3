#!/bin/bash
# Fifty-third session, one short call in place of device_run169 + 170 (the device budget went on failed starts):
# 1) the 8B's 32-row wgmma GEMMs with NT 2 (and its split x2 / /2) against the rule's NT 1 and cuBLAS BF16;
# 2) the Gluon attention's split rule 2 out of sample: 7 lengths past the capacity's power of two (the kernel
#    cuts whole 128-token blocks) and 8 capacities the fit did not see (batch 2-32, 64K); 3) the lengths cases
#    with DBG 64 (a split's tokens in whole 64-token steps); 4) the 8B at batch 32 (128-token prompts, BF16 KV),
#    the rule's NT 1 against FP4RL_WIDE_NT=2, as a pair if it fits. Up to END (default 480) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 100 python3 bench/mma16_sweep.py --rows 32 --variants wide,wide+nt2,wide+nt2+s2x,wide+nt2+sh \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep171_32.json > $OUT/sweep171_32.log 2>&1
echo "sweep32 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep171_32.log | grep -v "^copy" | cut -c1-150 | tail -24
CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420,1:8:32832:32800,\
1:8:65536,2:4:4096,4:8:16384,8:8:32768,12:8:4096,16:8:4096,24:8:2048,32:4:16384" \
SPLITS=1,2,3,4,6,8,12,16,24,32,48,64 ROUNDS=3 timeout 120 python3 bench/attn_splits.py 2>&1 \
  | grep -v "^ \|^$" | tail -17
echo "splits at ${SECONDS}s"
DBG=64 TAG=_q64 CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420" \
SPLITS=4,6,8,12,16,24,32 ROUNDS=3 timeout 60 python3 bench/attn_splits.py 2>&1 | grep -v "^ \|^$" | tail -8
echo "q64 at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler171_8b32
left=$((${END:-480} - SECONDS))
if [ $left -gt 170 ]; then  # the pair or neither
  arm nt1 $((left / 2 > 90 ? 90 : left / 2)) 32 "--profile-batch=" X=0
  left=$((${END:-480} - SECONDS))
  arm nt2 $((left > 90 ? 90 : left)) 32 "--profile-batch=" FP4RL_WIDE_NT=2
  python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler171_*.json
fi
