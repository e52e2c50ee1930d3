#!/bin/bash
# Twenty-ninth session, the last minutes of device time: does W4A16 decode slower when measured after BF16 in the
# same process (device_run85: 2.47 / 5.12 ms at batch 1 / 8 against 2.18 / 4.30 in fresh processes,
# device_run86-87)? Batch 1 only, BF16 first then W4A16, as device_run85 ran them.
# Run: the 170 s limit ended it after the BF16 row (4.76 ms) and before the W4A16 one: not answered.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --w4a16-last 0 --batch 1 --kv bf16 --repeats 1 --tokens 8,24 --profile-batch '' --offload-trainer on \
  --out $OUT/sampler88.json > $OUT/sampler88.log 2>&1
echo "exit $?"; grep -o '"precision": "[^"]*"\|"step_ms": [0-9.]*\|"graph_us": [0-9.]*' $OUT/sampler88.log
