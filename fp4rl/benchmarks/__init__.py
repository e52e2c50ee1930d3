"""`fp4rl bench NAME`: reproducible benchmarks. Each NAME is a module here with
`add_arguments(parser)` and `run(args)`; figures go to bench/RESULTS.md."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "quantize": "CPU throughput of each NVFP4 quantize mode; SNR of 6 vs 4/6",
    "memory": "bytes saved for backward per quantized linear; peak RSS of a training step",
    "rollout": "CPU tokens/s of the fp4rl sampler vs transformers generate; packed memory; sync bytes",
    "sampler_gpu": "GPU: sampler decode tokens/s (Triton kernels, CUDA graphs) per preset vs BF16",
    "gpu_kernels": "H200: Triton quantize, W4A16/grouped GEMM, FP4/FP8-KV attention vs cuBLAS/SDPA",
}


def _range(low: int, multiple: int) -> str:
    return f"an integer >= {low}" + (f" and a multiple of {multiple}" if multiple > 1 else "")


def int_at_least(low: int, multiple: int = 1):
    """argparse type: an integer >= low (and a multiple of `multiple`); anything else is refused at parse time
    with a message naming the option (argparse adds it) and the valid range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or value % multiple:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {_range(low, multiple)}")
        return value
    return parse


def int_list_at_least(low: int, multiple: int = 1, empty_ok: bool = False):
    """argparse type: comma-separated integers, each >= low (and a multiple of `multiple`); returns the list
    cleaned as a string ('1, 2' -> '1,2'), as the benchmarks split it. '' is refused unless empty_ok."""
    def parse(text: str) -> str:
        items = [v.strip() for v in text.split(",") if v.strip()]
        try:
            values = [int(v) for v in items]
        except ValueError:
            values = None
        if values is None or any(v < low or v % multiple for v in values) or (not values and not empty_ok):
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, each "
                                             f"{_range(low, multiple).removeprefix('an integer ')}"
                                             + (" ('' for none)" if empty_ok else ""))
        return ",".join(map(str, values))
    return parse


def add_arguments(parser):
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"fp4rl.benchmarks.{name}").add_arguments(p)


def run(args):
    return importlib.import_module(f"fp4rl.benchmarks.{args.bench}").run(args)
