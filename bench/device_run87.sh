#!/bin/bash
# Measured at commit 60ccecb (FP4RL_EXPERT_PREFETCH*, taken out after this call: the prefetch was slower).
# Twenty-ninth session. device_run86 measured Qwen3-30B-A3B W4A16 at 2.18 / 4.30 ms a step (batch 1 / 8) in a
# process of its own at HEAD, 4ead7ce and 101eeb2 alike: device_run85's 2.47 / 5.12 came from measuring after
# the BF16 rows in the same process, so its prefetch A/B (same process, one after another) is not conclusive.
# Here the expert prefetch off / on / 3 steps ahead, each in a fresh process.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
flags="--shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40"
case "${1:-a}" in
a)
  for v in on:0 off:0 d3:3; do
    name=${v%%:*}; depth=${v##*:}; pre=1; [ $name = off ] && pre=0
    FP4RL_EXPERT_PREFETCH=$pre FP4RL_EXPERT_PREFETCH_DEPTH=$depth timeout 150 python3 -m fp4rl.benchmarks.sampler_gpu \
      $flags --profile-batch '' --offload-trainer on --out $OUT/sampler87_$name.json > $OUT/sampler87_$name.log 2>&1
    echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler87_$name.log | cut -c1-200 | tail -3
  done
  ;;
*) echo "mode a"; exit 2 ;;
esac
