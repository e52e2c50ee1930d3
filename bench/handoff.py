"""What one kernel-to-kernel hand-off costs inside a CUDA graph on the GPU, three ways (thirty-first session).

The thirtieth session's stamps (fp4rl.benchmarks.stamps, device_run93) put 1.6 us between the MoE gate / up
GEMM's last CTA leaving and the down GEMM's first CTA passing griddepcontrol.wait, with nothing between them;
the 30B decode layer has nine such hand-offs. This measures a chain of L small kernels, each CTA reading the
whole of the previous kernel's output (as a decode GEMM reads all of x) and writing its slice:

  serial  plain launches (stream order)
  pdl     programmatic dependent launch, griddepcontrol.launch_dependents at the start, griddepcontrol.wait
          before the first read (how fp4rl's decode step chains its kernels)
  flag    programmatic dependent launch with the trigger at the start but no griddepcontrol.wait: thread 0 of
          each CTA polls a counter with ld.acquire.gpu until every CTA of the previous kernel added 1 to it
          (red.release.gpu after a CTA barrier behind its stores); x is read through L2 (ld.cg). The counters
          are zeroed by one memset at the head of the graph. SLEEP: ns of __nanosleep between polls.

  python3 bench/handoff.py [--links 100] [--ctas 132,264] [--n 2048] [--out results.json]

Prints per mode and grid: us per link (median of 20 replays of the graph, CUDA events), and checks that
every mode computes the serial chain's values (a missed dependency shows as a wrong sum).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from fp4rl.kernels import pdl  # noqa: E402

SOURCE = r"""
#ifndef SLEEP
#define SLEEP 0
#endif
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// MODE 0 serial, 1 pdl (griddepcontrol.wait), 2 flag (counters)
extern "C" __global__ void __launch_bounds__(256)
link(const float* __restrict__ x, float* __restrict__ y, int n, const unsigned* cin, unsigned* cout,
     unsigned need) {
    if (MODE >= 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (MODE == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (MODE == 2) {
        if (threadIdx.x == 0) {
            while (ld_acquire(cin) < need) {
                if (SLEEP) __nanosleep(SLEEP);
            }
        }
        __syncthreads();
    }
    // every CTA reads all of x (a decode GEMM's x): a sum over a stride, then its slice of y
    __shared__ float part[8];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(x + i) * (1.0f / 1024.f);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < 8; ++w) tot += part[w];
    const int per = (n + gridDim.x - 1) / gridDim.x;
    for (int i = blockIdx.x * per + threadIdx.x; i < min(n, (blockIdx.x + 1) * per); i += blockDim.x)
        y[i] = __ldcg(x + (i * 7) % n) * 0.5f + tot;
    if (MODE == 2) {
        __syncthreads();  // every thread's stores before thread 0's release
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(cout) : "memory");
    }
}
"""


def kernel(mode: int, sleep: int):
    src = f"#define MODE {mode}\n#define SLEEP {sleep}\n" + SOURCE
    return torch.cuda._compile_kernel(src, "link", nvcc_options=["-std=c++17"])


def chain(mode: int, sleep: int, links: int, ctas: int, n: int, x0: torch.Tensor):
    """A captured graph of `links` launches and its output buffer; replay() runs the whole chain."""
    kern = kernel(mode, sleep)
    bufs = [x0.clone(), torch.empty_like(x0)]
    cnt = torch.zeros(links + 1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()

    def body():
        bufs[0].copy_(x0)
        cnt.zero_()
        for i in range(links):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            pdl.launch(kern, (ctas, 1, 1), (256, 1, 1),
                       [src, dst, n, cnt[i:], cnt[i + 1:], 0 if i == 0 else ctas], 0, stream,
                       mode >= 1 and i > 0)

    with torch.cuda.stream(stream):
        body()  # warm (compiles, loads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        body()
    return graph, bufs[links % 2]


def time_graph(graph, reps: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=100)
    ap.add_argument("--ctas", default="132,264")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("handoff.py needs a CUDA GPU")
        return 1
    x0 = torch.randn(args.n, device="cuda") * 1e-3
    rows = []
    for ctas in (int(c) for c in args.ctas.split(",")):
        want = None
        for name, mode, sleep in (("serial", 0, 0), ("pdl", 1, 0), ("flag", 2, 0), ("flag sleep 32", 2, 32),
                                  ("flag sleep 128", 2, 128)):
            graph, out = chain(mode, sleep, args.links, ctas, args.n, x0)
            us = time_graph(graph)
            same = None
            if want is None:
                want = out.clone()
            else:
                same = bool(torch.equal(out, want))
            rows.append({"mode": name, "ctas": ctas, "links": args.links, "us_per_link": us / args.links,
                         "graph_us": us, "same_as_serial": same})
            print(json.dumps(rows[-1]), flush=True)
            del graph
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
