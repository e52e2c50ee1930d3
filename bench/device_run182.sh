#!/bin/bash
# Fifty-sixth session, fourth: WARPS 4 in choose_wide's rule. 1) the wide GPU tests (WARPS 4 bit for bit against
# the 8-warp build, and the WS / ASH / x staging / reference tests with the rule's plans); 2) out of sample: the
# rule against WARPS 8 / 4 forced on shapes the rule was not fitted on (Qwen3-30B-A3B's attention, Qwen3-4B,
# Qwen3-14B) at 24-64 rows; 3) the 8B at batch 32 (128-token prompts, BF16 KV, W4A16): the rule against
# FP4RL_WIDE_WARPS=8, fresh processes, in pairs while the call lasts (END, default 560 s).
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 200 python3 -m pytest -q -m gpu tests/test_gemv_cuda_wide.py -x > $OUT/tests182.log 2>&1
echo "wide GPU tests exit $? at ${SECONDS}s"; tail -4 $OUT/tests182.log | cut -c1-300
timeout 120 python3 bench/mma16_sweep.py --rows 24,32,48,64 --variants wide,wide+wp8,wide+wp4 \
  --shapes 5120x2048,2048x4096,6144x2560,2560x9728,19456x2560,7168x5120,5120x17408 \
  --out $OUT/sweep182.json > $OUT/sweep182.log 2>&1
echo "sweep exit $? at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler182_8b32
for i in 1 2; do
  left=$((${END:-560} - SECONDS)); [ $left -gt 150 ] || break  # both arms of the pair fit
  arm rule_$i 75 32 "--profile-batch=" X=0
  arm w8_$i 75 32 "--profile-batch=" FP4RL_WIDE_WARPS=8
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler182_*.json
