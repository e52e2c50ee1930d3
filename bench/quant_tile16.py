"""The 16x16 quantize on the CUDA C++ kernel (quant.cu nvfp4_quant_tile16, forty-fourth session: a half-warp
a tile, the tile's max and 4/6 error tree by xor shuffles) against the Triton one-block-per-thread kernel
(blocks.py _quantize_tile16_kernel), which took 0.560 ms for 16x16 4/6 on 32768x4096 bfloat16 on an H100 in
the forty-fourth session, as long as the Triton 1x16 4/6 kernel (0.554 ms) and 2.2x the CUDA C++ 1x16 one
(0.252 ms).

Times fp4rl.kernels.quantize.quantize_2d on the GPU (triton.testing.do_bench's median, then the median over
--repeats interleaved rounds of every case: the machine has slow stretches; TB/s counting x read once and the
codes and scales written), each case with the CUDA C++ kernels on and off
(fp4rl.kernels.quantize.cuda.STATE): 16x16 rule 6 and 4/6 (mse, mae), 4/6 with an imposed global scale (no
amax pass), 4/6 decided per tile by the summed bound (cuda.TILE16_FAST46), rule 6 on the strip kernel
(nvfp4_quant_strip16, forty-fifth session: a warp 16 rows x 512 contiguous bytes) and on the tile kernel,
the tile kernel at 1, 2 or 4 tile pairs a warp, staged through shared memory or not (cuda.TILE16_U,
cuda.TILE16_SMEM), 4/6 decided per tile on the strip kernel (cuda.STRIP16_46, forty-sixth session), and
1x16 4/6 and rule 6 for comparison. Every CUDA row's bytes are compared with the
Triton row's of the same case.

    python3 bench/quant_tile16.py [--rows 32768] [--cols 4096] [--repeats 3] [--cases 'PART|...']
        [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import fp4rl.kernels.quantize as q  # noqa: E402
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every case (medians)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="",
                    help="parts of case names, |-separated: only the cases whose names contain one")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=g, dtype=torch.bfloat16)
    nbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    rows = []
    g46 = torch.tensor(float(x.float().abs().amax()) / 1536.0, device="cuda")
    cases = [("16x16 rule 6", dict(tile16=True)),
             ("16x16 rule 6, tile kernel", dict(tile16=True)),
             ("16x16 rule 6, imposed global scale", dict(tile16=True, global_scale=g46 * 1536 / 2688)),
             ("16x16 4/6 mse", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mae, decide46 per tile", dict(tile16=True, scale_rule="4/6", err="mae")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mae, decide46 per tile, strip kernel",
              dict(tile16=True, scale_rule="4/6", err="mae")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, imposed global scale",
              dict(tile16=True, scale_rule="4/6", global_scale=g46)),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, 2 CTAs an SM",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, 4 CTAs an SM",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, 16 CTAs an SM",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, 32 CTAs an SM",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, 64 CTAs an SM",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, strip kernel, imposed global scale, 32 CTAs an SM",
              dict(tile16=True, scale_rule="4/6", global_scale=g46)),
             ("16x16 rule 6, 2 CTAs an SM", dict(tile16=True)),
             ("16x16 rule 6, 4 CTAs an SM", dict(tile16=True)),
             ("16x16 rule 6, 16 CTAs an SM", dict(tile16=True)),
             ("16x16 rule 6, 32 CTAs an SM", dict(tile16=True)),
             ("16x16 rule 6, imposed global scale, 32 CTAs an SM",
              dict(tile16=True, global_scale=g46 * 1536 / 2688)),
             ("16x16 4/6 mse, decide46 per tile, imposed global scale",
              dict(tile16=True, scale_rule="4/6", global_scale=g46)),
             ("16x16 4/6 mse, decide46 per tile, 1 pair a warp", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, 2 pairs a warp", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, 4 pairs a warp", dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, 2 pairs a warp, staged",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 4/6 mse, decide46 per tile, 4 pairs a warp, staged",
              dict(tile16=True, scale_rule="4/6")),
             ("16x16 rule 6, tile kernel, 2 pairs a warp", dict(tile16=True)),
             ("16x16 rule 6, tile kernel, 4 pairs a warp", dict(tile16=True)),
             ("16x16 rule 6, tile kernel, 4 pairs a warp, staged", dict(tile16=True)),
             ("16x16 4/6 mae", dict(tile16=True, scale_rule="4/6", err="mae")),
             ("16x16 4/6 mse, imposed global scale", dict(tile16=True, scale_rule="4/6", global_scale=g46)),
             ("1x16 4/6 mse", dict(scale_rule="4/6")),
             ("1x16 rule 6", dict())]
    if args.cases:
        cases = [c for c in cases if any(p in c[0] for p in args.cases.split("|"))]
    default = dict(on=qc.STATE["on"], rule6=qc.TILE16_RULE6, strip=qc.STRIP16, fast46=qc.TILE16_FAST46,
                   u=qc.TILE16_U, smem=qc.TILE16_SMEM, strip46=qc.STRIP16_46,
                   ctas=qc.STRIP16_CTAS_PER_SM)

    def arm(name, kw, cuda):
        """(the outputs, do_bench's median ms) of one case with the CUDA kernels on or off."""
        qc.STATE["on"] = qc.TILE16_RULE6 = cuda
        qc.TILE16_FAST46 = cuda and "decide46" in name
        qc.STRIP16 = "tile kernel" not in name  # (rule 6: the strip kernel unless named)
        qc.STRIP16_46 = "strip kernel" in name  # (4/6: as named)
        qc.STRIP16_CTAS_PER_SM = int(name.split(" CTAs")[0].rsplit(" ", 1)[1]) if " CTAs an SM" in name \
            else default["ctas"]
        # (the tile kernel's pairs a warp and staging: as named, else the defaults)
        qc.TILE16_U = 4 if "4 pairs" in name else 2 if "2 pairs" in name else 1 if "1 pair" in name \
            else default["u"]
        qc.TILE16_SMEM = "staged" in name if "pair" in name else default["smem"]
        try:
            out = q.quantize_2d(x, **kw)
            ms = triton.testing.do_bench(lambda: q.quantize_2d(x, check_finite=False, **kw), warmup=5, rep=60)
        finally:
            qc.STATE["on"], qc.TILE16_RULE6, qc.STRIP16 = default["on"], default["rule6"], default["strip"]
            qc.TILE16_FAST46, qc.TILE16_U, qc.TILE16_SMEM = default["fast46"], default["u"], default["smem"]
            qc.STRIP16_46, qc.STRIP16_CTAS_PER_SM = default["strip46"], default["ctas"]
        assert qc.STATE["error"] is None, qc.STATE["error"]
        return out, ms

    # every case in turn, --repeats times (interleaved: a slow stretch of the machine lands in one repeat of
    # several cases, not in every repeat of one); the CUDA bytes compared with Triton's in the first
    times, same = {}, {}
    for rep in range(args.repeats):
        for name, kw in cases:
            outs = {}
            for cuda in (False, True):
                outs[cuda], ms = arm(name, kw, cuda)
                times.setdefault((name, cuda), []).append(ms)
            if rep == 0:
                # reshape(-1): the global scale is a 0-dim float32, which view(uint8) refuses
                same[name] = all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                                 for a, b in zip(outs[True], outs[False]))
            del outs
    for name, _ in cases:
        for cuda in (False, True):
            ms = statistics.median(times[(name, cuda)])
            row = {"case": name, "kernel": "CUDA C++" if cuda else "Triton", "ms": ms,
                   "ms_repeats": times[(name, cuda)], "TB/s": nbytes / ms / 1e9}
            if cuda:
                row["same_bytes_as_triton"] = same[name]
                row["speedup_vs_triton"] = rows[-1]["ms"] / ms
            rows.append(row)
            shown = {k: round(v, 4) if isinstance(v, float)
                     else [round(t, 4) for t in v] if isinstance(v, list) else v for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
