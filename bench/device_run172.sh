#!/bin/bash
# Fifty-third session, the shortest call (device_run171 cut to what ~330 s allows, the budget spent on failed
# starts): 1) the 8B's 32-row wgmma GEMMs with NT 2 (and its split doubled) against the rule's NT 1 and cuBLAS
# BF16; 2) where NT 2 wins by more than 3% on at least two of the 8B's four shapes, the 8B at batch 32 (128-token
# prompts, BF16 KV) with NT 1 against FP4RL_WIDE_NT=2 in fresh processes; else the Gluon attention's split rule
# 2 out of sample (device_run171's 15 cases) and the lengths cases with DBG 64. Up to END (default 330) s.
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 80 python3 bench/mma16_sweep.py --rows 32 --variants wide,wide+nt2,wide+nt2+s2x \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep172_32.json > $OUT/sweep172_32.log 2>&1
echo "sweep32 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep172_32.log | grep -v "^copy" | cut -c1-150 | tail -16
wins=$(python3 - $OUT/sweep172_32.log <<'PY'
import re, sys
best = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\d+x\d+) m +32 +([\d.]+) us .* (wide\S*) \{", line)
    if m:
        shape, us, name = m.group(1), float(m.group(2)), m.group(3)
        key = (shape, "nt2" if "nt2" in name else "nt1")
        best[key] = min(best.get(key, 1e9), us)
eight = ("6144x4096", "4096x4096", "24576x4096", "4096x12288")
print(sum(1 for s in eight if (s, "nt1") in best and (s, "nt2") in best and best[s, "nt2"] < 0.97 * best[s, "nt1"]))
PY
)
echo "NT 2 wins on ${wins:-?} of the 8B's 4 shapes"
if [ "${wins:-0}" -ge 2 ]; then
  ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler172_8b32
  left=$((${END:-330} - SECONDS))
  if [ $left -gt 150 ]; then
    arm nt1 $((left / 2 > 90 ? 90 : left / 2)) 32 "--profile-batch=" X=0
    left=$((${END:-330} - SECONDS))
    arm nt2 $((left > 90 ? 90 : left)) 32 "--profile-batch=" FP4RL_WIDE_NT=2
    python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler172_*.json
  fi
else
  left=$((${END:-330} - SECONDS - 50)); left=$((left < 10 ? 10 : left))  # (timeout 0 would mean no limit)
  CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420,1:8:32832:32800,\
1:8:65536,2:4:4096,4:8:16384,8:8:32768,12:8:4096,16:8:4096,24:8:2048,32:4:16384" \
  SPLITS=1,2,3,4,6,8,12,16,24,32,48,64 ROUNDS=3 timeout $((left > 120 ? 120 : left)) python3 bench/attn_splits.py \
    2>&1 | grep -v "^ \|^$" | tail -17
  echo "splits at ${SECONDS}s"
  left=$((${END:-330} - SECONDS)); left=$((left < 10 ? 10 : left))
  DBG=64 TAG=_q64 CASES="1:8:4160:4120,1:4:4160:4120,1:8:2112:2070,1:4:2112:2070,8:8:4160:4120,8:4:16448:16420" \
  SPLITS=4,6,8,12,16,24,32 ROUNDS=3 timeout $((left > 60 ? 60 : left)) python3 bench/attn_splits.py 2>&1 \
    | grep -v "^ \|^$" | tail -8
  echo "q64 at ${SECONDS}s"
fi
