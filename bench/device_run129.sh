#!/bin/bash
# Forty-first session, on an H200: 1) device_run128's three Qwen3-30B-A3B arms at full depth (48 layers; BF16,
# defaults, NVFP4 lm_head, batch 1, each a fresh process), with f541a46's four launches fewer between two
# replays. 2) With the time left (END, seconds): the sampling head's kernels by slice width and merged
# (bench/sample_head_slices.py), to pick its next default.
export PYTHONUNBUFFERED=1
SECONDS=0
END=${END:-470} PREFIX=sampler129_30b bash bench/device_run128.sh --no-tests
left=$((${CAP:-585} - SECONDS))
echo "arms done at ${SECONDS}s"
[ $left -gt 40 ] && timeout $left python3 bench/sample_head_slices.py --out $OUT/sample_head_slices.json 2>&1 \
    | grep -v Warn | cut -c1-200
