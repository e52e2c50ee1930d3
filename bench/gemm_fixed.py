"""Ninth session: where the 1-row mma16 GEMM's fixed ~4-5 us per call goes (bench/l2_prefetch.py showed that
weights already in L2 do not make it faster).

python3 bench/gemm_fixed.py   ($OUT/gemm_fixed.json)

CUDA-graph replay of back-to-back launches, us per launch, median of ROUNDS (env, 5):
  empty / empty+cluster8   a kernel that does nothing, 256 CTAs of 256 threads (without / with clusters of 8)
  per shape, split in 1, 2, 4, 8 (cluster = the split), x 1 row:
     cold   the GEMM on rotated weight copies (>= 4x L2)
     hot    the same copy every call (the weight stays in L2)
     bare   TIMING 3: no x staging, no unpack / MMA (the weight stream, the reduction and the launch only)
"""

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import gemv_cuda, pdl  # noqa: E402

EMPTY = r"""
extern "C" __global__ void empty_k(int a) { if (a == 12345 && threadIdx.x == 0) asm volatile("trap;"); }
extern "C" __global__ void __cluster_dims__(1, 8, 1) empty_c(int a) {
    if (a == 12345 && threadIdx.x == 0) asm volatile("trap;");
}
"""
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def capture(fn, reps):
    """fn(0) once (compiles, sizes workspaces), then reps calls r = 0..reps-1 captured in one CUDA graph,
    replayed once; the graph."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn(r)
    g.replay()
    torch.cuda.synchronize()
    return g


def timed(fn, reps, rounds=None):
    """Microseconds per call of fn(r): reps calls r = 0..reps-1 captured in one CUDA graph, the median over
    `rounds` (default ROUNDS) replays."""
    g = capture(fn, reps)
    ts = []
    for _ in range(rounds or ROUNDS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def run_shape(shape, l2):
    rows = []
    n, k = (int(v) for v in shape.split("x"))
    g = torch.Generator("cuda").manual_seed(0)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    scale = (torch.rand(n, k // 16, device="cuda", generator=g) + 0.5).to(torch.float8_e4m3fn)
    wc0 = gemv_cuda.relayout(data, scale)
    nbytes = wc0.wt.numel() * 4 + wc0.st.numel() * 2
    copies = max(4, -(-4 * l2 // nbytes))
    wcs = [wc0] + [gemv_cuda.Mma16Weight(wt=wc0.wt.clone(), st=wc0.st.clone(), n=n, k=k)
                   for _ in range(copies - 1)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    gs = torch.ones(1, device="cuda")
    ref = None
    for split in (1, 2, 4, 8):
        if (k // 128) // split < 1:
            continue
        row = {"shape": shape, "mb": nbytes / 1e6, "split": split}
        for timing in (0, 3):
            cfg = dict(NT=1, MG=1, SPLIT=split, DEPTH=2, **({"TIMING": timing} if timing else {}))
            gemv_cuda.launch(x, wc0, gs, y, cfg=cfg)
            if timing == 0:
                ref = y.clone() if ref is None else ref
                row["max_diff_vs_split1"] = float((y.float() - ref.float()).abs().max())
            tag = "bare_" if timing else ""
            row[tag + "cold_us"] = timed(
                lambda r, cfg=cfg: gemv_cuda.launch(x, wcs[r % copies], gs, y, cfg=cfg), 4 * copies)
            row[tag + "hot_us"] = timed(lambda r, cfg=cfg: gemv_cuda.launch(x, wc0, gs, y, cfg=cfg),
                                        4 * copies)
        rows.append(row)
        print(f"| {shape} | {row['mb']:.1f} | {split} | {row['cold_us']:.1f} | {row['hot_us']:.1f} | "
              f"{row['bare_cold_us']:.1f} | {row['bare_hot_us']:.1f} |", flush=True)
    return rows


def main():
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    ek = torch.cuda._compile_kernel(EMPTY, "empty_k", compute_capability="90a")
    ec = torch.cuda._compile_kernel(EMPTY, "empty_c", compute_capability="90a")
    stream = torch.cuda.current_stream()
    out["empty_us"] = timed(lambda r: pdl.launch(ek, (256, 1, 1), (256, 1, 1), [0], 0, stream, False), 200)
    out["empty_cluster8_us"] = timed(lambda r: pdl.launch(ec, (32, 8, 1), (256, 1, 1), [0], 0, stream, False),
                                     200)
    print(f"empty kernel {out['empty_us']:.2f} us, with clusters of 8 {out['empty_cluster8_us']:.2f} us")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print("| N x K | MB | split | cold us | hot us | bare cold us | bare hot us |")
    for shape in ("4096x4096", "14336x4096", "4096x12288"):
        out["rows"] += run_shape(shape, l2)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "gemm_fixed.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
