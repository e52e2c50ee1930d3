"""The GPU token choice alone: fp4rl.kernels.sample_head against the torch path (fp4rl.sampler.sample_next),
temperature 1 sampling and greedy, BF16 logits [B, V] (Qwen3's V = 151936), eager as in the generate loop.
Per batch: GPU time per call (CUDA events around 50 calls, median of 7 rounds), host time per call (wall
time of issuing the 50 calls, the same rounds) and the GPU's own work per call (`*_dev_us`: the kernels' and
copies' durations in a torch.profiler trace of 50 calls, divided by 50). The first two are equal when the loop
is host-bound (the eleventh session's H200 run: the launches never queued up), which is why the third exists.

    python3 bench/sample_head_bench.py [--batch 1,8,32] [--vocab 151936] [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from fp4rl.kernels import sample_head  # noqa: E402
from fp4rl.sampler import SamplingParams, sample_next  # noqa: E402


def timed(fn, calls: int, rounds: int, device) -> tuple[float, float]:
    """(GPU us per call, host us per call): medians over rounds of `calls` back-to-back calls."""
    fn()  # compile / warm
    gpu, host = [], []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t) / calls * 1e6)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize(device)
            gpu.append(start.elapsed_time(end) * 1e3 / calls)
    return (statistics.median(gpu) if gpu else float("nan")), statistics.median(host)


def device_us(fn, calls: int) -> float:
    """Microseconds of kernels and copies per call of fn, from a profiler trace of `calls` calls."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    busy = sum(e["dur"] for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    return busy / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for b in (int(v) for v in args.batch.split(",")):
        gen = torch.Generator().manual_seed(b)
        logits = (torch.randn(b, args.vocab, generator=gen) * 3).bfloat16().to(device)
        g1, g2 = torch.Generator(device).manual_seed(0), torch.Generator(device).manual_seed(0)
        for mode, greedy in (("sample", False), ("greedy", True)):
            params = SamplingParams(greedy=greedy)
            k = timed(lambda z=logits, gr=greedy, g=g1: sample_head.sample_head(z, gr, 1.0, g), args.calls,
                      args.rounds, device)
            t = timed(lambda z=logits, p=params, g=g2: sample_next(z, p, g), args.calls, args.rounds, device)
            row = {"batch": b, "mode": mode, "kernel_gpu_us": k[0], "kernel_host_us": k[1],
                   "torch_gpu_us": t[0], "torch_host_us": t[1]}
            if device.type == "cuda":
                row["kernel_dev_us"] = device_us(
                    lambda z=logits, gr=greedy, g=g1: sample_head.sample_head(z, gr, 1.0, g), args.calls)
                row["torch_dev_us"] = device_us(lambda z=logits, p=params, g=g2: sample_next(z, p, g),
                                                args.calls)
            rows.append(row)
            print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}),
                  flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(device), "vocab": args.vocab, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
