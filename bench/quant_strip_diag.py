"""Why 16x16 rule 6 with an imposed global scale took 0.475 ms on the strip kernel (quant.cu
nvfp4_quant_strip16) against 0.220 ms with the tensor's amax, which adds an amax pass (forty-fifth session,
bench/device_run136.sh on an H100; it was that run's noise: 0.128 ms here): the strip and tile kernels and
Triton for each scale source (the tensor's amax, an imposed amax, an imposed g), timed by
triton.testing.do_bench (median) and by CUDA events around 50 back-to-back calls (mean), the strip kernel's
launch alone, and the profiler's kernel list for a few calls.

    python3 bench/quant_strip_diag.py [--rows 32768] [--cols 4096] [--out FILE.json]
"""

import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import fp4rl.kernels.quantize as q  # noqa: E402
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402

ARMS = {"Triton": dict(on=False), "strip": dict(strip=True), "tile": dict(strip=False)}


def _set(on=True, strip=True, fast46=False):
    qc.STATE["on"], qc.TILE16_RULE6, qc.STRIP16 = on, on, strip
    qc.TILE16_FAST46 = fast46


def _events(fn, n=50):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=gen, dtype=torch.bfloat16)
    amax = x.float().abs().amax()
    rows = []
    sources = {"tensor amax": {}, "imposed amax": dict(amax=amax),
               "imposed g": dict(global_scale=amax / 2688)}
    for rule in ("6", "4/6"):
        for sname, skw in sources.items():
            ref = None
            for arm, akw in ARMS.items():
                if rule == "4/6" and arm.startswith("strip"):
                    continue
                for fast46 in ((False, True) if rule == "4/6" and arm == "tile" else (False,)):
                    _set(fast46=fast46, **akw)
                    kw = dict(tile16=True, check_finite=False, scale_rule=rule, **skw)
                    try:
                        out = q.quantize_2d(x, **kw)
                        ms = triton.testing.do_bench(lambda kw=kw: q.quantize_2d(x, **kw), warmup=5, rep=60)
                        ev = _events(lambda kw=kw: q.quantize_2d(x, **kw))
                    finally:
                        _set()
                    assert qc.STATE["error"] is None, qc.STATE["error"]
                    same = None
                    if ref is None:
                        ref = out
                    else:
                        same = all(torch.equal(a.reshape(-1).view(torch.uint8),
                                               b.reshape(-1).view(torch.uint8)) for a, b in zip(out, ref))
                    row = dict(rule=rule, source=sname, kernel=arm + (" decide46" if fast46 else ""),
                               do_bench_ms=ms, events_ms=ev, same_bytes_as_triton=same)
                    rows.append(row)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                          flush=True)
    # the strip kernel's launch alone (qc.quantize into preallocated outputs: no Python around it), rule 6
    r, k = x.shape
    data = torch.empty(r, k // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(r, k // 16, dtype=torch.uint8, device="cuda")
    g_out = torch.empty(1, device="cuda")
    given = {3: (amax / 2688).reshape(1), 2: amax.reshape(1)}
    for src in (2, 3):
        _set(strip=True)

        def fn(src=src):
            qc.quantize(x, data, scale, g_out, given[src], None, None, src, False, False, False, False, True)
        try:
            row = dict(rule="6", source=f"launch only, src {src}", kernel="strip",
                       do_bench_ms=triton.testing.do_bench(fn, warmup=5, rep=60), events_ms=_events(fn))
        finally:
            _set()
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    _set(strip=True)
    kw = dict(tile16=True, check_finite=False, global_scale=amax / 2688)
    for _ in range(2):
        q.quantize_2d(x, **kw)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            q.quantize_2d(x, **kw)
        torch.cuda.synchronize()
    _set()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
