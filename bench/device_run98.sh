#!/bin/bash
# Thirty-first session, prepared for the next one (no device time was left). Two dependent L2 round trips less
# before the routed experts' GEMMs stage x (device_run93's stamps: 3.0 / 4.1 us from release to x staged):
#  - FP4RL_MMA16_SLOTTABLE=4: the GEMM looks for its expert 32 experts per round trip (4 trips for Qwen3-30B-A3B's
#    128, then one more for offs[ex]); the SLOTTABLE build reads the whole table in one (default SASS unchanged);
#  - FP4RL_MMA16_ONE_TOKEN=1: at one token the gate / up GEMM reads x through a row stride of 0 instead of
#    loading x_rows first (gemv_cuda.launch_grouped; the plain build);
#  - FP4RL_MMA16_GSR=1: the in-CTA split builds with per-row global scales (q/k/v, the experts' gate / up) read
#    each thread's row scale before the stream instead of in the epilogue (gemv_mma16.cu GSR).
# GPU tests of the same bits first; then arms in fresh processes, Qwen3-30B-A3B W4A16 at batch 1 and 8 (the
# defaults, the first two, all three); then all three's stamps at batch 1. Up to ~590 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 90 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped.py tests/test_gemv_cuda.py \
  -k "slot_table or one_token or row_scales" \
  > $OUT/tests98.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests98.log
arm() {
  name=$1; batch=$2; extra=$3; shift 3
  env "$@" timeout 125 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on $extra \
    --out $OUT/sampler98_$name.json > $OUT/sampler98_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler98_$name.log | cut -c1-200
}
arm base 1,8 "--profile-batch=" X=0
arm table_one 1,8 "--profile-batch=" FP4RL_MMA16_SLOTTABLE=4 FP4RL_MMA16_ONE_TOKEN=1
arm all3 1,8 "--profile-batch=" FP4RL_MMA16_SLOTTABLE=4 FP4RL_MMA16_ONE_TOKEN=1 FP4RL_MMA16_GSR=1
arm all3_stamps 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_SLOTTABLE=4 FP4RL_MMA16_ONE_TOKEN=1 \
  FP4RL_MMA16_GSR=1
python3 - <<'PY'
import json, os
for name in ("base", "table_one", "all3"):
    d = json.load(open(os.environ["OUT"] + f"/sampler98_{name}.json"))
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff",
                                                                "error")} for c in d["checks"]])
d = json.load(open(os.environ["OUT"] + "/sampler98_all3_stamps.json"))
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
