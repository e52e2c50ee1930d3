"""Ninth session: can the decode step hide its NVFP4 GEMMs' weight stream behind the kernels that do not use
DRAM (norms, RoPE, attention at short context) by prefetching the next GEMM's weights into L2?

python3 bench/l2_prefetch.py [shape,...]   ($OUT/l2_prefetch.json; shapes NxK, default: Qwen3-8B's)

Per shape, CUDA-graph replay of R iterations over rotated copies of the weight (>= 4x L2 in all, so a copy is
cold when its turn comes), 1 row of x, the mma16 kernel (gemv_cuda.launch), median of ROUNDS (env, 5):
  gemm      the GEMM alone, back to back
  sleep     a one-thread kernel spinning SLEEP_US (stands for the step's DRAM-idle kernels)
  serial    sleep, then the GEMM
  pf<f>     sleep on the main stream while a side stream prefetches the first fraction f of every
            (16-row tile, K split) range of the copy into L2 (cp.async.bulk.prefetch.L2), joined before
            the GEMM
  pfonly    the prefetch of the whole copy alone (its DRAM time)
What the idea can buy per GEMM = serial - pf<f> (same sleep in both).
"""

import json
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_fixed import timed as graph_timed  # noqa: E402  (graph replay of reps calls, median of rounds)

from fp4rl.kernels import gemv_cuda, pdl  # noqa: E402

PF_SRC = r"""
extern "C" __global__ void l2_prefetch(const char* wt, const char* st, int tiles, int steps, int split,
                                       int take) {
    // one thread per (tile, split) range: the first `take` steps of the range, codes (1 KB/step) and scales
    // (256 B/step), each as one bulk prefetch
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tiles * split) return;
    long long tile = i / split, part = i % split, per = steps / split;
    long long s0 = tile * (long long)steps + part * per;
    const char* a = wt + s0 * 1024;
    const char* b = st + s0 * 256;
    unsigned na = (unsigned)(take * 1024), nb = (unsigned)(take * 256);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(a), "r"(na) : "memory");
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(b), "r"(nb) : "memory");
}
"""


def run_shape(shape, pf, side, rounds, sleeps, fracs, cyc_per_us, l2, dev):
    n, k = (int(v) for v in shape.split("x"))
    g = torch.Generator(dev).manual_seed(0)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=g)
    scale = (torch.rand(n, k // 16, device=dev, generator=g) * 2 + 0.5).to(torch.float8_e4m3fn)
    wc0 = gemv_cuda.relayout(data, scale)
    nbytes = wc0.wt.numel() * 4 + wc0.st.numel() * 2
    copies = max(4, -(-4 * l2 // nbytes))
    wcs = [wc0] + [gemv_cuda.Mma16Weight(wt=wc0.wt.clone(), st=wc0.st.clone(), n=n, k=k)
                   for _ in range(copies - 1)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    gs = torch.ones(1, device=dev)
    cfg = gemv_cuda._plan(n, k, 1, dev.index or 0)
    split, steps, tiles = cfg["SPLIT"], k // 128, n // 16
    per = steps // split

    def prefetch(wc, frac, stream):
        take = max(1, round(per * frac))
        threads = tiles * split
        pdl.launch(pf, (-(-threads // 128), 1, 1), (128, 1, 1), [wc.wt, wc.st, tiles, steps, split, take],
                   0, stream, False)

    def body(kind, sleep_us, wc, frac):
        if kind == "gemm":
            gemv_cuda.launch(x, wc, gs, y)
        elif kind == "sleep":
            torch.cuda._sleep(int(sleep_us * cyc_per_us))
        elif kind == "serial":
            torch.cuda._sleep(int(sleep_us * cyc_per_us))
            gemv_cuda.launch(x, wc, gs, y)
        elif kind == "pfonly":
            prefetch(wc, 1.0, torch.cuda.current_stream())
        else:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(wc, frac, side)
            torch.cuda._sleep(int(sleep_us * cyc_per_us))
            main.wait_stream(side)
            gemv_cuda.launch(x, wc, gs, y)

    def timed(kind, sleep_us, frac, reps):
        return graph_timed(lambda r: body(kind, sleep_us, wcs[r % copies], frac), reps, rounds)

    reps = 4 * copies
    row = {"shape": shape, "bytes": nbytes, "copies": copies, "cfg": cfg,
           "gemm_us": timed("gemm", 0, 0, reps), "pfonly_us": timed("pfonly", 0, 0, reps)}
    for s in sleeps:
        row[f"sleep{s:g}_us"] = timed("sleep", s, 0, reps)
        row[f"serial{s:g}_us"] = timed("serial", s, 0, reps)
        for f in fracs:
            row[f"pf{f:g}_sleep{s:g}_us"] = timed("pf", s, f, reps)
    print(json.dumps(row), flush=True)
    return row


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["4096x4096", "6144x4096", "24576x4096",
                                                                "4096x12288", "14336x4096"]
    rounds = int(os.environ.get("ROUNDS", "5"))
    sleeps = [float(s) for s in os.environ.get("SLEEP_US", "3,10").split(",")]
    fracs = [float(f) for f in os.environ.get("FRACS", "0.25,0.5,1").split(",")]
    dev = torch.device("cuda")
    pf = torch.cuda._compile_kernel(PF_SRC, "l2_prefetch", compute_capability="90a")
    clock = 1980  # MHz, the H200's boost clock: only scales the sleep (its time is measured on its own)
    cyc_per_us = clock
    side = torch.cuda.Stream()
    out = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "clock_mhz": clock},
           "rows": []}
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    for shape in shapes:
        out["rows"].append(run_shape(shape, pf, side, rounds, sleeps, fracs, cyc_per_us, l2, dev))
        torch.cuda.empty_cache()
    print("| shape | MB | gemm | prefetch alone | " + " | ".join(
        f"sleep {s:g}: serial, " + ", ".join(f"pf{f:g}" for f in fracs) for s in sleeps) + " |")
    for r in out["rows"]:
        cells = []
        for s in sleeps:
            base = r[f"sleep{s:g}_us"]
            cells.append(f"{r[f'serial{s:g}_us'] - base:.1f}, " + ", ".join(
                f"{r[f'pf{f:g}_sleep{s:g}_us'] - base:.1f}" for f in fracs))
        print(f"| {r['shape']} | {r['bytes'] / 1e6:.1f} | {r['gemm_us']:.1f} | {r['pfonly_us']:.1f} | "
              + " | ".join(cells) + " |")
    print("(sleep columns: time per iteration minus the sleep alone, i.e. what the GEMM adds to the step)")
    path = os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
