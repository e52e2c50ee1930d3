#!/bin/bash
# (Measured slower: 2.14 -> 2.23 ms at batch 1, 4.26 -> 4.52 at 8; WARM was taken out again, commit 33d8ec2 has it.)
# Thirty-second session. device_run99's stamps split the routed experts' GEMMs' 2.3 / 3.3 us (gate / up, down)
# from a CTA's release to x staged: 0.8 to find the expert, then 1.5 / 2.0 us to issue the loads (code running
# for the first time after the release), then ~0 / 0.5 for them to land. FP4RL_MMA16_WARM=1 runs that prologue
# once dry before the wait (gemv_mma16.cu WARM). GPU tests of the same bits first; then the defaults and WARM at
# batch 1 / 8 in fresh processes, and WARM's stamps at batch 1. Up to ~450 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped.py -k "warm or slot_table" \
  > $OUT/tests100.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests100.log
arm() {
  name=$1; limit=$2; batch=$3; extra=$4; shift 4
  env "$@" timeout $limit python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets nvfp4-w4a16 --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on \
    $extra --out $OUT/sampler100_$name.json > $OUT/sampler100_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler100_$name.log | cut -c1-200
}
arm defaults 150 1,8 "--profile-batch=" X=0
arm warm 125 1,8 "--profile-batch=" FP4RL_MMA16_WARM=1
arm warm_stamps 110 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_WARM=1
python3 - <<'PY'
import json, os
for name in ("defaults", "warm"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/sampler100_{name}.json"))
    except OSError as exc:
        print(name, exc)
        continue
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff",
                                                                "error")} for c in d["checks"]])
d = json.load(open(os.environ["OUT"] + "/sampler100_warm_stamps.json"))
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
