#!/bin/bash
# Thirty-first session, at 560be40 (the L2_NEXT build was taken out after this call: slower). The routed experts' gate / up launch sends its experts' down-projection weights to L2
# (FP4RL_MOE_L2_NEXT=1: gemv_cuda.launch_grouped l2_next, bulk prefetches once each CTA knows its expert):
# device_run93's stamps show the down GEMM 4.1 us from its release to x staged, its first weight burst from
# DRAM. Arms in fresh processes, Qwen3-30B-A3B W4A16 at batch 1 and 8; then the L2_NEXT arm's stamps at batch 1.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 100 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped.py -k "l2_next" \
  > $OUT/tests97.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests97.log
arm() {
  name=$1; batch=$2; extra=$3; shift 3
  env "$@" timeout 125 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on $extra \
    --out $OUT/sampler97_$name.json > $OUT/sampler97_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler97_$name.log | cut -c1-200
}
arm base 1,8 "--profile-batch=" X=0
arm l2next 1,8 "--profile-batch=" FP4RL_MOE_L2_NEXT=1
arm l2next_stamps 1 "--profile-batch=1 --mma16-stamps" FP4RL_MOE_L2_NEXT=1
python3 - <<'PY'
import json, os
for name in ("base", "l2next"):
    d = json.load(open(os.environ["OUT"] + f"/sampler97_{name}.json"))
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff",
                                                                "error")} for c in d["checks"]])
d = json.load(open(os.environ["OUT"] + "/sampler97_l2next_stamps.json"))
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
