#!/bin/bash
# Forty-eighth session, last call: 1) the BF16 cache's GPU tests after the tile rule's review (the graph-replay
# case past one wave: batch 48 x 4 KV heads, 32-token tiles); the bounded rule timed at the cases that bound it
# (default = the rule, bt128 the old tile, bt32 the wide tile). 2) On an H200 only: the full 48-layer 30B's BF16
# and defaults arms (device_run149 with END, as long as the call allows).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_bf16.py -k "gpu_bf16" 2>&1 | tail -1
for h in "32,4 --batch 256 --context 2048" "32,8 --batch 128 --context 2048" "32,8 --batch 64 --context 192"; do
  timeout 60 python3 bench/attention_bf16.py --heads $h --variants default,bt128,bt32 --rounds 7 \
      --out /tmp/a154.json 2>&1 | grep "^| [0-9]"
done
echo "attention at ${SECONDS}s"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  END=$((${END:-560} - SECONDS)) bash bench/device_run149.sh
fi
