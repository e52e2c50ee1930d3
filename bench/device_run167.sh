#!/bin/bash
# Fifty-first session: the Gluon NVFP4 attention's warps merged in the CTA (`_cta_merge`: through shared
# memory, one slot a CTA; one split writes the output with no global round trip). 1) its GPU tests; 2) timed
# against the fiftieth session's merge (attn_s8 'warp_slots', DBG 16) where the fixed cost shows (batch 1 at
# 4K, 8 and 4 KV heads; 'cta_all': the CTA merge at every split count, also with more splits; one split at 192 slots;
# batch 8 at 32K, the case); 3) Qwen3-8B at 4K, NVFP4 cache, in the sampler, default against
# FP4RL_GLUON_CTA_MERGE=2 / 0; and the grouped switches' GPU tests the EARLY removal rewrote. Up to ~590 s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_triton_attention.py -k "gluon or long_context" \
    2>&1 | grep -E "PASS|FAIL|ERROR|Error|assert| passed| failed" | tail -14
# the grouped switches' GPU tests that the EARLY build's removal rewrote
timeout 90 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gemv_cuda_grouped_switches.py \
    2>&1 | grep -E "PASS|FAIL|ERROR|Error|assert| passed| failed" | tail -12
echo "tests at ${SECONDS}s"
for c in "1 8 4096 cta_all,cta_all+splits16,cta_all+splits24" "1 4 4096 cta_all,cta_all+splits12" \
         "1 8 192 warp_slots" "32 8 192 warp_slots" "32 8 4096 warp_slots" "8 8 32768 cta_all"; do
  set -- $c
  BATCH=$1 HKV=$2 ROUNDS=3 timeout 45 python3 bench/attn_s8.py $3 default,$4 2>&1 | grep "^context\|^| [a-z]\|rror"
done
echo "attention at ${SECONDS}s"
ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler167_8b4k
# the default merges in the CTA at one split (batch 32 here); =2 at every split count; =0 never
left=$((${END:-575} - SECONDS)); [ $left -gt 200 ] && arm cta1 $((left * 4 / 10)) 1,8,32 "--kv nvfp4 --prompt 4096 --profile-batch=" X=0
left=$((${END:-575} - SECONDS)); [ $left -gt 120 ] && arm cta2 $((left * 6 / 10)) 1,8 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_CTA_MERGE=2
left=$((${END:-575} + 10 - SECONDS)); [ $left -gt 60 ] && arm cta0 $left 32 "--kv nvfp4 --prompt 4096 --profile-batch=" FP4RL_GLUON_CTA_MERGE=0
