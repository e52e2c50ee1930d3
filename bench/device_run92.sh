#!/bin/bash
# Thirtieth session. Which kernels Qwen3-30B-A3B's W4A16 decode step waits on: the graph replay's kernels under
# the profiler (decode_timing.replay_chain: each kernel's advance of the latest end, PDL overlaps included),
# at batch 1 and 8, beside the eager split (profile_split). One fresh process.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 300 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
  --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch 1,8 --offload-trainer on \
  --out $OUT/sampler92.json > $OUT/sampler92.log 2>&1
echo "exit $?"; grep '^| qwen\|rror' $OUT/sampler92.log | cut -c1-200
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sampler92.json"))
for p in d["profiles"]:
    c = p.get("chain", {})
    print("batch", p["batch"], "eager kernel ms", round(p.get("kernel_ms", 0) / max(1, p.get("steps", 1)), 3),
          {k: (round(v, 1) if isinstance(v, float) else v) for k, v in c.items() if k != "top"})
    for k in c.get("top", []):
        print(f'  {k["advance_us_per_step"]:8.1f} adv {k["us_per_step"]:8.1f} dur {k["gap_us_per_step"]:6.1f} gap '
              f'{k["calls_per_step"]:5.0f} x {k["name"][:70]}')
PY
