"""Whether the wgmma build of the dense mma16 GEMM (fp4rl/kernels/gemv_mma16.cu, WGMMA) gives the bits of the
one-row mma.sync path when it splits K the same way, and what it costs at 2-64 rows.

For each shape and row count m, every row of x is first multiplied alone (``gemv_cuda.choose`` at one row: the
mma.sync build, K split inside the CTA): the reference bits. Then the whole of x through

  auto          choose(n, k, m) (mma.sync; up to 16 rows)
  wide          choose_wide(n, k, m) (the wgmma rule)
  wide_s1[_w8][_d3]  choose_wide with the one-row split of K (ksplit of choose(n, k, 1)), WARPS 4 (or 8 with
                --w8), DEPTH 2 (or 3)

and reports, per configuration, how many of y's elements differ from the rows multiplied alone (0: the same
bits) and its time (CUDA-graph replay over weight copies, as bench/mma16_sweep.py).

  python3 bench/wgmma_bits.py [--shapes 4096x4096,...] [--rows 2,4,8,16,32] [--w8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl.benchmarks.gpu_gemm import _nvfp4_weight  # noqa: E402
from fp4rl.benchmarks.gpu_kernels import _env, copies_for, time_calls  # noqa: E402
from fp4rl.kernels import gemv_cuda  # noqa: E402


def variants(n: int, k: int, m: int, sms: int, warps_tried=(4,)) -> list[tuple[str, dict]]:
    one = gemv_cuda.ksplit(gemv_cuda.choose(n, k, 1, sms))
    out = []
    if m <= 16:
        out.append(("auto", gemv_cuda.choose(n, k, m, sms)))
    wide = gemv_cuda.choose_wide(n, k, m, sms)
    out.append(("wide", wide))
    base = {key: v for key, v in wide.items() if key not in ("WARPS", "WS")}
    base.update(NT=1, SPLIT=one)
    for warps in warps_tried:
        for depth in (2, 3):
            c = dict(base, DEPTH=depth)
            if warps == 4:
                c["WARPS"] = 4
            name = "wide_s1" + ("_w8" if warps == 8 else "") + ("_d3" if depth == 3 else "")
            if gemv_cuda.smem_bytes(c, k, m) <= gemv_cuda.SMEM_MAX and (k // 128) >= one:
                out.append((name, c))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,6144x4096,24576x4096,4096x12288,14336x4096,4096x14336")
    ap.add_argument("--rows", default="2,4,8,12,16,32")
    ap.add_argument("--global-per-n", action="store_true", help="a global scale per weight row")
    ap.add_argument("--w8", action="store_true", help="also the 8-warp build at the one-row split")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"env": _env(), "rows": []}
    torch.manual_seed(0)
    for shp in a.shapes.split(","):
        n, k = map(int, shp.split("x"))
        _, wq = _nvfp4_weight(n, k)
        g = wq.global_scale.float().reshape(-1)
        if a.global_per_n:
            g = g * (1 + torch.rand(n, device="cuda"))
        wc0 = gemv_cuda.relayout(wq.data, wq.block_scale)
        wcs = [wc0] + [gemv_cuda.Mma16Weight(wt=wc0.wt.clone(), st=wc0.st.clone(), n=n, k=k)
                       for _ in range(copies_for(wc0.wt.nbytes + wc0.st.nbytes) - 1)]
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            alone = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            for i in range(m):
                gemv_cuda.launch(x[i:i + 1], wc0, g, alone[i:i + 1])
            for name, c in variants(n, k, m, sms, (4, 8) if a.w8 else (4,)):
                y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                try:
                    gemv_cuda.launch(x, wc0, g, y, cfg=c)
                    torch.cuda.synchronize()
                    diff = int((y.view(torch.int16) != alone.view(torch.int16)).sum())
                    maxd = float((y.float() - alone.float()).abs().max())
                    us = time_calls([lambda w=w, c=c, y=y, x=x, g=g: gemv_cuda.launch(x, w, g, y, cfg=c)
                                     for w in wcs])
                except Exception as exc:  # noqa: BLE001
                    print(f"{n}x{k} m{m} {name} {c} FAILED {repr(exc)[:300]}", flush=True)
                    continue
                out["rows"].append(dict(n=n, k=k, rows=m, variant=name, cfg=c, us=us, differ=diff,
                                        max_diff=maxd))
                print(f"{n}x{k} m{m:3d} {name:12s} {us:7.1f} us  differ {diff:7d} / {m * n} "
                      f"(max {maxd:.2e})  {c}", flush=True)
        del wcs
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
