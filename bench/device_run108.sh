#!/bin/bash
# Thirty-fifth session, after device_run106 / 107: the CUDA router + route (FP4RL_MOE_ROUTER_CUDA=1) took batch 1
# from 2.12 to 1.98 ms (batch 8: 4.25 -> 4.34). Here that arm at batch 1, BF16 at batch 1 for the ratio in the same
# session, then the defaults, each in a fresh process. Up to ~470 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
arm() {
  name=$1; limit=$2; preset=$3; shift 3
  env "$@" timeout $limit python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets $preset --w4a16-last 0 --batch 1 --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on \
    --profile-batch= --out $OUT/sampler108_$name.json > $OUT/sampler108_$name.log 2>&1
  echo "$name exit $? at ${SECONDS}s"; grep '^| qwen\|rror' $OUT/sampler108_$name.log | cut -c1-200
}
arm router_cuda 170 nvfp4-w4a16 FP4RL_MOE_ROUTER_CUDA=1
arm bf16 150 bf16 X=0
arm defaults 150 nvfp4-w4a16 X=0
python3 - <<'PY'
import json, os
for name in ("router_cuda", "bf16", "defaults"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/sampler108_{name}.json"))
    except OSError as exc:
        print(name, exc)
        continue
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
PY
