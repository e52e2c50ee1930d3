#!/bin/bash
# Fifty-fourth session: the Gluon NVFP4 attention's split rule 2 from 512 cache slots (GLUON_RULE2_MIN_SLOTS; it
# started at 1024, rule 1 below). device_run169 found batch 1 at 512 slots best at rule 2's 4 splits (6.4 / 6.2 us
# for 8 / 4 KV heads against rule 1's 2: 7.2 / 6.8). 1) bench/attn_splits.py at 256-1024 slots (batch 1-32, the
# sampler's 512-token prompt: 576 slots at 552 tokens; below 512 "chosen" is still rule 1's, rule 2's count is
# among the timed ones) and the doubling from one split (batch 20-48, most with b x hkv > the SMs: 24 x 8 at 2K
# lost 8% doubled); 2) in the sampler, NVFP4 cache, batch 1, 512-token prompts (576 slots: rule 2's 4 splits against
# rule 1's 2): a Qwen3-8B pair, Qwen3-30B-A3B at 24 layers, a second 8B pair, rule 2 (X=0) against
# FP4RL_GLUON_SPLIT_RULE=1 in fresh processes. At 512-1023 slots the dispatcher takes the larger of the two
# rules' counts (rule 2 alone would give batch x KV heads of 67-132 one split: 16:8:512 and 32:4:768 time both).
# (So the call ran; after it, plain rule 2 from 512 slots: bench/RESULTS.md, fifty-fourth session.)
# Up to END (default 360) seconds.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
CASES="1:8:576:552,1:4:576:552,1:8:768,1:4:768,1:8:1024:700,2:8:512,2:4:768,4:8:576:552,4:4:512,8:8:576:552,\
8:4:768,16:8:512,32:8:576:552,32:4:768,1:8:256,1:4:256,1:8:384,1:4:448:420,8:8:384,8:4:448" \
SPLITS=1,2,3,4,6,8,12,16 ROUNDS=3 TAG=_short timeout 100 python3 bench/attn_splits.py 2>&1 \
  | grep -v "^ \|^$" | tail -22
echo "short at ${SECONDS}s"
CASES="24:8:2048,24:8:8192,20:8:2048,20:8:8192,24:4:2048,40:4:2048,40:4:8192,48:4:4096" \
SPLITS=1,2,3,4,6,8 ROUNDS=3 TAG=_wave timeout 60 python3 bench/attn_splits.py 2>&1 | grep -v "^ \|^$" | tail -10
echo "wave at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler173_8b512
left=$((${END:-360} - SECONDS))
if [ $left -gt 120 ]; then  # the first pair (a cold compile cache on a fresh machine: 60 s an arm)
  arm rule2_1 60 1 "--kv nvfp4 --prompt 512 --profile-batch=" X=0
  arm rule1_1 60 1 "--kv nvfp4 --prompt 512 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
fi
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler173_30b512
left=$((${END:-360} - SECONDS))
if [ $left -gt 130 ]; then  # the pair or neither
  arm rule2 $((left / 2 > 80 ? 80 : left / 2)) 1 "--kv nvfp4 --prompt 512 --profile-batch=" X=0
  left=$((${END:-360} - SECONDS))
  arm rule1 $((left > 80 ? 80 : left)) 1 "--kv nvfp4 --prompt 512 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
fi
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler173_8b512
left=$((${END:-360} - SECONDS))
if [ $left -gt 85 ]; then  # the second 8B pair, both arms
  arm rule2_2 40 1 "--kv nvfp4 --prompt 512 --profile-batch=" X=0
  arm rule1_2 40 1 "--kv nvfp4 --prompt 512 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
fi
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler173_*.json
