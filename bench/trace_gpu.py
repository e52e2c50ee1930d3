"""What TRACE costs the GPU sampler: decode tokens/s of a guided generate (SamplingParams.guidance, the
kernel engine recording the guidance in its CUDA-graph steps, fp4rl/gpu_trace.py) against the same engine
unguided and against the eager sampler (kernels=False, the only guided path before), same process, same
random-weight model of a real shape, same prompts.

    python3 bench/trace_gpu.py --shapes qwen3-8b:8,qwen3-30b-a3b:8 --batch 1,8,32 --out trace_gpu.json

Tokens/s from the sampler's step clock (the median step after the first few, as fp4rl.benchmarks.sampler_gpu),
over --repeats generates of --tokens new tokens; the guidance's host bytes per token from the completions.
Each shape runs its W4A4 preset: nvfp4-linear for a dense shape, nvfp4-experts (the recipe: W4A4 routed
experts) for an MoE shape, both with the recipe's BF16 last layers (precision.bf16_last_fraction 0.15).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp4rl.benchmarks.decode_timing import CLOCK_SKIP, _median, _sync  # noqa: E402
from fp4rl.benchmarks.sampler_gpu import SHAPES, build_trainer  # noqa: E402


def clocked(sampler, prompts, tokens: int, guidance: float):
    """(seconds per decode step from the step clock, the completions) of one generate."""
    from fp4rl.sampler import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=tokens, seed=0, guidance=guidance)
    sampler.step_clock = clock = []
    try:
        _sync(sampler.device)
        out = sampler.generate(prompts, params)
        _sync(sampler.device)
    finally:
        sampler.step_clock = None
    steady = clock[CLOCK_SKIP:]
    return (steady[-1] - steady[0]) / (len(steady) - 1), out


def guidance_bytes(out) -> float:
    """Host bytes of the completions' guidance per token."""
    total = sum(t.numel() * t.element_size() for c in out for g in c.guidance.values() for t in g.values())
    tokens = sum(len(c.prompt_ids) + len(c.completion_ids) - 1 for c in out)
    return total / tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-8b:8,qwen3-30b-a3b:8", help="shape:layers, comma-separated")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager-tokens", type=int, default=12, help="new tokens of the eager sampler's generate "
                   "(kernels=False; 0 to skip it)")
    p.add_argument("--side-stream", default="0", help="comma-separated settings of gpu_trace.SIDE_STREAM "
                   "for the guided engine rows (1: record kernels on a side stream of the graph)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tokens < CLOCK_SKIP + 2 or (args.eager_tokens and args.eager_tokens < CLOCK_SKIP + 2):
        raise SystemExit(f"trace_gpu: --tokens and --eager-tokens need >= {CLOCK_SKIP + 2} steps (the clock "
                         f"skips {CLOCK_SKIP})")
    if not torch.cuda.is_available():
        print("trace_gpu needs a CUDA GPU")
        return 1
    from fp4rl import gpu_trace
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler

    dev = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    for spec in args.shapes.split(","):
        shape, layers = spec.split(":")
        cfg = SHAPES[shape]
        preset = "nvfp4-experts" if cfg.get("num_experts") else "nvfp4-linear"
        trainer = build_trainer(cfg, int(layers), dev)
        convert(trainer, PrecisionContract(preset, bf16_last_fraction=0.15))
        samplers = {"engine": Sampler(trainer, device=dev, dtype=torch.bfloat16, eos_token_ids=[],
                                      max_seq_len=args.prompt + args.tokens + 8, kernels=True)}
        if args.eager_tokens:
            samplers["eager"] = Sampler(trainer, device=dev, dtype=torch.bfloat16, eos_token_ids=[],
                                        max_seq_len=args.prompt + args.tokens + 8, kernels=False)
        for batch in (int(b) for b in args.batch.split(",")):
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(0, cfg["vocab_size"], (batch, args.prompt), generator=g).tolist()
            sides = [int(v) for v in args.side_stream.split(",")]
            arms = [("engine", 0.0, 0)] + [("engine", 1.0, side) for side in sides] + [("eager", 1.0, 0)]
            for name, guidance, side in arms:
                if name not in samplers:
                    continue
                s = samplers[name]
                if s.engine is not None and bool(side) != gpu_trace.SIDE_STREAM:
                    gpu_trace.SIDE_STREAM = bool(side)
                    s.engine.reset_graphs()  # (recaptured with the other form)
                tokens = args.tokens if name == "engine" else args.eager_tokens
                row = {"shape": shape, "layers": int(layers), "preset": preset, "batch": batch,
                       "sampler": name, "guidance": guidance, "side_stream": bool(side)}
                try:
                    clocked(s, prompts, CLOCK_SKIP + 2, guidance)  # compile, tune, capture
                    runs = [clocked(s, prompts, tokens, guidance) for _ in range(args.repeats)]
                    step = _median(sorted(r[0] for r in runs))
                    row.update(step_ms=step * 1e3, tok_s=batch / step)
                    if guidance:
                        row["guidance_bytes_per_token"] = guidance_bytes(runs[-1][1])
                    if s.engine is not None:
                        row.update(counts=dict(s.engine.counts), graph_error=s.engine.graph_error)
                except Exception as exc:  # noqa: BLE001 - record and go on
                    row["error"] = repr(exc)[:400]
                base = [r for r in results["rows"] if r["shape"] == shape and r["batch"] == batch
                        and r["sampler"] == "engine" and not r["guidance"] and "tok_s" in r]
                if base and "tok_s" in row:
                    row["vs_unguided_engine"] = row["tok_s"] / base[0]["tok_s"]
                results["rows"].append(row)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
        del samplers, trainer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
