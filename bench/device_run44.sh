#!/bin/bash
# Tenth session, call 2: where a decode step goes beyond its graph replay (bench/step_gap.py: one generate under
# torch.profiler, Qwen3-30B-A3B 12 layers, BF16 and W4A16), then the full-depth 48-layer table with the
# trainer moved to host memory for the BF16 sampler (--offload-trainer auto).
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
for p in nvfp4-w4a16 bf16; do
  timeout 75 python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset $p --batch 1,8,32 \
    --out $OUT/step_gap44_$p.json 2>&1 | grep -v Warn | cut -c1-900
done
timeout 420 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets bf16,nvfp4-w4a16 \
  --batch 1,8,32 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch '' --out $OUT/sampler44_30b48.json \
  > $OUT/sampler44_30b48.log 2>&1
echo "exit $?"; grep '^|\|rror' $OUT/sampler44_30b48.log | cut -c1-300 | tail -8
python3 -c "import json; d=json.load(open('$OUT/sampler44_30b48.json')); print(d['builds'], d['errors'])"
