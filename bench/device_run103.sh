#!/bin/bash
# Thirty-third session. device_run102: TLBWARM left the step and the experts' release-to-issue time as they were
# (taken out). Its stamps by SM: at one token the gate / up GEMM's 192 CTAs sit on 132 SMs (68 with two), and
# a CTA sharing its SM streams its 74 KB in 4.32 us against 3.55 alone (exit 7.36 vs 6.43 us after release).
# FP4RL_MMA16_GFILL=3 lets choose_grouped split K over 4 warps there instead of 2: 384 CTAs of 32 rows (~2.9
# per SM, 3 fit), twice the warps streaming, other bits (the KW = 4 sums, GPU-tested against the cluster's).
# FP4RL_MMA16_LDVOL=1: the experts' offsets / x_rows by volatile loads (the same bits): does it cost anything?
# GPU tests first; then each arm in a fresh process; then GFILL 3's stamps at batch 1. Up to ~560 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 90 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped_switches.py tests/test_gemv_cuda_grouped.py \
  -k "volatile or in_cta_split" > $OUT/tests103.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests103.log
arm() {
  name=$1; limit=$2; batch=$3; extra=$4; shift 4
  env "$@" timeout $limit python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets nvfp4-w4a16 --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on \
    $extra --out $OUT/sampler103_$name.json > $OUT/sampler103_$name.log 2>&1
  echo "$name exit $? at ${SECONDS}s"; grep '^| qwen\|rror' $OUT/sampler103_$name.log | cut -c1-200
}
arm defaults 170 1,8 "--profile-batch=" X=0
arm gfill3 110 1 "--profile-batch=" FP4RL_MMA16_GFILL=3
arm ldvol 125 1,8 "--profile-batch=" FP4RL_MMA16_LDVOL=1
if [ $SECONDS -lt 470 ]; then
  arm gfill3_stamps $((575 - SECONDS)) 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_GFILL=3
fi
python3 - <<'PY'
import json, os
for name in ("defaults", "gfill3", "ldvol"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/sampler103_{name}.json"))
    except OSError as exc:
        print(name, exc)
        continue
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff",
                                                                "error")} for c in d["checks"]])
try:
    d = json.load(open(os.environ["OUT"] + "/sampler103_gfill3_stamps.json"))
except OSError as exc:
    raise SystemExit(f"stamps: {exc}")
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
