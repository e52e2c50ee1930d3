#!/bin/bash
# Fifty-fifth session: the warp-specialized wgmma build (gemv_mma16.cu WS, FP4RL_WIDE_WS; the eighteenth
# session's item 1 for the 8B's 32-row GEMMs, 2.9 ms of its batch-32 step). 1) one launch against the plain
# build, bit for bit, under a 60 s limit (a hung mbarrier ring stops the call there); 2) its GPU test; 3) the
# 8B's four shapes at 32 and 64 rows, the plain build against WS at ring depths 2 / 3 / 4 / 6 (and 4 with NT 2, with x shared by 2 n-blocks: XMC 2), cuBLAS BF16 in
# the same run; 4) where a depth's 32-row sum beats the plain build's by more than 3%: the 8B at batch 32
# (128-token prompts, BF16 KV) with it against without, fresh processes. Up to END (default 560) s.
# (XMC and FP4RL_WIDE_XMC were removed after this call: this script ran at 8d30411 and earlier.)
source bench/sampler_arm.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
SECONDS=0
smoke() {  # one launch each of the shapes against the plain build, bit for bit; $1: extra config keys
timeout 60 python3 - "$1" <<'PY'
import sys
import time
import torch
from fp4rl.benchmarks.gpu_gemm import _nvfp4_weight
from fp4rl.kernels import gemv_cuda
for n, k, m in ((4096, 4096, 32), (6144, 4096, 24), (24576, 4096, 64)):
    _, wq = _nvfp4_weight(n, k)
    wc = gemv_cuda.relayout(wq.data, wq.block_scale)
    g = wq.global_scale.float().reshape(-1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    plan = gemv_cuda.choose_wide(n, k, m, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    gemv_cuda.launch(x, wc, g, ref, cfg=plan)
    y = torch.full_like(ref, float("nan"))
    t = time.time()
    cfg = dict(plan, WS=1, DEPTH=4, **eval(sys.argv[1]))
    if cfg["MG"] % cfg.get("XMC", 1) or cfg.get("XMC", 1) * cfg["SPLIT"] > 8:
        continue
    gemv_cuda.launch(x, wc, g, y, cfg=cfg)
    torch.cuda.synchronize()
    same = torch.equal(y, ref)
    print(f"{n}x{k} m{m} {cfg}: equal={same} max|diff|={(y.float() - ref.float()).abs().max().item():.3g} "
          f"nan={y.isnan().sum().item()} ({time.time() - t:.1f} s)", flush=True)
    assert same
PY
}
smoke "{}"
rc=$?
echo "smoke exit $rc at ${SECONDS}s"
[ $rc -eq 0 ] || exit 0
XMCV=,wide+ws1+d4+xmc2
smoke "{'XMC': 2}" || XMCV=
echo "XMC smoke done at ${SECONDS}s (variant: ${XMCV:-none})"
if [ -n "$XMCV" ]; then  # (a hung XMC ring would take the test's whole limit)
  timeout 150 python3 -m pytest -q -m gpu tests/test_gemv_cuda_wide.py -k warp_specialized 2>&1 | tail -6
  echo "tests at ${SECONDS}s"
fi
timeout 200 python3 bench/mma16_sweep.py --rows 32,64 \
  --variants wide,wide+ws1+d2,wide+ws1+d3,wide+ws1+d4,wide+ws1+d6,wide+ws1+d4+nt2$XMCV \
  --shapes 6144x4096,4096x4096,24576x4096,4096x12288 --out $OUT/sweep174.json > $OUT/sweep174.log 2>&1
echo "sweep exit $? at ${SECONDS}s"; grep -v '^\[' $OUT/sweep174.log | grep -v '^copy' | cut -c1-150 | tail -45
best=$(python3 - $OUT/sweep174.log <<'PY'
import re, sys
t = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\d+x\d+) m +32 +([\d.]+) us .* (wide\S*) \{", line)
    if m:
        t.setdefault(m.group(3), {})[m.group(1)] = float(m.group(2))
base = t.get("wide", {})
sums = {name: sum(v.values()) for name, v in t.items() if len(v) == len(base) == 4}
print({k: round(v, 1) for k, v in sums.items()}, file=sys.stderr)
ws = {name: s for name, s in sums.items() if "ws1" in name}
if ws and "wide" in sums:
    name = min(ws, key=ws.get)
    nt = 2 if "nt2" in name else 0
    xmc = 2 if "xmc2" in name else 1
    print(re.search(r"d(\d)", name).group(1) + f" {nt} {xmc}" if ws[name] < 0.97 * sums["wide"] else "0 0 1")
else:
    print("0 0 1")
PY
)
read best nt xmc <<< "$best"
echo "WS depth chosen for the sampler: ${best:-0} (FP4RL_WIDE_NT=${nt:-0} FP4RL_WIDE_XMC=${xmc:-1})"
if [ "${best:-0}" -gt 0 ]; then
  ARM_SHAPE=qwen3-8b:36 ARM_PREFIX=sampler174_8b32
  left=$((${END:-560} - SECONDS))
  if [ $left -gt 150 ]; then
    arm plain $((left / 2 > 90 ? 90 : left / 2)) 32 "--profile-batch=" X=0
    left=$((${END:-560} - SECONDS))
    arm ws $((left > 90 ? 90 : left)) 32 "--profile-batch=" FP4RL_WIDE_WS=$best FP4RL_WIDE_NT=${nt:-0} \
      FP4RL_WIDE_XMC=${xmc:-1}
    python3 -m fp4rl.benchmarks.sampler_gpu_report $OUT/sampler174_*.json
  fi
fi
