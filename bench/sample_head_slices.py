"""The sampling head's GPU time by slice width (fp4rl.kernels.sample_head.SLICE / BLOCK), and with its first
two kernels merged (sample_head.MERGED: the slices' maxima and sums in one launch): its kernels over BF16
logits [B, V] (Qwen3's V = 151936), temperature 1 sampling with fixed uniforms and greedy, per batch. Per
setting: the kernels' own durations per call (torch.profiler, 50 calls) and the GPU time per call of a CUDA
graph of 20 calls (launch gaps as in a step whose host runs ahead), median of 5 rounds of 10 replays; and
whether every setting picks the same tokens as the module's default for the same uniforms.

    python3 bench/sample_head_slices.py [--batch 1,8,32,128] [--slices 1024,2048,4096,8192] [--merged 0,1]
        [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from fp4rl.kernels import sample_head  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_head_bench import device_us  # noqa: E402


def graph_us(fn, per_graph: int = 20, rounds: int = 5, replays: int = 10) -> float:
    """GPU microseconds per call of fn from replays of a CUDA graph of `per_graph` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / (replays * per_graph))
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32,128")
    ap.add_argument("--slices", default="1024,2048,4096,8192")
    ap.add_argument("--merged", default="0,1")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    default = (sample_head.SLICE, sample_head.BLOCK, sample_head.MERGED)
    rows = []
    for b in (int(v) for v in args.batch.split(",")):
        gen = torch.Generator().manual_seed(b)
        logits = (torch.randn(b, args.vocab, generator=gen) * 3).bfloat16().to(dev)
        u = torch.rand(b, generator=gen, dtype=torch.float64).to(dev)
        sample_head.SLICE, sample_head.BLOCK, sample_head.MERGED = default
        want = {m: sample_head.choose(logits, uu)[0].clone() for m, uu in (("sample", u), ("greedy", None))}
        settings = [(int(m), int(sl)) for m in args.merged.split(",") for sl in args.slices.split(",")]
        for merged, sl in settings:
            sample_head.SLICE, sample_head.BLOCK, sample_head.MERGED = sl, min(default[1], sl), bool(merged)
            for mode, uu in (("sample", u), ("greedy", None)):
                def fn(z=logits, w=uu):
                    return sample_head.choose(z, w)
                row = {"batch": b, "merged": merged, "slice": sl, "block": sample_head.BLOCK, "mode": mode,
                       "same_tokens": bool(torch.equal(fn()[0], want[mode])),
                       "kernel_us": device_us(fn, 50), "graph_us": graph_us(fn)}
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
    sample_head.SLICE, sample_head.BLOCK, sample_head.MERGED = default
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "vocab": args.vocab, "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
