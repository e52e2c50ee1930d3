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
    kernels = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            api = runtime.get(e["args"].get("correlation"), "")
            kernels.append((e["ts"], e["dur"], e["name"], "GraphLaunch" in api))
    kernels.sort()
    launches.sort()
    # a step's GPU window: from the first kernel of a replay to the first of the next one (a replay starts at
    # a graph kernel that follows a non-graph one)
    starts, prev_graph = [], False
    for ts, _dur, _name, in_graph in kernels:
        if in_graph and not prev_graph:
            starts.append(ts)
        prev_graph = in_graph
    steps = []
    for a, b in zip(starts, starts[1:]):
        inside = [(ts, dur, name, g) for ts, dur, name, g in kernels if a <= ts < b]
        busy_graph = sum(d for _, d, _, g in inside if g)
        busy_eager = sum(d for _, d, _, g in inside if not g)
        eager = {}
        for _, d, name, g in inside:
            if not g:
                eager[name[:80]] = eager.get(name[:80], 0.0) + d
        steps.append({"window": b - a, "graph": busy_graph, "eager": busy_eager,
                      "idle": b - a - busy_graph - busy_eager, "eager_kernels": eager,
                      "n_eager": sum(1 for *_, g in inside if not g)})
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
