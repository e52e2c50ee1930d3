#!/bin/bash
# Thirty-second session, prepared for the next one (device time spent). device_run99's stamps: a routed experts'
# CTA takes 0.8 us from its release to its expert, then 1.5 / 2.0 us (gate / up, down) until thread 0 has
# issued its first loads, which then land at once (gate / up) or 0.5 us later (down). Running that code dry
# before the release (WARM, device_run100) did not shorten it, so the issue is held up by the memory system:
# possibly the translation of the newly routed experts' pages. FP4RL_MMA16_TLBWARM=<log2 stride> has the grid's
# threads prefetch one L2 line per 64 KB (16) or 2 MB (21) of both expert stacks while they wait to be released.
# GPU tests (the same bits) first; then the defaults and both strides at batch 1 / 8 in fresh processes; then,
# time permitting, the 64 KB build's stamps (third stamp once x is issued) at batch 1. Up to ~560 s.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 60 python3 -m pytest -q -m gpu tests/test_gemv_cuda_grouped_switches.py -k "tlb_warm or slot_table" \
  > $OUT/tests102.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests102.log
arm() {
  name=$1; limit=$2; batch=$3; extra=$4; shift 4
  env "$@" timeout $limit python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 \
    --presets nvfp4-w4a16 --w4a16-last 0 --batch $batch --kv bf16 --repeats 2 --tokens 8,40 --offload-trainer on \
    $extra --out $OUT/sampler102_$name.json > $OUT/sampler102_$name.log 2>&1
  echo "$name exit $? at ${SECONDS}s"; grep '^| qwen\|rror' $OUT/sampler102_$name.log | cut -c1-200
}
arm defaults 150 1,8 "--profile-batch=" X=0
arm tlb16 125 1,8 "--profile-batch=" FP4RL_MMA16_TLBWARM=16
arm tlb21 125 1,8 "--profile-batch=" FP4RL_MMA16_TLBWARM=21
if [ $SECONDS -lt 460 ]; then
  arm tlb16_stamps $((575 - SECONDS)) 1 "--profile-batch=1 --mma16-stamps" FP4RL_MMA16_TLBWARM=16 \
    FP4RL_MMA16_STAMP_AT=2
fi
python3 - <<'PY'
import json, os
for name in ("defaults", "tlb16", "tlb21"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/sampler102_{name}.json"))
    except OSError as exc:
        print(name, exc)
        continue
    for r in d["rows"]:
        print(name, "batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
    print(name, "checks", [{k: v for k, v in c.items() if k in ("batch", "tokens_equal", "max_logprob_diff",
                                                                "error")} for c in d["checks"]])
try:
    d = json.load(open(os.environ["OUT"] + "/sampler102_tlb16_stamps.json"))
except OSError as exc:
    raise SystemExit(f"stamps: {exc}")
for p in d["profiles"]:
    s = p.get("stamps") or {}
    print("batch", p["batch"], {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
