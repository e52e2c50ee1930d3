#!/bin/bash
# Fifty-second session: the Gluon NVFP4 attention's refitted split rule (`_splits_gluon`, rule 2) checked out of
# sample. 1) bench/attn_splits.py on cases the fit did not see (batch 1-32, 4 / 8 KV heads, 512-64K, batch x KV
# heads past the SMs) and at lengths past the capacity's power of two, as in the sampler mid-decode (b:hkv:t:len;
# the kernel cuts a sequence into whole 128-token blocks, so there two counts can run the same CTAs); "chosen"
# is rule 2, every ladder count timed, so rule 1's is among them; its JSON is written after each case. 2) In the
# sampler, rule 2 against FP4RL_GLUON_SPLIT_RULE=1 in fresh processes, NVFP4 cache, batch 1: Qwen3-30B-A3B (24
# layers) at a 4K prompt (16 splits against 8: 11 working CTAs against 7), then Qwen3-8B at a 2K prompt (16
# against 8: 9 against 6; at a 4K prompt both run 11). Before them the Gluon kernel's GPU tests (DBG 64 new)
# and the lengths cases with DBG 64 (up to ~440 s before the arms). Up to END (default 560) seconds: run it
# with END=560 in a call of its own.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
# the Gluon kernel's GPU tests first (DBG 64, a split's tokens in whole steps, added after the last call)
timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_triton_attention.py -k "gluon_kernel" \
  -rfE > $OUT/gpu_gluon169.log 2>&1; echo "gluon tests exit $? at ${SECONDS}s"
grep -E " passed| failed|FAILED|ERROR" $OUT/gpu_gluon169.log | tail -10
CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420,1:8:32832:32800,\
1:8:512,1:4:512,1:8:65536,1:4:32768,2:4:4096,2:8:8192,2:8:16384,4:4:8192,4:4:16384,4:8:16384,8:8:32768,\
12:8:4096,16:8:4096,16:4:4096,16:4:16384,24:8:2048,24:8:4096,24:8:32768,32:4:4096,32:4:16384" \
SPLITS=1,2,3,4,6,8,12,16,24,32,48,64 ROUNDS=3 timeout ${T_S:-200} python3 bench/attn_splits.py 2>&1 \
  | grep -v "^ \|^$" | tail -30
echo "splits at ${SECONDS}s"
# the lengths past a power of two again with DBG 64 (splits in whole 64-token steps): 16 splits of 4120 tokens
# run 13 CTAs of 320 instead of 11 of 384 (attn_splits_q64.json)
DBG=64 TAG=_q64 CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420" \
SPLITS=4,6,8,12,16,24,32 ROUNDS=3 timeout 90 python3 bench/attn_splits.py 2>&1 | grep -v "^ \|^$" | tail -8
echo "q64 at ${SECONDS}s"
ARM_SHAPE=qwen3-30b-a3b:24 ARM_PREFIX=sampler169_30b4k
left=$((${END:-560} - SECONDS))
if [ $left -gt 160 ]; then  # the pair or neither
  arm rule2 $((left / 2 > 150 ? 150 : left / 2)) 1 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
  left=$((${END:-560} - SECONDS))
  arm rule1 $((left > 150 ? 150 : left)) 1 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
fi
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler169_8b2k
for i in 1 2; do
  left=$((${END:-560} - SECONDS)); [ $left -gt 130 ] || break  # both arms of the pair fit
  arm rule2_$i 60 1 "--kv nvfp4 --prompt 2048 --profile-batch=" X=0
  arm rule1_$i 60 1 "--kv nvfp4 --prompt 2048 --profile-batch=" FP4RL_GLUON_SPLIT_RULE=1
done
python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler169_*.json
