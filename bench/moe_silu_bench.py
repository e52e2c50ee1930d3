"""Eleventh session: the MoE down projection with SiLU(gate) * up computed in the grouped mma16 kernel's x
staging (its SILU build, gemv_cuda_grouped.launch_grouped(x_silu=True)) against fused.silu_mul then the plain
kernel, and the plain kernel alone. Qwen3-30B-A3B's down_proj: 128 experts of 2048x768, top 8, random routing.

python3 bench/moe_silu_bench.py [--tokens 1,2,4,8,16,32,64] [--out FILE.json]

CUDA-graph replay of 50 back-to-back calls under PDL (as in the decode step), us per call, median of ROUNDS
(bench/gemm_fixed.timed). Each token count first checks the fused output equal to silu_mul + kernel, bit for
bit (a mismatch stops the run). The helper that wrote the SILU build timed it with a script that was not kept
(bench/RESULTS.md, eleventh session); this one is its reproducible replacement, not yet run on a GPU.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_fixed import timed  # noqa: E402

from fp4rl.kernels import fused, gemv_cuda, gemv_cuda_grouped, pdl  # noqa: E402

REPS = 50


def measure(t, e, top, i, h, g, wc, gen) -> dict:
    experts = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)]).reshape(-1)
    counts = torch.bincount(experts, minlength=e)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()
    m = t * top
    gu = (torch.randn(m, 2 * i, generator=gen) * 2).bfloat16().cuda()
    a = fused.silu_mul(gu)[0]
    y1 = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")
    y2, y3 = torch.empty_like(y1), torch.empty_like(y1)

    def unfused(_r):
        with pdl.step():
            gemv_cuda_grouped.launch_grouped(fused.silu_mul(gu)[0], wc, g, offs, y1)

    def silu(_r):
        with pdl.step():
            gemv_cuda_grouped.launch_grouped(gu, wc, g, offs, y2, x_silu=True)

    def alone(_r):
        with pdl.step():
            gemv_cuda_grouped.launch_grouped(a, wc, g, offs, y3)

    unfused(0)
    silu(0)
    torch.cuda.synchronize()
    if not torch.equal(y1, y2):
        raise SystemExit(f"{t} tokens: the SILU build differs from silu_mul + kernel")
    return {"tokens": t, "unfused_us": timed(unfused, REPS), "silu_us": timed(silu, REPS),
            "alone_us": timed(alone, REPS)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not gemv_cuda.available():
        raise SystemExit("needs a Hopper GPU and torch.cuda._compile_kernel")
    e, top, i, h = 128, 8, 768, 2048
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (e, h, i // 2), generator=gen, dtype=torch.uint8).cuda()
    scale = (torch.rand(e, h, i // 16, generator=gen) * 4 + 0.0625).to(torch.float8_e4m3fn).cuda()
    g = (torch.rand(e, generator=gen) * 1e-2 + 1e-3).cuda()
    wc = gemv_cuda_grouped.relayout_stack(data, scale)
    rows = []
    print("| tokens | silu_mul + kernel us | SILU build us | kernel alone us |")
    for t in (int(v) for v in args.tokens.split(",")):
        row = measure(t, e, top, i, h, g, wc, gen)
        rows.append(row)
        print(f"| {t} | {row['unfused_us']:.2f} | {row['silu_us']:.2f} | {row['alone_us']:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
