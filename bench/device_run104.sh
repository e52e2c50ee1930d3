#!/bin/bash
# Thirty-third session, second call. device_run103: FP4RL_MMA16_GFILL=3 (the one-token gate / up over 384 CTAs,
# K over 4 warps) 2.149 -> 2.121 ms at batch 1, now the default; volatile offsets (LDVOL) 4.24 -> 4.29 at batch 8,
# off. Here the new default at batch 1, BF16 at batch 1 for the ratio in the same session, then the previous
# plan (GFILL 2) again, each in a fresh process. Up to ~450 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
arm() {
  name=$1; limit=$2; preset=$3; shift 3
  env "$@" timeout $limit python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets $preset --w4a16-last 0 --batch 1 --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on \
    --profile-batch= --out $OUT/sampler104_$name.json > $OUT/sampler104_$name.log 2>&1
  echo "$name exit $? at ${SECONDS}s"; grep '^| qwen\|rror' $OUT/sampler104_$name.log | cut -c1-200
}
arm defaults 170 nvfp4-w4a16 X=0
arm bf16 150 bf16 X=0
if [ $SECONDS -lt 330 ]; then arm gfill2 $((445 - SECONDS)) nvfp4-w4a16 FP4RL_MMA16_GFILL=2; fi
python3 - <<'PY'
import json, os
for name in ("defaults", "bf16", "gfill2"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/sampler104_{name}.json"))
    except OSError as exc:
        print(name, exc)
        continue
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
PY
