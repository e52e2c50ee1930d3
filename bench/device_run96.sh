#!/bin/bash
# Thirty-first session. PDL on the Triton decode attention (pdl kind "attn"): device_run93's stamps show the
# o-proj GEMM after it resident only 0.3 us before its release (the q/k/v GEMM after add_rmsnorm: 3.3 us) and
# 1.3 us from release to x staged (q/k/v: 0.6). Arms in fresh processes, Qwen3-30B-A3B W4A16 at batch 1 and 8:
# the defaults (attention without PDL), FP4RL_PDL_OFF=mma,wide (attention with it); then that arm's stamps at
# batch 1. GPU tests of the attention's graph replay with and without PDL first.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu tests/test_triton_attention.py -k "graph_replay" \
  > $OUT/tests96.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests96.log
arm() {
  name=$1; batch=$2; extra=$3; shift 3
  env "$@" timeout 140 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
    --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on $extra \
    --out $OUT/sampler96_$name.json > $OUT/sampler96_$name.log 2>&1
  echo "$name exit $?"; grep '^| qwen\|rror' $OUT/sampler96_$name.log | cut -c1-220
}
arm base 1,8 "--profile-batch=" X=0
arm attn 1,8 "--profile-batch=" FP4RL_PDL_OFF=mma,wide
arm attn_stamps 1 "--profile-batch=1 --mma16-stamps" FP4RL_PDL_OFF=mma,wide
python3 - <<'PY'
import json, os
for name in ("base", "attn"):
    d = json.load(open(os.environ["OUT"] + f"/sampler96_{name}.json"))
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "kv", "tokens_equal", "max_logprob_diff", "error",
                                                                "checked")} for c in d["checks"]])
d = json.load(open(os.environ["OUT"] + "/sampler96_attn_stamps.json"))
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
