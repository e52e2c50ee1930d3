"""`fp4rl bench memory`: what a quantized linear keeps for backward, and one training step's peak.

1. Bytes saved for backward by one linear (default 4096x4096, 2048 tokens, BF16 autocast over
   FP32 master weights, as the trainer runs), measured with
   `torch.autograd.graph.saved_tensors_hooks` during the forward:
     - nn.Linear (BF16 autocast): keeps x and a BF16 copy of W;
     - naive fake-quant QAT, written the usual straight-through way,
       `x + (DQ(Q(x)) - x).detach()` and the same for W, then F.linear: keeps BF16 copies of
       DQ(Q(x)) and DQ(Q(W));
     - fp4rl NVFP4Linear W4A4, backward "dequantized": keeps the packed Q(x) and Q(W);
     - fp4rl NVFP4Linear W4A4, backward "high_precision": keeps x (and W, a Parameter).
   "held" counts each saved storage once and leaves out Parameters (alive anyway); the input
   x counts, since in a network it is an activation kept alive only for backward.
2. Peak memory of one training step (forward + backward + AdamW) of a model under each
   preset, with BF16 autocast over FP32 master weights. Each preset runs in a fresh process;
   after one warm-up step (so AdamW's state exists) the kernel's peak-RSS mark is reset
   (`echo 5 > /proc/self/clear_refs`) and the figure is VmHWM - VmRSS around the second step,
   read from /proc/self/status: CPU memory of the whole process, Linux only.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp4rl.benchmarks import int_at_least
from fp4rl.nvfp4 import fake_quantize
from fp4rl.precision import PrecisionContract
from fp4rl.qat import NVFP4Linear, convert

MiB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--features", type=int_at_least(16, 16), default=4096,
                        help="linear in = out features, a multiple of 16 (4096)")
    parser.add_argument("--tokens", type=int_at_least(1), default=2048,
                        help="tokens through the linear (2048)")
    parser.add_argument("--model", default="default", help="model for the training step (fp4rl.load_model)")
    parser.add_argument("--presets", default="bf16,nvfp4-linear", help="comma-separated presets for the step")
    parser.add_argument("--batch", type=int_at_least(1), default=4, help="sequences per training step (4)")
    parser.add_argument("--seq", type=int_at_least(2), default=128,
                        help="tokens per sequence, 2 or more (the loss predicts tokens 2..seq) (128)")
    parser.add_argument("--skip-step", action="store_true", help="only the single-linear measurement")
    parser.add_argument("--results", default=None, help="append the tables to this markdown file")
    parser.add_argument("--step-child", default=None, help=argparse.SUPPRESS)  # internal: one preset


def saved_for_backward(fn, params=()):
    """Run fn() under saved_tensors_hooks -> (saved tensors, bytes of all saved storages,
    bytes held: each storage once, Parameters left out)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return saved, sum(storages.values()), sum(n for ptr, n in storages.items() if ptr not in skip)


def linear_table(features: int, tokens: int) -> list[dict]:
    torch.manual_seed(0)
    base = nn.Linear(features, features, bias=False)  # FP32 master weight
    x = torch.randn(tokens, features, dtype=torch.bfloat16)  # [M, K], what the layer before hands over
    contract = PrecisionContract("nvfp4-linear")

    def naive(x, w):
        x_q = x + (fake_quantize(x.detach(), **contract.input_quantize_kwargs()) - x).detach()
        w_q = w + (fake_quantize(w.detach(), **contract.weight_quantize_kwargs()) - w).detach()
        return F.linear(x_q, w_q)

    variants = {
        "nn.Linear, BF16 autocast": lambda xx: base(xx),
        "naive fake-quant QAT (STE)": lambda xx: naive(xx, base.weight),
    }
    for backward in ("dequantized", "high_precision"):
        c = PrecisionContract("nvfp4-linear", backward=backward)
        module = NVFP4Linear(base.weight, None, "w4a4", c)
        variants[f"fp4rl W4A4, backward={backward}"] = module
    rows = []
    for name, fn in variants.items():
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            t0 = time.perf_counter()
            saved, total, held = saved_for_backward(lambda fn=fn, xx=xx: fn(xx), params=[base.weight])
            seconds = time.perf_counter() - t0
        kinds = sorted({str(t.dtype).replace("torch.", "") for t in saved
                        if t.untyped_storage().data_ptr() != base.weight.untyped_storage().data_ptr()})
        rows.append(dict(variant=name, held=held, total=total, saved_dtypes=kinds, forward_s=seconds))
    naive_held = rows[1]["held"]
    for row in rows:
        row["vs_naive"] = row["held"] / naive_held
    return rows


def format_linear_table(rows, features, tokens) -> str:
    lines = [f"Saved for backward by one {features}x{features} linear over {tokens} tokens "
             "(BF16 autocast, FP32 master weight; Parameters excluded, each storage once):", "",
             "| variant | saved dtypes (besides W) | held for backward | vs naive | saved incl. W |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {', '.join(r['saved_dtypes'])} | {r['held'] / MiB:.2f} MiB "
                     f"| {r['vs_naive']:.3f}x | {r['total'] / MiB:.2f} MiB |")
    return "\n".join(lines)


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def step_child(args) -> dict:
    """One preset in this (fresh) process: warm-up step, then the measured step."""
    import fp4rl

    torch.manual_seed(0)
    model, _ = fp4rl.load_model(args.model, dtype=torch.float32)
    contract = PrecisionContract(args.step_child)
    convert(model, contract)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.model.embed_tokens.num_embeddings  # HF names
    ids = torch.randint(0, vocab, (args.batch, args.seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    params = sum(p.numel() for p in model.parameters())
    nvfp4 = sum(m.weight.numel() for m in model.modules() if isinstance(m, NVFP4Linear))
    return dict(preset=args.step_child, rss_before=before * 1024, peak=peak * 1024,
                step_delta=(peak - before) * 1024, seconds=seconds, params=params, nvfp4_params=nvfp4)


def step_table(args) -> list[dict]:
    rows = []
    for preset in args.presets.split(","):
        cmd = [sys.executable, "-m", "fp4rl.benchmarks.memory", "--step-child", preset, "--model", args.model,
               "--batch", str(args.batch), "--seq", str(args.seq)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"bench memory: the {preset} step failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def format_step_table(rows, args) -> str:
    lines = [f"One training step (forward + backward + AdamW), model {args.model!r}, batch {args.batch} x "
             f"{args.seq} tokens, BF16 autocast over FP32 master weights; CPU RSS from /proc/self/status, "
             "a fresh process per preset, measured on the 2nd step:", "",
             "| preset | params in NVFP4 | RSS before step | peak RSS in step | peak - before | step time |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['nvfp4_params'] / r['params']:.1%} "
                     f"| {r['rss_before'] / MiB:.0f} MiB | {r['peak'] / MiB:.0f} MiB "
                     f"| {r['step_delta'] / MiB:.0f} MiB | {r['seconds']:.1f} s |")
    return "\n".join(lines)


def _provenance() -> str:
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    machine = f"{cpu.group(1) if cpu else platform.machine()}, {torch.get_num_threads()} torch threads"
    argv = sys.argv[1:]
    if sys.argv[0].endswith("memory.py"):  # python -m fp4rl.benchmarks.memory
        command = "python -m fp4rl.benchmarks.memory " + " ".join(argv)
    else:
        command = "fp4rl bench memory " + " ".join(argv[2:] if argv[:2] == ["bench", "memory"] else argv)
    return f"Date: {date}. Machine: {machine}, torch {torch.__version__}. Command: `{command.strip()}`."


def run(args) -> int:
    if args.step_child:
        print(json.dumps(step_child(args)))
        return 0
    rows = linear_table(args.features, args.tokens)
    text = format_linear_table(rows, args.features, args.tokens)
    if not args.skip_step:
        text += "\n\n" + format_step_table(step_table(args), args)
    print(text)
    if args.results:
        with open(args.results, "a") as f:  # one write: other benchmarks append their own sections
            f.write(f"\n## memory\n\n{_provenance()}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
