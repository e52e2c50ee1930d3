#!/bin/bash
# Thirty-second session. device_run98 made SLOTTABLE + the one-token view + GSR the defaults (2.17 -> 2.15 ms at
# batch 1), but its stamps did not move the experts' GEMMs' time from release to x staged (gate / up 2.3 us a
# CTA, down 3.3). Where it goes: FP4RL_MMA16_STAMP_AT moves the third stamp to the expert found (1) or to x and
# the first weight steps issued (2) instead of landed (0). GPU tests of the new defaults first, then the
# defaults at batch 1 / 8 and the three stamp points at batch 1, each in a fresh process. Up to ~480 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped.py tests/test_gemv_cuda.py tests/test_stamps.py \
  -k "slot_table or one_token or row_scales or stamps" \
  > $OUT/tests99.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests99.log
arm() {
  name=$1; batch=$2; extra=$3; shift 3
  env "$@" timeout 125 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on $extra \
    --out $OUT/sampler99_$name.json > $OUT/sampler99_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler99_$name.log | cut -c1-200
}
arm defaults 1,8 "--profile-batch=" X=0
for at in 0 1 2; do
  arm stamps_at$at 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_STAMP_AT=$at
done
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sampler99_defaults.json"))
for r in d["rows"]:
    print("defaults batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
print("checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff", "error")}
                 for c in d["checks"]])
for at in (0, 1, 2):
    d = json.load(open(os.environ["OUT"] + f"/sampler99_stamps_at{at}.json"))
    for p in d["profiles"]:
        s = p.get("stamps") or {}
        print("STAMP_AT", at, "batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v)
                                                    for k, v in s.items() if k != "kinds"})
        for name, k in (s.get("kinds") or {}).items():
            print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                              for key, v in k.items()))
PY
