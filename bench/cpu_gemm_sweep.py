"""The sampler's CPU GEMMs on the default model's shapes, against oneDNN in the same run.

For each linear shape of SmolLM2-135M (fused q/k/v 960x576, o 576x576, fused gate/up 3072x576,
down 576x1536, lm_head 49152x576) and rows M: the AMX kernel on packed NVFP4 (cpu_gemm.GemmWeight)
and on BF16 (cpu_gemm.BF16Weight), oneDNN on the prepacked BF16 weight (what the sampler used before
the tiled kernel), and F.linear on the plain BF16 weight. Weights rotate over enough copies that
they come from memory, as in a decode step (one pass over the model's weights), not from L2. The
engines alternate within each repeat; medians of per-repeat times, and the paired ratio to oneDNN.

    python bench/cpu_gemm_sweep.py [--rows 1,16,64] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.nn.functional as F

from fp4rl.nvfp4 import cpu_gemm, quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _engines(x, packed, tiled, onednn, dense) -> dict:
    return {
        "nvfp4": lambda i: cpu_gemm.linear(x, packed[i]),
        "bf16": lambda i: cpu_gemm.linear(x, tiled[i]),
        "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "linear": lambda i: F.linear(x, dense[i]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bytes", type=float, default=256e6, help="weight bytes (BF16) per shape rotated through")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_gemm.available():
        raise SystemExit("cpu_gemm is not available on this machine (needs AMX-BF16, AVX512-BF16/VBMI, gcc)")
    print(f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{args.threads} thread(s), command: python bench/cpu_gemm_sweep.py --rows {args.rows} "
          f"--repeats {args.repeats} --threads {args.threads}")
    print("| shape | M | NVFP4 AMX us | BF16 AMX us | oneDNN prepacked us | F.linear us | NVFP4 vs oneDNN "
          "(paired) | BF16 AMX vs oneDNN (paired) | BF16 AMX GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(args.bytes // (2 * N * K)))
        dense = [(torch.randn(N, K, generator=g) * 0.05).bfloat16() for _ in range(copies)]
        packed = [cpu_gemm.GemmWeight([quantize(w.float())]) for w in dense]
        tiled = [cpu_gemm.BF16Weight(w) for w in dense]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense]
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, K, generator=g).bfloat16()
            engines = _engines(x, packed, tiled, onednn, dense)
            times = {k: [] for k in engines}
            for fn in engines.values():
                for i in range(copies):
                    fn(i)
            for _ in range(args.repeats):
                for k, fn in engines.items():
                    start = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    times[k].append((time.perf_counter() - start) / copies)
            med = {k: statistics.median(v) for k, v in times.items()}
            paired = {k: statistics.median(o / t for o, t in zip(times["onednn"], times[k])) for k in times}
            print(f"| {name} {N}x{K} | {M} | {med['nvfp4'] * 1e6:.1f} | {med['bf16'] * 1e6:.1f} | "
                  f"{med['onednn'] * 1e6:.1f} | {med['linear'] * 1e6:.1f} | {paired['nvfp4']:.2f}x | "
                  f"{paired['bf16']:.2f}x | {2 * N * K / med['bf16'] / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
