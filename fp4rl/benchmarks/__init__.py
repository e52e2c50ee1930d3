"""`fp4rl bench NAME`: reproducible benchmarks. Each NAME is a module here with
`add_arguments(parser)` and `run(args)`; figures go to bench/RESULTS.md."""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "quantize": "CPU throughput of each NVFP4 quantize mode; SNR of 6 vs 4/6",
    "memory": "bytes saved for backward per quantized linear; peak RSS of a training step",
    "rollout": "CPU tokens/s of the fp4rl sampler vs transformers generate; packed memory; sync bytes",
    "sampler_gpu": "GPU: sampler decode tokens/s (Triton kernels, CUDA graphs) per preset vs BF16",
    "gpu_kernels": "H200: Triton quantize, W4A16/grouped GEMM, FP4/FP8-KV attention vs cuBLAS/SDPA",
}


def add_arguments(parser):
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"fp4rl.benchmarks.{name}").add_arguments(p)


def run(args):
    return importlib.import_module(f"fp4rl.benchmarks.{args.bench}").run(args)
