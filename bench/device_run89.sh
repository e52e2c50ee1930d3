#!/bin/bash
# Prepared in the twenty-ninth session for the next one (not yet run). device_run85 measured Qwen3-30B-A3B W4A16
# at 2.47 / 5.12 ms a step (batch 1 / 8; graph replay 2.42 / 5.06) after the BF16 rows in the same process, and
# device_run86-87 at 2.18 / 4.30 (replay 2.13 / 4.23) in processes that built only the W4A16 sampler, at HEAD,
# 4ead7ce and 101eeb2 alike; the seventeenth session's same-process run (bench/data/s17/sampler60_30b.log, at
# 101eeb2 without expandable segments) was not slower (2.24 / 4.27). The replay itself was slower, so the GPU
# work, not the host. A first hypothesis: the W4A16 weights mapped onto the physical pages the BF16 sampler left
# (expandable segments map 2 MB pages one by one), so that a step's ~2.2 GB of weights scattered over 17 GB
# misses the TLB more. Mode a: the same-process run with expandable segments (device_run85's setting); mode b:
# without them. Each prints the BF16 and W4A16 step and replay times.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
case "${1:-a}" in
a) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ;;
b) unset PYTORCH_CUDA_ALLOC_CONF ;;
*) echo "mode a or b"; exit 2 ;;
esac
timeout 400 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --offload-trainer on \
  --out $OUT/sampler89$1.json > $OUT/sampler89$1.log 2>&1
echo "exit $?"; grep '^| qwen\|rror' $OUT/sampler89$1.log | cut -c1-220
