"""Where a sampler decode step goes beyond its graph replay: one `generate` under torch.profiler (CPU and
CUDA), its trace cut into steps at the decode graph's launches. Per step (medians over the steady steps):
the window between two graph launches as the GPU saw it, the time of the graph's kernels, of the eager
kernels (sampling, bookkeeping: the top ones by name) and the GPU idle time; on the host, the time
between two graph launches and the part spent waiting (cudaEventSynchronize / cudaStreamSynchronize).

    python3 bench/step_gap.py --shape qwen3-30b-a3b:12 --preset nvfp4-w4a16 --batch 1,8,32 [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


def _union(intervals) -> float:
    """Total length covered by (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def trace_steps(path: str) -> dict:
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    runtime = {}  # correlation -> runtime API name
    launches, waits = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver":
            runtime[e["args"].get("correlation")] = e["name"]
            if "GraphLaunch" in e["name"]:
                launches.append(e["ts"])
            if "Synchronize" in e["name"]:
                waits.append((e["ts"], e["dur"]))
    kernels = []  # (start, duration, name, correlation id of the graph launch or None)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            corr = e["args"].get("correlation")
            graph = corr if "GraphLaunch" in runtime.get(corr, "") else None
            kernels.append((e["ts"], e["dur"], e["name"], graph))
    kernels.sort(key=lambda k: k[0])
    launches.sort()
    # a step's GPU window: from the first kernel of one replay (one graph launch's correlation id) to the
    # first kernel of the next; busy times are unions of kernel intervals (PDL overlaps a graph's kernels)
    first: dict = {}
    for ts, _dur, _name, graph in kernels:
        if graph is not None and graph not in first:
            first[graph] = ts
    starts = sorted(first.values())
    steps = []
    for a, b in zip(starts, starts[1:]):
        inside = [(ts, min(ts + dur, b), name, g) for ts, dur, name, g in kernels if a <= ts < b]
        eager = {}
        for ts, end, name, g in inside:
            if g is None:
                eager[name[:80]] = eager.get(name[:80], 0.0) + end - ts
        busy_all = _union([(ts, end) for ts, end, _, _ in inside])
        busy_graph = _union([(ts, end) for ts, end, _, g in inside if g is not None])
        steps.append({"window": b - a, "graph": busy_graph,
                      "eager": _union([(ts, end) for ts, end, _, g in inside if g is None]),
                      "idle": b - a - busy_all, "eager_kernels": eager,
                      "n_eager": sum(1 for *_, g in inside if g is None)})
    host = [b - a for a, b in zip(launches, launches[1:])]
    waited = [sum(d for ts, d in waits if a <= ts < b) for a, b in zip(launches, launches[1:])]
    return {"steps": steps, "host_between_launches": host, "host_waiting": waited}


def summarize(found: dict, skip: int = 3) -> dict:
    steps = found["steps"][skip:-1] or found["steps"]
    if not steps:
        return {"error": "no decode steps in the trace (no graph replays seen)"}
    med = {k: statistics.median(s[k] for s in steps) for k in ("window", "graph", "eager", "idle", "n_eager")}
    names: dict[str, list] = {}
    for s in steps:
        for n, d in s["eager_kernels"].items():
            names.setdefault(n, []).append(d)
    top = sorted(((statistics.median(v), n) for n, v in names.items()), reverse=True)[:10]
    host = found["host_between_launches"][skip:-1] or found["host_between_launches"]
    waited = found["host_waiting"][skip:-1] or found["host_waiting"]
    return {"us_per_step_median": med, "steps": len(steps),
            "top_eager_us": [(round(d, 1), n) for d, n in top],
            "host_between_launches_us_median": statistics.median(host) if host else None,
            "host_waiting_us_median": statistics.median(waited) if waited else None}


def main() -> int:
    from fp4rl.benchmarks.sampler_gpu import SHAPES, build_trainer
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b:12")
    ap.add_argument("--preset", default="nvfp4-w4a16")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape, _, layers = args.shape.partition(":")
    trainer = build_trainer(SHAPES[shape], int(layers or SHAPES[shape]["num_hidden_layers"]), "cuda")
    convert(trainer, PrecisionContract(args.preset, bf16_last_fraction=0.0))
    sampler = Sampler(trainer, device="cuda", dtype=torch.bfloat16, eos_token_ids=[], max_seq_len=256,
                      kernels=True)
    del trainer
    torch.cuda.empty_cache()
    out = {}
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, 128),
                                generator=torch.Generator().manual_seed(batch)).tolist()
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.tokens, seed=0)
        sampler.generate(prompts, params)  # capture, warm
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sampler.generate(prompts, params)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            found = trace_steps(path)
        out[batch] = summarize(found)
        print(json.dumps({"batch": batch, **out[batch]}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
