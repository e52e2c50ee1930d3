// W4A16 skinny GEMM for 1..16*MT rows of x on Hopper (sm_90): y[M, N] = x[M, K] @ DQ(W)[N, K]^T.
//
// Compiled at run time by NVRTC (fp4rl/kernels/gemv_cuda.py prepends the #defines: NT, MT, SPLIT,
// DEPTH, WG_ROW, and CLUSTER = __cluster_dims__(1, SPLIT, 1) when SPLIT > 1).
//
// Why this shape: a decode GEMM streams the weight once and is bound by how many bytes are in
// flight per SM and by the integer pipe (Hopper has no FP4 conversion). Swapping A and B of
// mma.sync.m16n8k16 puts x (up to 16 rows) in A and 8 weight rows x 16 k in B, so one MMA serves
// every row of x at once: 1 and 16 rows cost the same instructions per weight byte.
//
// Weight copy ("mma16" layout, made once per weight version by gemv_cuda.relayout):
//   wt: int32 [N/8][K/128][32 lanes][4]: lane (g = lane/4, t = lane%4) of n-tile i holds, in word q
//       of 128-k step s, the 8 codes of row 8i+g at k = 128s + 32q + 16h + {2t, 2t+1, 2t+8, 2t+9}
//       (h = 0, 1): exactly its B fragments (b0, b1) of two m16n8k16 MMAs. The bits of each word are
//       permuted (gemv32 bit order, gemv.swizzle) so that each bf16 pair is a mask or a shift and
//       a mask of the word: the bf16 pattern of e2m1 * 2^-126.
//   st: bf16 [N/8][K/128][8 rows][8 blocks] = bf16(block_scale * 2^118), exact; a lane reads the
//       16 bytes of its row g (the 4 lanes of a group read the same bytes).
//   (e2m1 * 2^-126) * (s * 2^118) = e2m1 * s * 2^-8 exactly in bf16; the 2^8 goes to the global scale.
// One warp owns NT n-tiles (8 rows each) over the CTA's K range; 8 warps per CTA (NB = 64 NT rows).
// Each lane keeps DEPTH steps of its weight and scale words in registers (16 B loads that skip L1),
// so ~DEPTH * NT * 32 B per lane are in flight. x's K slice is staged once per CTA in shared
// memory (rows padded to 16 MT, zero-filled) and read as A fragments with ldmatrix (a tile of 8
// rows with zeros in A rows 8-15 measured more instructions offline: the MMA's register quad must
// be rebuilt around the zeros for every MMA).
// Split-K: the SPLIT CTAs of an n-block form a cluster; each leaves its fp32 partial in shared
// memory and CTA r adds the 1/SPLIT-th of the block's columns of all of them through distributed
// shared memory, in rank order (deterministic: no atomics, no global workspace, no fence).
// A row's result does not depend on the other rows of x (the configuration is chosen from N, K).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define WARPS 8
#ifndef TIMING
#define TIMING 0  // timing-only variants (wrong results): 1 no x staging, 2 no unpack/MMA
#endif
#define NB (WARPS * NT * 8)
#define XROWS (16 * MT)
#define STAGE_BYTES 640  // one n-tile and step: 512 B of weight words + 128 B of scales

__device__ __forceinline__ u32 smem_u32(const void* p);

// 16 bytes global -> shared, L2 only; src_bytes < 16 zero-fills the rest (0: no read at all)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The 4 bf16 pairs (e2m1 * 2^-126) of one gemv32-ordered word: pairs 0-2 are the word masked
// after a shift of 0, 3, 6; pair 3 gathers its bits from three places.
__device__ __forceinline__ void unpack(u32 w, u32& p0, u32& p1, u32& p2, u32& p3) {
    const u32 M = 0x81C081C0u;
    p0 = w & M;
    p1 = (w << 3) & M;
    p2 = (w << 6) & M;
    p3 = ((w >> 4) & 0x00C000C0u) | ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u);
}

// One 32-bit word of weights (two k16 blocks) for all m tiles: 4 scale multiplies, 2 MMAs per tile.
__device__ __forceinline__ void word_mma(float (*acc)[4], float (*acc2)[4], u32 w, u32 s_lo, u32 s_hi,
                                         const u32 (*af)[2][4]) {
    u32 p0, p1, p2, p3;
    unpack(w, p0, p1, p2, p3);
    p0 = mul_bf16x2(p0, s_lo);
    p1 = mul_bf16x2(p1, s_lo);
    p2 = mul_bf16x2(p2, s_hi);
    p3 = mul_bf16x2(p3, s_hi);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        mma(acc[mt], af[mt][0][0], af[mt][0][1], af[mt][0][2], af[mt][0][3], p0, p1);
        mma(acc2[mt], af[mt][1][0], af[mt][1][1], af[mt][1][2], af[mt][1][3], p2, p3);  // 2nd chain
    }
}

// bf16 scale pair (lo: block 2q, hi: block 2q+1) -> each duplicated in both halves (ptxas folds the
// moves into the multiply's operand selector .H0_H0 / .H1_H1: no instruction).
__device__ __forceinline__ u32 dup_lo(u32 s) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {l, l}; }" : "=r"(d) : "r"(s));
    return d;
}
__device__ __forceinline__ u32 dup_hi(u32 s) {
    u32 d;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; mov.b32 %0, {h, h}; }" : "=r"(d) : "r"(s));
    return d;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

__device__ __forceinline__ u32 f2_to_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) CLUSTER
w4a16_mma16(const u16* __restrict__ x, const uint4* __restrict__ wt, const uint4* __restrict__ st,
            const float* __restrict__ wg, u16* __restrict__ y, int M, int N, int K, int stride_xm,
            int stride_ym) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = K >> 7;                    // 128-k steps
    const int per = (S + SPLIT - 1) / SPLIT;  // steps per split
    const int s0 = blockIdx.y * per;
    const int s1 = min(S, s0 + per);
    const int ntiles = N >> 3;
    const int tile0 = (blockIdx.x * WARPS + warp) * NT;
    const int XS = per * 128 + 8;  // smem row stride of x in bf16 (16 B pad: conflict-free ldmatrix)

    // shared memory: x's K slice [XR + 1][XS] bf16 (rows < M, then one zero row that the A fragments
    // of rows >= M read), then one ring per warp of DEPTH stages x NT x (32 lanes x 16 B of weight
    // words + 8 rows x 16 B of scales)
    const int XR = min(M, XROWS);
    u16* xs = reinterpret_cast<u16*>(smem);
    unsigned char* ring = smem + (((XR + 1) * XS * 2 + 127) & ~127) + warp * (DEPTH * NT * STAGE_BYTES);
    const u32 ring_s = smem_u32(ring);

    // 1. x[:, 128 s0 : 128 s1] -> shared memory (rows >= M and k beyond the range zero-filled), async
    {
        const int cw = per * 16;  // 16-byte chunks per row
        const int kbase = s0 * 128, kend = s1 * 128;
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (XR + 1) * cw); c += WARPS * 32) {
            const int m = c / cw, kc = (c - m * cw) * 8;
            const bool in = m < M && kbase + kc < kend;
            const u16* src = in ? x + (u64)m * stride_xm + kbase + kc : x;
            cp_async16(smem_u32(xs + m * XS + kc), src, in ? 16 : 0);
        }
        cp_async_commit();
    }

    // 2. the weight stream: each lane copies its 16 B of weight words per n-tile and step, lanes 0-7
    // the 16 B of scales of row `lane`; one commit group per step, DEPTH steps ahead
    const uint4* wp[NT];
    const uint4* sp[NT];
    bool ok[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        ok[j] = tile0 + j < ntiles;
        const u64 tile = ok[j] ? (u64)(tile0 + j) : 0;
        wp[j] = wt + (tile * S) * 32 + lane;
        sp[j] = st + (tile * S) * 8 + (lane & 7);
    }
    auto issue = [&](int step, int stage) {
        if (step < s1) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (ok[j]) {
                    const u32 dst = ring_s + (stage * NT + j) * STAGE_BYTES;
                    cp_async16(dst + lane * 16, wp[j] + (u64)step * 32, 16);
                    if (lane < 8) cp_async16(dst + 512 + lane * 16, sp[j] + (u64)step * 8, 16);
                }
            }
        }
        cp_async_commit();  // possibly empty: one group per step keeps the count uniform
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) issue(s0 + d, d);
    cp_async_wait<DEPTH>();  // x (the oldest group) has landed for this thread ...
    __syncthreads();         // ... and for every thread

    // ldmatrix row addresses of this lane
    const int mat = lane >> 3, r8 = lane & 7;
    u32 xa[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)  // matrix j = rows 0-7 / 8-15 (j & 1) x k [0,8) / [8,16) (j >> 1)
        xa[mt] = smem_u32(xs + min(16 * mt + r8 + (mat & 1) * 8, XR) * XS + (mat >> 1) * 8);

    float acc[NT][MT][4], acc2[NT][MT][4];  // blocks 2q and 2q+1: two independent MMA chains
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][mt][i] = acc2[j][mt][i] = 0.f;

    // 3. the stream
    const int g4 = lane >> 2;
    for (int s = s0; s < s1; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int sd = s + d;
            if (sd < s1) {
                cp_async_wait<DEPTH - 1>();  // this step's group (and all older) landed
                __syncwarp();                // for every lane of the warp (the scales come from lanes 0-7)
                uint4 wv[NT], sv[NT];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const unsigned char* b = ring + (d * NT + j) * STAGE_BYTES;
                    wv[j] = *reinterpret_cast<const uint4*>(b + lane * 16);
                    sv[j] = *reinterpret_cast<const uint4*>(b + 512 + g4 * 16);
                }
                __syncwarp();  // every lane has its copy: the stage can be refilled
                issue(sd + DEPTH, d);
                const u32 kb = (u32)(sd - s0) * 128 * 2;  // byte offset of this step in a smem row
#pragma unroll
                for (int q = 0; q < 4; ++q) {  // word q: k 32q .. 32q+31 (blocks 2q, 2q+1)
                    u32 af[MT][2][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        ldmatrix_x4(xa[mt] + kb + q * 64, af[mt][0][0], af[mt][0][1], af[mt][0][2],
                                    af[mt][0][3]);
                        ldmatrix_x4(xa[mt] + kb + q * 64 + 32, af[mt][1][0], af[mt][1][1], af[mt][1][2],
                                    af[mt][1][3]);
                    }
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const u32 sw = word_of(sv[j], q);
                        if (TIMING & 2)
                            acc[j][0][0] += __uint_as_float((word_of(wv[j], q) ^ sw) & 0x3F000000u);
                        else
                            word_mma(acc[j], acc2[j], word_of(wv[j], q), dup_lo(sw), dup_hi(sw), af);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may still be in flight when shared memory is reused below
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][mt][i] += acc2[j][mt][i];

    // 4. epilogue. D fragment: c0, c1 = row g, columns 2t, 2t+1; c2, c3 = row g + 8.
    const int g = lane >> 2, t = lane & 3;
    const float gs = WG_ROW ? 0.f : wg[0] * 256.f;
    if (SPLIT == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (!ok[j]) continue;
            const int n = (tile0 + j) * 8 + 2 * t;
            const float g0 = WG_ROW ? wg[n] * 256.f : gs, g1 = WG_ROW ? wg[n + 1] * 256.f : gs;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int m = 16 * mt + g + 8 * hh;
                    if (m < M)
                        *reinterpret_cast<u32*>(y + (u64)m * stride_ym + n) =
                            f2_to_bf16x2(acc[j][mt][2 * hh] * g0, acc[j][mt][2 * hh + 1] * g1);
                }
            }
        }
        return;
    }
#if SPLIT > 1
    // partials -> own shared memory [XROWS][NB] fp32 (x is no longer needed)
    __syncthreads();
    float* part = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int nl = (warp * NT + j) * 8 + 2 * t;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int m = 16 * mt + g + 8 * hh;
                part[m * NB + nl] = acc[j][mt][2 * hh];
                part[m * NB + nl + 1] = acc[j][mt][2 * hh + 1];
            }
        }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    {
        u32 rank;
        asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
        const int cols = NB / SPLIT;
        const int total = XR * cols;
        const u32 base = smem_u32(part);
        const int r = threadIdx.x % SPLIT;  // the rank this thread reads
        for (int e0 = 0; e0 < total; e0 += (WARPS * 32) / SPLIT) {  // uniform per warp: shuffles below
            const int e = e0 + threadIdx.x / SPLIT;
            float v = 0.f;
            int m = 0, nl = 0;
            if (e < total) {
                m = e / cols;
                nl = rank * cols + (e - m * cols);
                u32 ra;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(base + (u32)(m * NB + nl) * 4),
                             "r"(r));
                asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
            }
#pragma unroll
            for (int off = 1; off < SPLIT; off <<= 1) {  // fixed tree over ranks: deterministic
                const float o = __shfl_down_sync(0xffffffffu, v, off);
                if ((r & (2 * off - 1)) == 0) v += o;
            }
            const int n = blockIdx.x * NB + nl;
            if (r == 0 && e < total && n < N) {
                const float gg = WG_ROW ? wg[n] * 256.f : gs;
                y[(u64)m * stride_ym + n] = (u16)(f2_to_bf16x2(v * gg, 0.f) & 0xFFFFu);
            }
        }
    }
    // nobody leaves while another CTA of the cluster may still read its shared memory
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
