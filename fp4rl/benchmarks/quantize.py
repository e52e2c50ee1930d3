"""`fp4rl bench quantize`: CPU speed of every NVFP4 quantize mode, and the error 4/6 saves.

1. Throughput of fp4rl.nvfp4.quantize on one N x N tensor (default 4096 x 4096, float32), on
   one torch thread and on the current number: the median wall time of a few repeats after a
   warm-up, given as GB/s of input read and elements/s, for 1x16 and 16x16 tiles, per-tensor
   and per-row global scales, rule 6 and 4/6 (MSE and MAE), stochastic rounding, the random
   Hadamard transform, and dequantize.
2. Reconstruction SNR, 10 log10(sum x^2 / sum (x - DQ(Q(x)))^2) in dB, of rule 6 vs 4/6 on
   normal and heavy-tailed (Student t, 3 degrees of freedom) data, 1x16 and 16x16 tiles. With
   1x16 blocks 4/6 must beat 6 on both: the command exits with status 1 if it does not.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from fp4rl import nvfp4
from fp4rl.benchmarks import int_at_least, int_list_at_least

MODES: list[tuple[str, dict]] = [
    ("1x16, tensor scale, rule 6", {}),
    ("1x16, row scales, rule 6", {"scale_scope": "row"}),
    ("16x16, tensor scale, rule 6", {"tile": (16, 16)}),
    ("1x16, tensor scale, 4/6 mse", {"scale_rule": "4/6", "err": "mse"}),
    ("1x16, tensor scale, 4/6 mae", {"scale_rule": "4/6", "err": "mae"}),
    ("1x16, row scales, 4/6 mse", {"scale_rule": "4/6", "scale_scope": "row"}),
    ("16x16, tensor scale, 4/6 mse", {"tile": (16, 16), "scale_rule": "4/6"}),
    ("1x16, tensor scale, rule 6, stochastic", {"rounding": "stochastic"}),
    ("1x16, tensor scale, rule 6, Hadamard", {"hadamard_seed": 0}),
]
SNR_RULES = [("6", {}), ("4/6 mse", {"scale_rule": "4/6", "err": "mse"}),
             ("4/6 mae", {"scale_rule": "4/6", "err": "mae"})]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # sizes: one E4M3 scale per 16 values (and 16x16 tiles), so multiples of 16; refused now, not after
    # minutes of timing
    parser.add_argument("--size", type=int_at_least(16, 16), default=4096,
                        help="the tensor is size x size, a multiple of 16 (4096)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="input dtype (float32)")
    parser.add_argument("--repeats", type=int_at_least(1), default=3,
                        help="timed repeats per mode, median shown (3)")
    parser.add_argument("--threads", type=int_list_at_least(1), default=None,
                        help="comma-separated torch thread counts to time (default: 1 and the current count)")
    parser.add_argument("--snr-size", type=int_at_least(16, 16), default=1024,
                        help="the SNR tensors are snr-size^2, a multiple of 16 (1024)")
    parser.add_argument("--results", default=None, help="append the tables to this markdown file")


def median_seconds(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this process) over repeats, after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def throughput_rows(size: int, dtype: torch.dtype, repeats: int) -> list[dict]:
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = []
    for name, kwargs in MODES:
        if kwargs.get("rounding") == "stochastic":
            kwargs = {**kwargs, "generator": torch.Generator().manual_seed(1)}
        seconds, cpu = median_seconds(lambda kw=kwargs: nvfp4.quantize(x, **kw), repeats)
        rows.append({"mode": f"quantize {name}", "seconds": seconds, "cpu": cpu, "bytes": x.nbytes,
                     "elements": x.numel()})
    q = nvfp4.quantize(x)
    seconds, cpu = median_seconds(lambda: nvfp4.dequantize(q, dtype), repeats)
    rows.append({"mode": "dequantize (reads the packed tensor)", "seconds": seconds, "cpu": cpu,
                 "bytes": q.nbytes, "elements": x.numel()})
    return rows


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(x.pow(2).sum().item() / (x - y).pow(2).sum().item())


def datasets(size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    normal = torch.randn(size, size, generator=gen)
    chi2 = torch.zeros(size, size)
    for _ in range(3):  # chi-squared with 3 degrees of freedom
        chi2 += torch.randn(size, size, generator=gen).pow(2)
    return {"normal N(0, 1)": normal, "heavy-tailed Student t (3 dof)": normal / torch.sqrt(chi2 / 3)}


def snr_rows(size: int) -> list[dict]:
    rows = []
    for data_name, x in datasets(size).items():
        for tile in (16, (16, 16)):
            row = {"data": data_name, "tile": "16x16" if tile == (16, 16) else "1x16"}
            for rule_name, kwargs in SNR_RULES:
                row[rule_name] = snr_db(x, nvfp4.fake_quantize(x, tile=tile, **kwargs))
            rows.append(row)
    return rows


def markdown(speed: dict[int, list[dict]], snr: list[dict], size: int, dtype: str, snr_size: int) -> str:
    threads = list(speed)
    lines = [f"Throughput on one {size}x{size} {dtype} tensor (median wall time; GB/s of input read, "
             "elements/s), by torch thread count; on one thread also the process's CPU time, which a "
             "busy machine inflates less than wall time:", "",
             "| mode | " + " | ".join(f"{t} thread{'s' * (t > 1)}" for t in threads)
             + (" | 1 thread, CPU time |" if 1 in threads else " |"),
             "|---|" + "---:|" * (len(threads) + (1 in threads))]
    for i, r in enumerate(speed[threads[0]]):
        cells = []
        for t in threads:
            s = speed[t][i]
            gbps, meps = s["bytes"] / s["seconds"] / 1e9, s["elements"] / s["seconds"] / 1e6
            cells.append(f"{s['seconds'] * 1e3:.0f} ms, {gbps:.2f} GB/s, {meps:.0f} M/s")
        if 1 in threads:
            s = speed[1][i]
            cells.append(f"{s['cpu'] * 1e3:.0f} ms, {s['elements'] / s['cpu'] / 1e6:.0f} M/s")
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    lines += ["", f"Reconstruction SNR (dB, higher is better) on {snr_size}x{snr_size} float32 tensors:", "",
              "| data | tile | rule 6 | 4/6 mse | 4/6 mae | 4/6 mse - 6 |", "|---|---|---:|---:|---:|---:|"]
    for r in snr:
        lines.append(f"| {r['data']} | {r['tile']} | {r['6']:.2f} | {r['4/6 mse']:.2f} | {r['4/6 mae']:.2f} "
                     f"| {r['4/6 mse'] - r['6']:+.2f} |")
    return "\n".join(lines)


def header(args: argparse.Namespace) -> str:
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = None
    if Path("/proc/cpuinfo").exists():
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    machine = f"{cpu.group(1) if cpu else platform.machine()}, {cores} cores"
    machine += f", {torch.get_num_threads()} torch threads"
    load = ""
    if Path("/proc/loadavg").exists():
        load = f" (shared with other jobs: load average {Path('/proc/loadavg').read_text().split()[0]})"
    command = (f"fp4rl bench quantize --size {args.size} --dtype {args.dtype} --repeats {args.repeats} "
               f"--threads {args.threads} --snr-size {args.snr_size}"
               + (f" --results {args.results}" if args.results else ""))
    return f"Date: {date}. Machine: {machine}{load}, torch {torch.__version__}. Command: `{command}`."


def run(args: argparse.Namespace) -> int:
    default_threads = torch.get_num_threads()
    if args.threads is None:
        args.threads = ",".join(str(t) for t in sorted({1, default_threads}))
    speed = {}
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            speed[threads] = throughput_rows(args.size, DTYPES[args.dtype], args.repeats)
    finally:
        torch.set_num_threads(default_threads)
    snr = snr_rows(args.snr_size)
    text = "\n\n".join([header(args), markdown(speed, snr, args.size, args.dtype, args.snr_size)])
    print(text)
    # The check is on 1x16 blocks, 4/6's setting; 16x16 tiles are shown for information.
    worse = [r for r in snr if r["tile"] == "1x16" and not (r["4/6 mse"] > r["6"] and r["4/6 mae"] > r["6"])]
    if worse:
        print(f"\nFAIL: 4/6 does not beat rule 6 on {[r['data'] for r in worse]}", file=sys.stderr)
    if args.results:
        with open(args.results, "a") as f:  # one write: other benchmarks append their own sections
            f.write(f"\n## quantize\n\n{text}\n")
    return 1 if worse else 0
