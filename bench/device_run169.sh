#!/bin/bash
# Fifty-second session: the Gluon NVFP4 attention's refitted split rule (`_splits_gluon`, rule 2) checked out of
# sample: 1) bench/attn_splits.py on cases the fit did not see (batch 1-32, 4 / 8 KV heads, 512-64K, batch x KV heads past the SMs; "chosen" is
# rule 2, every ladder count timed so rule 1's is among them); 2) Qwen3-8B at 4K in the sampler, NVFP4 cache,
# batch 1 / 8 (rule 2: 16 / 4 splits, rule 1: 12 / 4), rule 2 against FP4RL_GLUON_SPLIT_RULE=1 alternating in
# fresh processes; 3) Qwen3-30B-A3B (24 layers) at 4K, batch 1 (16 splits against 8), if time is left. Up to END.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
CASES="1:8:512,1:4:512,1:8:65536,1:4:32768,2:4:4096,2:8:8192,2:8:16384,4:4:8192,4:4:16384,4:8:16384,8:8:32768,\
12:8:4096,16:8:4096,16:4:4096,16:4:16384,24:8:4096,24:8:32768,32:4:4096,32:4:16384" SPLITS=1,2,3,4,6,8,12,16,24,32,48,64 ROUNDS=3 \
  timeout 170 python3 bench/attn_splits.py 2>&1 | grep -v "^ \|^$" | tail -20
echo "splits at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler169_8b4k
for i in 1 2; do
  left=$((${END:-560} - SECONDS)); [ $left -gt 80 ] || break
  arm rule2_$i 70 1,8 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
  arm rule1_$i 70 1,8 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
done
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler169_30b4k
left=$((${END:-560} - SECONDS)); [ $left -gt 200 ] && arm rule2 $((left / 2)) 1 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
left=$((${END:-560} + 10 - SECONDS)); [ $left -gt 90 ] && arm rule1 $left 1 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler169_*.json
