#!/bin/bash
# Prepared in the fourteenth session (no device time left to run it): `stream` answers whether a decode GEMM's
# weight stream can move a Qwen3-30B-A3B layer's bytes at a copy's speed with TMA bulk copies or register loads
# instead of per-lane cp.async (bench/stream_modes.py; every variant's checksum is checked against the buffer's).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "$1" = stream ]; then
  timeout 200 python3 bench/stream_modes.py --out $OUT/stream_modes.json > $OUT/stream_modes.log 2>&1
  echo "stream exit $?"; cat $OUT/stream_modes.log | tail -12
  exit 0
fi
echo "usage: bash bench/device_run55.sh stream"; exit 2
