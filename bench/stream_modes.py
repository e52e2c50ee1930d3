"""Fourteenth session: can a decode GEMM's weight stream run at the speed of a copy? (bench/RESULTS.md: the
mma16 GEMM's stream alone, its `t3` build, moves a Qwen3-30B-A3B layer's weights at 1.2-1.7 TB/s, while a
torch copy of the same total bytes is ~1.5x faster.)

A read-only kernel with the GEMM's geometry (a warp per 16-row tile, 128-k steps of 1280 B: 1 KB of codes and
256 B of scales side by side, split-K over grid y, WARPS warps per CTA) that reads every byte of the weight
and XORs it into a checksum, in three ways of moving the bytes:
  cpasync  today's: a ring of DEPTH steps per warp in shared memory filled by 16-byte cp.async per lane
  bulk     a ring of DEPTH steps per warp filled by one cp.async.bulk (TMA) of 1280 B per step, issued by one
           lane, completion on an mbarrier per stage
  ldg      no shared memory: each lane keeps DEPTH steps of its 40 B in registers (16-byte loads)
over the layer shapes of Qwen3-30B-A3B at one token (the splits gemv_cuda.choose picks) and a Qwen3-8B shape.
Every variant's checksum must equal the buffer's (computed by torch). CUDA-graph replay of a chain of launches
over copies that defeat L2, median of 5; a torch copy of the same bytes in the same run as the reference.

  python3 bench/stream_modes.py [--out FILE]
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_fixed import timed as graph_timed  # noqa: E402  (graph replay of reps calls, median of rounds)

from fp4rl.kernels import pdl  # noqa: E402
from fp4rl.kernels.gemv_cuda import _set_smem  # noqa: E402

CH = 1280
SRC = r"""
#define CH 1280
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ u32 xor4(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

#if MODE == 0
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
#elif MODE == 1
__device__ __forceinline__ void bar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk(u32 dst, const void* src, u32 bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                 :: "r"(bar), "r"(CH) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(CH), "r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 phase) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    } while (!done);
}
#endif

#ifndef EPI
#define EPI 0
#endif
#if EPI == 1
#define CLUSTER_ATTR __cluster_dims__(1, SPLITC, 1)
#else
#define CLUSTER_ATTR
#endif
extern "C" __global__ void __launch_bounds__(WARPS * 32) CLUSTER_ATTR
stream(const unsigned char* __restrict__ buf, int steps, int split, u32* out, u32* part, int* cnt) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long tile = (long long)blockIdx.x * WARPS + warp;
    const int per = steps / split, s0 = blockIdx.y * per, s1 = s0 + per;
    const unsigned char* src = buf + tile * steps * CH;  // step s of this warp's tile at src + s * CH
    u32 acc = 0;
#if MODE == 0
    unsigned char* my = smem + warp * DEPTH * CH;
    auto issue = [&](int s, int d) {
        if (s < s1) {
            const u32 dst = smem_u32(my + d * CH);
            const unsigned char* c = src + (long long)s * CH;
            cp16(dst + lane * 16, c + lane * 16);
            cp16(dst + 512 + lane * 16, c + 512 + lane * 16);
            if (lane < 16) cp16(dst + 1024 + lane * 16, c + 1024 + lane * 16);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) issue(s0 + d, d);
    for (int s = s0; s < s1; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            asm volatile("cp.async.wait_group %0;" :: "n"(DEPTH - 1) : "memory");
            __syncwarp();
            if (s + d < s1) {
                acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + lane * 16));
                acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + 512 + lane * 16));
                if (lane < 16) acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + 1024 + lane * 16));
            }
            __syncwarp();
            issue(s + d + DEPTH, d);
        }
    }
#elif MODE == 1
    // barriers first (8-byte aligned), then the rings (128-byte aligned)
    const u32 bars = smem_u32(smem) + warp * DEPTH * 8;
    unsigned char* my = smem + ((WARPS * DEPTH * 8 + 127) & ~127) + warp * DEPTH * CH;
    if (lane == 0) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) bar_init(bars + 8 * d);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    u32 phase = 0;  // bit d: the parity stage d waits for next
    if (lane == 0) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
            if (s0 + d < s1) bulk(smem_u32(my + d * CH), src + (long long)(s0 + d) * CH, bars + 8 * d);
    }
    for (int s = s0; s < s1; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            if (s + d < s1) {
                bar_wait(bars + 8 * d, (phase >> d) & 1);
                phase ^= 1u << d;
                acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + lane * 16));
                acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + 512 + lane * 16));
                if (lane < 16) acc ^= xor4(*reinterpret_cast<const uint4*>(my + d * CH + 1024 + lane * 16));
                __syncwarp();  // every lane has read stage d ...
                if (lane == 0 && s + d + DEPTH < s1) {
                    // ... before the copy refills it (generic reads, then an async-proxy write)
                    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                    bulk(smem_u32(my + d * CH), src + (long long)(s + d + DEPTH) * CH, bars + 8 * d);
                }
            }
        }
    }
#else
    uint4 r[DEPTH][3];
    auto load = [&](int s, int d) {
        if (s < s1) {
            const uint4* c = reinterpret_cast<const uint4*>(src + (long long)s * CH);
            r[d][0] = __ldcg(c + lane);
            r[d][1] = __ldcg(c + 32 + lane);
            r[d][2] = lane < 16 ? __ldcg(c + 64 + lane) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) load(s0 + d, d);
    for (int s = s0; s < s1; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            if (s + d < s1) acc ^= xor4(r[d][0]) ^ xor4(r[d][1]) ^ xor4(r[d][2]);
            load(s + d + DEPTH, d);
        }
    }
#endif
#if EPI == 0
    atomicXor(out, acc);
#elif EPI == 1
    // the GEMM's split-K epilogue: partials in shared memory, a cluster barrier, each rank reduces its share
    // of the elements over every rank's shared memory (DSMEM), a second barrier before anyone leaves
    (void)part; (void)cnt;
#if MODE == 0
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
    __syncthreads();  // every warp is done with its ring
    u32* mine = reinterpret_cast<u32*>(smem);
    mine[threadIdx.x] = acc;
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    if (threadIdx.x % SPLITC == rank) {
        u32 v = 0;
        for (int r = 0; r < SPLITC; ++r) {
            u32 ra, t;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra)
                         : "r"(smem_u32(mine + threadIdx.x)), "r"(r));
            asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(t) : "r"(ra) : "memory");
            v ^= t;
        }
        atomicXor(out, v);
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    // split-K through global memory: partials to a workspace, a counter per column block; the last CTA of a
    // block reduces the partials in split order and resets the counter (no cluster)
    __shared__ int last;
    part[((long long)blockIdx.x * split + blockIdx.y) * (WARPS * 32) + threadIdx.x] = acc;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1) == split - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        u32 v = 0;
        for (int r = 0; r < split; ++r)
            v ^= __ldcg(part + ((long long)blockIdx.x * split + r) * (WARPS * 32) + threadIdx.x);
        atomicXor(out, v);
        if (threadIdx.x == 0) cnt[blockIdx.x] = 0;
    }
#endif
}
"""

MODES = {"cpasync": 0, "bulk": 1, "ldg": 2}
# (mode, DEPTH, WARPS, EPI): EPI 0 an atomic per thread, 1 the GEMM's cluster split-K epilogue, 2 split-K
# through a global workspace and a counter per column block
VARIANTS = [("cpasync", 2, 8, 0), ("cpasync", 4, 8, 0), ("bulk", 2, 8, 0), ("bulk", 4, 8, 0),
            ("bulk", 8, 8, 0), ("bulk", 4, 4, 0), ("ldg", 2, 8, 0), ("ldg", 4, 8, 0), ("ldg", 4, 4, 0)]
EPI_VARIANTS = [("cpasync", 2, 8, 0), ("cpasync", 2, 8, 1), ("cpasync", 2, 8, 2), ("ldg", 2, 8, 0),
                ("ldg", 2, 8, 1), ("ldg", 2, 8, 2)]
EPI_NAMES = {0: "", 1: " cluster", 2: " global"}
# (name, 16-row tiles, 128-k steps, split): Qwen3-30B-A3B at one token (q|k|v, o; the 8 routed experts'
# gate|up and down as one stack each) and Qwen3-8B's q|k|v, with gemv_cuda.choose's splits
SHAPES = [("30B q|k|v 5120x2048", 320, 16, 4), ("30B o 2048x4096", 128, 32, 8),
          ("30B 8 experts gate|up 8x1536x2048", 768, 16, 2), ("30B 8 experts down 8x2048x768", 1024, 6, 2),
          ("8B q|k|v 6144x4096", 384, 32, 4)]


def source(mode: str, depth: int, warps: int, epi: int = 0, split: int = 1) -> str:
    return (f"#define MODE {MODES[mode]}\n#define DEPTH {depth}\n#define WARPS {warps}\n#define EPI {epi}\n"
            f"#define SPLITC {split}\n" + SRC)


def smem_bytes(mode: str, depth: int, warps: int, epi: int = 0) -> int:
    if mode == "ldg":
        return warps * 32 * 4 if epi == 1 else 0
    bars = (warps * depth * 8 + 127) // 128 * 128 if mode == "bulk" else 0
    return bars + warps * depth * CH


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "stream_modes.json"))
    ap.add_argument("--epi", action="store_true",
                    help="the split-K epilogues (none / the GEMM's cluster reduction / a global "
                         "workspace and counter) instead of the ways of moving the bytes")
    a = ap.parse_args()
    variants = EPI_VARIANTS if a.epi else VARIANTS
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    kerns = {}
    print("| shape | MB | torch copy of the same bytes | "
          + " | ".join(f"{m} d{d} w{w}{EPI_NAMES[e]}" for m, d, w, e in variants) + " |", flush=True)
    for name, tiles, steps, split in SHAPES:
        nbytes = tiles * steps * CH
        copies = max(4, -(-4 * l2 // nbytes))
        bufs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda") for _ in range(copies)]
        want = int(np.bitwise_xor.reduce(bufs[0].cpu().numpy().view(np.uint32)))
        dst = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(copies)]
        half = [b[: nbytes // 2] for b in bufs]  # a copy of n/2 bytes moves n (read + write)
        def copy(r, dst=dst, half=half, copies=copies):
            dst[r % copies].copy_(half[r % copies])

        copy_us = graph_timed(copy, 4 * copies, 5)
        cells = [f"{copy_us:.2f}"]
        for mode, depth, warps, epi in variants:
            if tiles % warps:
                cells.append("-")
                continue
            key = (mode, depth, warps, epi, split if epi == 1 else 1)
            if key not in kerns:
                kerns[key] = torch.cuda._compile_kernel(source(*key), "stream", compute_capability="90a",
                                                        nvcc_options=["-std=c++17"])
            kern, smem = kerns[key], smem_bytes(mode, depth, warps, epi)
            _set_smem(kern, smem)
            blocks = tiles // warps
            part = torch.empty(blocks * split * warps * 32, dtype=torch.int32, device="cuda")
            cnt = torch.zeros(blocks, dtype=torch.int32, device="cuda")

            def launch(r, kern=kern, smem=smem, warps=warps, blocks=blocks, split=split, steps=steps,
                       bufs=bufs, copies=copies, part=part, cnt=cnt):
                pdl.launch(kern, (blocks, split, 1), (warps * 32, 1, 1),
                           [bufs[r % copies], steps, split, sink, part, cnt], smem,
                           torch.cuda.current_stream(), False)

            sink.zero_()
            launch(0)
            launch(1)  # twice: the counters must have been reset
            launch(1)
            torch.cuda.synchronize()
            got = int(sink.item()) & 0xFFFFFFFF
            if got != want:
                cells.append("WRONG")
                out["rows"].append(dict(shape=name, mode=mode, depth=depth, warps=warps, epi=epi, wrong=True))
                continue
            us = graph_timed(launch, 4 * copies, 5)
            out["rows"].append({"shape": name, "mode": mode, "depth": depth, "warps": warps, "epi": epi,
                                "us": us, "tbs": nbytes / us / 1e6, "copy_us": copy_us, "mb": nbytes / 1e6})
            cells.append(f"{us:.2f}")
        print(f"| {name} | {nbytes / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)
        del bufs, dst, half
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
