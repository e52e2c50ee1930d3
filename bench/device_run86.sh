#!/bin/bash
# Twenty-ninth session. Qwen3-30B-A3B W4A16 at batch 1 and 8 measured 2.47 / 5.12 ms a step in device_run85
# (expert prefetch off) against 2.24 / 4.27 in the seventeenth session (bench/data/s17/sampler60_30b.log, same
# flags but --tokens 8,72 --repeats 3, no --offload-trainer): the same rows from HEAD, from the twenty-eighth
# session's end (4ead7ce) and the seventeenth's (101eeb2), their fp4rl packages unpacked under _old/<commit>
# (git archive, shipped untracked for this call only), in one call; HEAD's with the per-kernel profile.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
flags="--shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40"
case "${1:-a}" in
a)
  root=$PWD
  for tree in 101eeb2 4ead7ce; do
    (cd _old/$tree && timeout 170 python3 -m fp4rl.benchmarks.sampler_gpu $flags --profile-batch '' \
      --offload-trainer on --out $OUT/sampler86_$tree.json > $OUT/sampler86_$tree.log 2>&1)
    echo "$tree exit $?"; grep '^| qwen\|rror' $OUT/sampler86_$tree.log | cut -c1-200 | tail -4
  done
  timeout 200 python3 -m fp4rl.benchmarks.sampler_gpu $flags --profile-batch 1,8 --offload-trainer on \
    --out $OUT/sampler86_head.json > $OUT/sampler86_head.log 2>&1
  echo "head exit $?"; grep '^| qwen\|rror\|^profile' $OUT/sampler86_head.log | cut -c1-300 | tail -8
  ;;
*) echo "mode a"; exit 2 ;;
esac
