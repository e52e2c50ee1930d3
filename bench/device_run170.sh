#!/bin/bash
# Fifty-third session: the 8B's 32-row W4A16 GEMMs (2.9 ms of its batch-32 step; the eighteenth session's item 1):
# the wgmma build with NT 2 (two m64 tiles a warpgroup: the step's fixed instructions over twice the weights, half
# the CTAs) timed again now that XPRE is in, with its split doubled / halved and XPRE 2, on Qwen3-8B's four
# shapes and the 14336x4096, against cuBLAS BF16 in the same run. Then, where the card is an H200, the
# 48-layer 30B (device_run149's arms) as far as END (default 560) allows. Up to ~END s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
timeout ${T_W:-170} python3 bench/mma16_sweep.py --rows 24,32 \
  --variants wide,wide+nt2,wide+nt2+s2x,wide+nt2+sh,wide+nt2+xp2,wide+s2x,wide+sh \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288,14336x4096 --out $OUT/sweep170_32.json > $OUT/sweep170_32.log 2>&1
echo "sweep32 exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep170_32.log | cut -c1-140 | tail -40
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  END=$((${END:-560} - SECONDS)) bash bench/device_run149.sh
fi
