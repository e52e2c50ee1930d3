// The MoE router GEMV and route of 1..8 decode tokens in one cluster launch (sm_90):
// logits = bf16(x[T, H] @ Wr[E, H]^T), softmax, top-K, weights, and the stable grouping of the T*K (token,
// slot) pairs by expert (fp4rl/kernels/moe_route_cuda.py; the arithmetic is moe_route_cuda.reference's).
//
// Compiled at run time by NVRTC (moe_route_cuda.source prepends the #defines: T, E, H, K, NORM, EPW, NCH, CL,
// and PRENORM).
// PRENORM 1: x is first the residual add + RMSNorm of the decode step (fused.add_rmsnorm's job): x' = bf16(xr
// + hr), y = bf16(w * bf16(x' * rstd)), rstd = 1 / sqrt(sum(x'^2) / H + eps) (IEEE sqrt and division), the
// sum in a fixed order (lane: its chunks i = warp + 8 j ascending, 8 exact squares each in order; the warp's
// butterfly; the warps' sums in warp order); every CTA computes y for its own router rows, CTA 0 also writes
// x' and y. One launch instead of add_rmsnorm's and this one's (moe_route_cuda.norm_router_route).
// Why not the Triton router_route: its grid's last program routes alone, after a global counter and a
// round trip through the partial sums, with a CTA barrier per reduction (~4.5 us of its ~6-7 us at one token,
// bench/gpu_kernels.md, sixteenth and thirtieth sessions). Here:
// - one cluster of CL CTAs x 8 warps; warp w of CTA c owns EPW router rows (experts (8c + w) EPW + j), which
//   it copies to shared memory (cp.async) before griddepcontrol.wait: the router weight does not change
//   during a decode step (moe_route_cuda launches with PDL only inside pdl.step(), as the GEMMs' weight
//   prefetch). Not into registers: ptxas sinks a register load of read-only data below the wait, to its use;
// - after the wait the CTA copies x (the previous kernel's output) to shared memory from L2 (cp.async.cg: this
//   SM's L1 may hold an earlier layer's x), each lane sums 8 exact bf16 products a chunk in fp32 (chunk
//   lane + 32 i, i ascending, elements in order), and the warp adds the lanes' sums by xor butterfly
//   (16, 8, 4, 2, 1): every lane ends with the same bits; one RNE rounding to bf16;
// - the logits go to CTA 0's shared memory through distributed shared memory, one cluster barrier, and CTA 0
//   routes: warp t token t, lane l experts l + 32 s (s ascending); softmax max and sum the same way (a lane's
//   values in order, then the butterfly), libdevice's accurate expf (no fast-math), IEEE division; top-K by K
//   rounds of redux.sync max over (probability bits + 1) then min over the ids that hold it (ties to the
//   lower id); a row with a NaN probability (a NaN or infinite logit) takes the lowest ids not taken and NaN
//   weights, as moe_route.route; the pairs' counting sort (stable in pair order) by CTA 0's threads.
typedef unsigned int u32;
typedef unsigned short u16;

#define WARPS 8
#ifndef PRENORM
#define PRENORM 0
#endif
#ifndef ASYNC
// 1: the logits reach CTA 0 by st.async, each completing bytes on an mbarrier of CTA 0 that only CTA 0 waits
// on, instead of st.shared::cluster and a cluster barrier (whose release is a MEMBAR.ALL.GPU on the path)
#define ASYNC 0
#endif
#define EL ((E + 31) / 32)  // logits per lane in the route (experts lane + 32 s)

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, L2 only; src_bytes 0: no read, zeros
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// dynamic shared memory: the warps' router rows [WARPS][EPW][NCH][32 lanes] then x [T][NCH][32] (16-byte chunks,
// chunk c = lane + 32 i of a row at [i][lane]; zeros past H / 8); PRENORM: then hr [T][NCH][32] and the norm
// weight [NCH][32] (x holds xr, then x', then y)
#define W_CHUNKS (WARPS * EPW * NCH * 32)
#define X_CHUNKS (T * NCH * 32)

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) __cluster_dims__(CL, 1, 1)
moe_router_route(const u16* x, const u16* __restrict__ wr, u16* __restrict__ logits,
                 long long* __restrict__ idx, u16* __restrict__ wout, int* __restrict__ rows,
                 int* __restrict__ pos, int* __restrict__ offs, int stride_x, int stride_w,
                 const u16* hr, const u16* __restrict__ nw, u16* __restrict__ xo, u16* __restrict__ yo,
                 int stride_h, int inv_h_bits, int eps_bits) {  // (fp32 bit patterns: the launcher passes ints)
    extern __shared__ __align__(16) uint4 chunks[];
    __shared__ float lg[T][CL * WARPS * EPW];  // CTA 0: every expert's logit (as the bf16 value)
    __shared__ int ids[T * K];                  // CTA 0: the chosen experts, pair p = t K + j
#if ASYNC
    __shared__ __align__(8) unsigned long long bar;  // CTA 0: completes once every logit's 4 bytes landed
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    // PDL (no-ops without the launch attribute): the next kernel may be scheduled now; it waits for this grid
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#if ASYNC
    if (rank == 0 && threadIdx.x == 0) {  // one arrival (this one, expecting the bytes) and T E x 4 bytes
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&bar)) : "memory");
        asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                     :: "r"(smem_u32(&bar)), "r"(4 * T * E) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
    // the cluster's CTAs may touch each other's shared memory only once all have started (and CTA 0's
    // mbarrier is set up): arrive now, wait before the first remote store (the GEMV lies between)
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    // this warp's router rows go to shared memory before the wait (read-only during a decode step); each lane
    // copies the chunks it reads itself. cp.async, not loads into registers: ptxas sinks a register load of
    // read-only data below griddepcontrol.wait, to its use
    const int e0 = ((int)rank * WARPS + warp) * EPW;
    uint4* wsm = chunks + warp * EPW * NCH * 32;
    const u32 w_at = smem_u32(wsm);
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const int c = lane + 32 * i;  // 16-byte chunk: columns 8c .. 8c + 7
            const bool ok = e0 + j < E && c < H / 8;
            cp_async16(w_at + 16u * (u32)((j * NCH + i) * 32 + lane),
                       ok ? (const void*)(wr + (long long)(e0 + j) * stride_w + 8 * c) : (const void*)wr,
                       ok ? 16 : 0);
        }
    uint4* xsm = chunks + W_CHUNKS;
    const u32 x_at = smem_u32(xsm);
#if PRENORM
    uint4* hsm = xsm + X_CHUNKS;
    uint4* nsm = hsm + X_CHUNKS;
#pragma unroll
    for (int r = 0; r < (NCH * 32 + WARPS * 32 - 1) / (WARPS * 32); ++r) {  // the norm weight: read-only too
        const int c = (int)threadIdx.x + WARPS * 32 * r;
        const bool ok = c < H / 8;
        if (c < NCH * 32)
            cp_async16(smem_u32(nsm + c), ok ? (const void*)(nw + 8 * c) : (const void*)nw, ok ? 16 : 0);
    }
#endif
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // x (the previous kernel's output; PRENORM: the residual xr and the attention's hr), once per CTA
    for (int q = threadIdx.x; q < X_CHUNKS; q += WARPS * 32) {
        const int t = q / (NCH * 32), c = q % (NCH * 32);
        const bool ok = c < H / 8;
        cp_async16(x_at + 16u * (u32)q, ok ? (const void*)(x + (long long)t * stride_x + 8 * c) : (const void*)x,
                   ok ? 16 : 0);
#if PRENORM
        cp_async16(smem_u32(hsm + q), ok ? (const void*)(hr + (long long)t * stride_h + 8 * c) : (const void*)hr,
                   ok ? 16 : 0);
#endif
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
    __syncthreads();
#if PRENORM
    {
        // x' = bf16(xr + hr) in place, its sum of squares per token in the order of the header, then y in place;
        // a chunk (t, i, lane) belongs to warp i % WARPS throughout
        __shared__ float part[T][WARPS];
        float ss[T];
#pragma unroll
        for (int t = 0; t < T; ++t) {
            ss[t] = 0.f;
            for (int i = warp; i < NCH; i += WARPS) {
                const int q = (t * NCH + i) * 32 + lane;
                const uint4 s = pn_add8(xsm[q], hsm[q]);
                xsm[q] = s;
                ss[t] = pn_sq8(ss[t], s);
            }
            ss[t] = pn_warp_sum(ss[t]);
            if (lane == 0) part[t][warp] = ss[t];
        }
        __syncthreads();
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float rstd = pn_rstd(part[t], inv_h_bits, eps_bits);
            for (int i = warp; i < NCH; i += WARPS) {
                const int q = (t * NCH + i) * 32 + lane, c = lane + 32 * i;
                const uint4 s = xsm[q];
                const uint4 y = pn_norm8(s, nsm[c], rstd);
                xsm[q] = y;
                if (rank == 0 && c < H / 8) {
                    *(uint4*)(xo + (long long)t * H + 8 * c) = s;
                    *(uint4*)(yo + (long long)t * H + 8 * c) = y;
                }
            }
        }
        __syncthreads();
    }
#endif
    float acc[EPW][T];
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[j][t] = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const uint4 xv = xsm[(t * NCH + i) * 32 + lane];
#pragma unroll
            for (int j = 0; j < EPW; ++j) acc[j][t] = pn_dot8(acc[j][t], xv, wsm[(j * NCH + i) * 32 + lane]);
        }
    // the lanes' sums by xor butterfly; each logit rounded once, kept as the bf16 value
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float v = acc[j][t];
#pragma unroll
            for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
            acc[j][t] = v;
        }
    // to CTA 0 through distributed shared memory (one lane per logit), then one cluster barrier (ASYNC: CTA
    // 0 waits on its mbarrier for the bytes; the others go on); the logits' global copy after it, so that the
    // barrier's release does not wait for those stores
    const u32 lg0 = smem_u32(&lg[0][0]);
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#if ASYNC
    u32 rbar;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(rbar) : "r"(smem_u32(&bar)));
#endif
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (lane != (j * T + t) % 32 || e0 + j >= E) continue;
            u32 ra;  // lg[t][e] in CTA 0
            asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(ra)
                         : "r"(lg0 + 4u * (u32)(t * CL * WARPS * EPW + e0 + j)));
            const u32 v = (u32)pn_bf16(acc[j][t]) << 16;
#if ASYNC
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                         :: "r"(ra), "r"(v), "r"(rbar) : "memory");
#else
            asm volatile("st.shared::cluster.b32 [%0], %1;" :: "r"(ra), "r"(v) : "memory");
#endif
        }
#if ASYNC
    if (rank == 0) {
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0; "
                         "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(smem_u32(&bar)) : "memory");
    }
#else
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
#pragma unroll
    for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int t = 0; t < T; ++t)
            if (lane == (j * T + t) % 32 && e0 + j < E) logits[t * E + e0 + j] = pn_bf16(acc[j][t]);
    if (rank != 0) return;
    if (warp < T) {
        const int t = warp;
        float l[EL];
        float mx = -__int_as_float(0x7F800000);
#pragma unroll
        for (int s = 0; s < EL; ++s) {
            const int e = lane + 32 * s;
            l[s] = e < E ? lg[t][e] : -__int_as_float(0x7F800000);
            mx = fmaxf(mx, l[s]);
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < EL; ++s) {
            l[s] = lane + 32 * s < E ? expf(l[s] - mx) : 0.f;
            sum += l[s];
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
        bool nan = false;
#pragma unroll
        for (int s = 0; s < EL; ++s) {
            l[s] = __fdiv_rn(l[s], sum);
            nan |= lane + 32 * s < E && l[s] != l[s];
        }
        const bool bad = __any_sync(0xffffffffu, nan);
        // keys: probability bits + 1 (a probability is >= +0), 1 for every expert of a NaN row, 0: none
        u32 key[EL];
#pragma unroll
        for (int s = 0; s < EL; ++s) key[s] = lane + 32 * s < E ? (bad ? 1u : __float_as_uint(l[s]) + 1u) : 0u;
        float total = 0.f, mine = 0.f;
        int chosen = 0;
#pragma unroll
        for (int j = 0; j < K; ++j) {
            u32 best = 0u, at = 0xFFFFFFFFu;
#pragma unroll
            for (int s = 0; s < EL; ++s)
                if (key[s] > best) {
                    best = key[s];
                    at = (u32)(lane + 32 * s);
                }
            const u32 top = __reduce_max_sync(0xffffffffu, best);
            const u32 e = __reduce_min_sync(0xffffffffu, best == top ? at : 0xFFFFFFFFu);
#pragma unroll
            for (int s = 0; s < EL; ++s)
                if ((u32)(lane + 32 * s) == e) key[s] = 0u;
            const float v = bad ? 0.f : __uint_as_float(top - 1u);
            total += v;
            if (lane == j) {
                mine = v;
                chosen = (int)e;
            }
        }
        if (lane < K) {
            float wv = NORM ? __fdiv_rn(mine, total) : mine;
            if (bad) wv = __int_as_float(0x7FC00000);
            wout[t * K + lane] = pn_bf16(wv);
            idx[t * K + lane] = (long long)chosen;
            ids[t * K + lane] = chosen;
        }
    }
    __syncthreads();
    // the counting sort of the P = T K pairs by expert, stable in pair order
    constexpr int P = T * K;
    for (int p = threadIdx.x; p < P; p += WARPS * 32) {
        const int ep = ids[p];
        int before = 0;
#pragma unroll
        for (int q = 0; q < P; ++q) before += (ids[q] < ep) | ((ids[q] == ep) & (q < p));
        pos[p] = before;
        rows[before] = p / K;
    }
    for (int e = threadIdx.x; e <= E; e += WARPS * 32) {  // offsets[e] = #{q : e_q < e}; offsets[E] = P
        int cnt = 0;
#pragma unroll
        for (int q = 0; q < P; ++q) cnt += ids[q] < e;
        offs[e] = cnt;
    }
}
