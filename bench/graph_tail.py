"""Does one small Triton node at the end of a CUDA graph cost tens of microseconds of replay after a cuBLAS
GEMM? (The forty-first session: the routing record, a 1.7 us Triton kernel, at the end of the 30B's decode
graph after its BF16 lm_head made the replay 36 us slower; bench/RESULTS.md.) Graphs of the lm_head's GEMM at
one row (x [1, 2048] @ W [151936, 2048]^T, cuBLAS, as the BF16 head runs it), alone and followed by: the
routing-record Triton kernel (fp4rl.kernels.step_inputs.record, 48 layers x 8 experts), a torch op of the same
size (index_put), the Triton kernel before the GEMM instead of after; and as in the decode step, after a
chain of 96 PDL Triton launches (fused.add_rmsnorm at one row). Per graph: the replay's GPU time (CUDA events
around 50 back-to-back replays, median of 7 rounds) and its excess over the GEMM alone.

    python3 bench/graph_tail.py [--reps 50] [--rounds 7] [--out FILE.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from fp4rl.kernels import fused, pdl, step_inputs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_head_slices import graph_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(151936, 2048, device=dev, generator=g, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=dev, generator=g, dtype=torch.bfloat16)
    L, k = 48, 8
    chosen = torch.randint(0, 128, (L, 1, 1, k), device=dev, dtype=torch.int16)
    rows = torch.zeros(1, dtype=torch.long, device=dev)
    pos = torch.full((1,), 5, dtype=torch.long, device=dev)
    route = torch.zeros(L, 8, 256, k, dtype=torch.int16, device=dev)

    def gemm():
        return torch.nn.functional.linear(x, w)

    def record():
        step_inputs.record(chosen, rows, pos, route)

    def index_put():
        route[:, rows, pos] = chosen[:, :, 0]

    # the decode step's shape: a chain of PDL Triton kernels (add_rmsnorm at one row, as a layer runs two),
    # the head's GEMM, then the record or not
    hx = torch.randn(1, 2048, device=dev, generator=g, dtype=torch.bfloat16)
    hw = torch.ones(2048, device=dev, dtype=torch.bfloat16)

    def chain():
        with pdl.step():
            y = hx
            for _ in range(96):
                y, _, _ = fused.add_rmsnorm(y, hx, hw, 1e-6)
            return y

    cases = {"gemm": gemm, "gemm + Triton record": lambda: (gemm(), record()),
             "gemm + index_put": lambda: (gemm(), index_put()),
             "Triton record + gemm": lambda: (record(), gemm()), "Triton record alone": record,
             "PDL chain": chain, "PDL chain + gemm": lambda: (chain(), gemm()),
             "PDL chain + gemm + Triton record": lambda: (chain(), gemm(), record()),
             "PDL chain + Triton record + gemm": lambda: (chain(), record(), gemm())}
    rows_out = []
    for name, fn in cases.items():
        us = graph_us(fn, per_graph=1, rounds=args.rounds, replays=args.reps)
        rows_out.append({"graph": name, "replay_us": us})
        print(json.dumps({"graph": name, "replay_us": round(us, 2),
                          "over_gemm_us": round(us - rows_out[0]["replay_us"], 2)}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
