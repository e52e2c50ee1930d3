#!/bin/bash
# Thirty-first session. Where a decode GEMM's time goes inside the 30B step's graph: the mma16 kernels built with
# in-kernel stamps (fp4rl.benchmarks.stamps: %globaltimer at each CTA's start, after griddepcontrol.wait, x
# staged, weight stream done, exit), Qwen3-30B-A3B W4A16 at batch 1 and 8, one fresh process; the GPU tests of
# the stamps first.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout 120 python3 -m pytest -q -m gpu tests/test_gemv_cuda.py -k "stamps or in_cta_split_gives" \
  > $OUT/tests93.log 2>&1; echo "tests exit $?"; tail -3 $OUT/tests93.log
timeout 330 python3 -m fp4rl.benchmarks.sampler_gpu --shapes qwen3-30b-a3b:48 --presets nvfp4-w4a16 \
  --w4a16-last 0 --batch 1,8 --kv bf16 --repeats 2 --tokens 8,40 --profile-batch 1,8 --offload-trainer on \
  --mma16-stamps --out $OUT/sampler93.json > $OUT/sampler93.log 2>&1
echo "exit $?"; grep '^| qwen\|rror' $OUT/sampler93.log | cut -c1-200
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sampler93.json"))
for r in d["rows"]:
    print("row batch", r["batch"], {k: r.get(k) for k in ("step_ms", "graph_us", "tok_s", "error") if k in r})
for p in d["profiles"]:
    s = p.get("stamps") or {}
    c = p.get("chain", {})
    print("batch", p["batch"], "replay chain busy us", c.get("busy_us"), "error", p.get("error"))
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items() if k != "kinds"})
    for name, k in (s.get("kinds") or {}).items():
        print(f"  {name:22s} " + " ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                          for key, v in k.items()))
PY
