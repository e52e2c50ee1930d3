// W4A16 skinny GEMM for 1..8*MG rows of x on Hopper (sm_90): y[M, N] = x[M, K] @ DQ(W)[N, K]^T
// (any number of rows in blocks of 8*MG with the WGMMA variant, below).
//
// Compiled at run time by NVRTC (fp4rl/kernels/gemv_cuda.py prepends the #defines: NT, MG, SPLIT, DEPTH,
// TRIGGER, WG_ROW, XG_ROW, GROUPED, GATHER, SILU, KW, and CLUSTER = __cluster_dims__(1, SPLIT, 1) when
// SPLIT > 1).
// GROUPED: routed experts (see the kernel's first block): grid z = expert slots.
// GATHER (GROUPED, W4A16): x holds the batch's tokens and row r of the expert-sorted rows is token xrows[r]
// (the MoE route's gather, read by the x staging instead of a separate index_select).
// SILU (GROUPED, W4A16, staged x slice): x is the experts' gate | up [M, 2K] (gate in columns [0, K), up in
// [K, 2K), row stride stride_xm) and the GEMM's x is a = bf16(bf16(silu(gate)) * up), computed by the x
// staging (fused.silu_mul's arithmetic, bit for bit: libdevice expf, IEEE division, RNE roundings) instead
// of a separate silu_mul launch before the down projection.
// GU_SILU (dense W4A16, mma.sync or wgmma; no WS, GSR or XG_ROW): the weight is a fused gate | up [2I, K] (gate
// rows [0, I), up rows [I, 2I)) and y [M, I] is a = bf16(bf16(silu(g)) * u) of the GEMM's bf16 outputs g =
// y_gate, u = y_up (fused.silu_mul's arithmetic on the plain launch's bits): the CTA's NB logical rows are its
// NB / 2 gate rows, then the same NB / 2 rows of up (PTILE: which physical n-tile a logical one streams;
// gemv_cuda.gu_silu_ok: NB / 2 divides I), and the epilogue (SPLIT 1 / KW: in shared memory; the cluster: the
// rank that finishes a gate column finishes its up column too) writes a instead of y, so the dense MLP needs
// no silu_mul launch between its two GEMMs.
// PRENORM (dense W4A16, x staged whole: SPLIT 1, KW any, no XSTREAM / WGMMA / XG_ROW): the GEMM's x is the
// decode step's residual add + RMSNorm of x (the residual) and hr (the layer output to add), computed by the x
// staging (prenorm.cuh; fp4rl.kernels.prenorm.reference's bits: x' = bf16(x + hr), y = bf16(w * bf16(x' *
// rstd)), the sum of squares in its fixed lane / warp order) instead of a separate fused.add_rmsnorm launch;
// CTA 0 writes x' (the next residual) to xo. The norm weight is copied to shared memory before
// griddepcontrol.wait (read-only during a decode step, as the weights). PRENORM 2: what is added is the MoE
// combine of the previous layer's routed experts instead of hr (fused.add_rmsnorm(moe=)'s job): x' = bf16(x +
// bf16(sum_j w[t, j] * d[pos[t KTOP + j]])), the products rounded, added in j order from +0 (moe_route.combine's
// bits); hr is d [T KTOP, K] (the experts' down projection, sorted rows), mpos / mw the route's pos [T KTOP] and
// weights [T, KTOP] (MW_F32: fp32, else bf16), read after the wait from L2.
// RN_OUT / RN_IN (dense W4A16, x staged whole: SPLIT 1; RN_OUT the in-CTA split KW > 1; gemv_cuda.rn_ok): the
// decode step's residual add +
// RMSNorm between two GEMMs, split over them so that no launch runs between (fp4rl.kernels.resnorm's
// arithmetic). RN_OUT, the producer (o_proj, down_proj): its epilogue rounds y as the plain build does, then
// writes the next residual x' = bf16(r + y) to xo, the next GEMM's input xt = bf16(w * x') (w: the next norm's
// weight) in y's place, and per row and 16-column n-tile the fp32 sum of its 16 squares x'^2 to ss [M, N / 16]
// (a fixed tree: the column pairs (c, c + 8), then xor 1, 2, 4). RN_IN, the consumer (q/k/v, gate | up, GU_SILU
// too): after griddepcontrol.wait one warp a row adds the row's K / 16 tile sums of ss (lane l: l + 32 i
// ascending, then the warp's xor butterfly), rstd = 1 / sqrt(sum * inv_k + eps) (IEEE), overlapped with the
// stream; the epilogue multiplies each rounded-free sum by rstd: y = bf16((acc g) rstd). Not
// fused.add_rmsnorm's bits (the norm's output is never rounded before the GEMM): gpu_decode's RESNORM flag.
// XG_ROW: x is a dequantized NVFP4 activation without its per-row global scale (W4A4 emulation: x =
// e2m1 * block_scale, exact in bf16); xg[m] multiplies row m's sum with the weight's global scale.
//
// A decode GEMM streams the weight once; on Hopper it is bound by the bytes in flight per SM and by
// the instructions per weight (no FP4 conversion). mma.sync.m16n8k16 with the weights as A (16 rows x
// 16 k) and x^T as B (16 k x 8 rows of x): one 32-bit word of 8 codes per lane is exactly its A fragment,
// so every MMA consumes 256 codes and serves 8 rows of x at once (MG groups of 8 rows: MG MMAs).
//
// Weight copy ("mma16" layout, made once per weight version by gemv_cuda.relayout):
//   wt: int32 [N/16][K/128][2][32 lanes][4]: lane (g = lane/4, t = lane%4) of n-tile i holds in word w of
//       half h of 128-k step s the codes of rows 16i+g, 16i+g+8 at k = 128s + 16(4h+w) + {2t, 2t+1, 2t+8,
//       2t+9}: its A fragment (a0 a1 a2 a3 = (row g | g+8) x (k 2t | 2t+8) pairs) of one MMA. The bits of
//       each word are permuted (gemv32 bit order, gemv.swizzle) so that each bf16 pair is a mask or a shift
//       and a mask of the word: the bf16 pattern of e2m1 * 2^-126.
//   st: bf16 [N/16][K/128][8 g][8 blocks][2] = bf16(block_scale * 2^118) of rows g and g+8, exact; the
//       4 lanes of a group read the same 32 bytes.
//   (e2m1 * 2^-126) * (s * 2^118) = e2m1 * s * 2^-8 exactly in bf16; the 2^8 goes to the global scale.
// One warp owns NT n-tiles (16 rows each) over the CTA's K range; 8 warps per CTA (NB = 128 NT rows).
// Each warp streams its weight and scale bytes through its own cp.async ring of DEPTH 128-k steps in
// shared memory (one commit group per step). x's K slice is staged once per CTA in shared memory (its
// rows, plus one zero row that the B fragments of missing rows read) and read with ldmatrix.
// Split-K: the SPLIT CTAs of an n-block form a cluster; each leaves its fp32 partial in shared memory
// and CTA r adds its 1/SPLIT-th of the block's outputs from all of them through distributed shared
// memory, in a fixed order (deterministic: no atomics, no global workspace, no fence). KW (SPLIT 1, x staged
// whole): the split is between the KW warps of each n-tile inside one CTA (128 / KW rows per CTA), the
// partials added in shared memory after one barrier, over the same step ranges and in the same tree order as
// SPLIT = KW: the same bits, without the cluster's barriers (gemv_cuda.in_cta_split chooses it).
// A row's result does not depend on the other rows of x (up to 16 rows: SPLIT and the n-blocks depend on
// N, K only; WGMMA: on N, K and the band of rows, gemv_cuda.choose_wide; 2-16 rows on WGMMA with the one-row
// split, gemv_cuda.choose_narrow: the same bits at every row count on that build, within rounding of the
// one-row mma.sync launch, the adders of the two instructions rounding differently).
// Programmatic dependent launch (fp4rl/kernels/pdl.py): launched with the attribute, the kernel may start
// while the previous one runs; it issues its first DEPTH weight steps (which nothing on the stream writes
// during a decode step), then griddepcontrol.wait, then stages x. Without the attribute both are no-ops.
//
// WGMMA (sm_90a; gemv_cuda.choose_wide, 17+ rows): the same weight stream, multiplied by
// wgmma.mma_async m64n(8 MG)k16 with the four warps' A fragments (their 16-row tiles) in registers and
// x^T from shared memory as B; NT m64 tiles per warpgroup share each x chunk (two warpgroups: 128 NT
// weight rows per CTA); x comes in 128-k chunks through a CTA ring (XSTREAM) in the 128-byte swizzle
// (SWZ 1: [k half][row][128 B], 16 B chunk c at c ^ (row % 8), descriptor SBO 1024 B) or as plain 8 x 16 B
// core matrices (SWZ 0); grid z = blocks of 8 MG rows. The accumulators are pinned (acc_fence) so that
// ptxas never moves them while a multiply is in flight (it would serialize every wgmma: warning C7515).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef WARPS
#define WARPS 8  // warps per CTA; 4 (64 NT weight rows a CTA; wgmma: one warpgroup) for the plain dense builds
#endif
#if WARPS != 8 && (WARPS != 4 || WS || ASH || KW > 1 || GROUPED || PRENORM)
#error "WARPS 4 is for the plain dense builds (no WS, ASH, KW, GROUPED or PRENORM); the others take 8"
#endif
#ifndef TRIGGER
#define TRIGGER 1  // where griddepcontrol.launch_dependents goes (see below)
#endif
#ifndef GROUPED
#define GROUPED 0
#endif
#ifndef GATHER
#define GATHER 0
#endif
#if GATHER && (!GROUPED || XG_ROW)
#error "GATHER is for GROUPED W4A16 (no XG_ROW)"
#endif
#ifndef XSTREAM
#define XSTREAM 0  // 1: x in 128-k chunks through a CTA ring with the weights (many rows; DEPTH >= 2)
#endif
#ifndef SILU
#define SILU 0
#endif
#ifndef LDVOL
#define LDVOL 0  // GROUPED: the offsets and x_rows read by a volatile load (ld_routing, below)
#endif
#if LDVOL && !GROUPED
#error "LDVOL is for GROUPED"
#endif
#ifndef SLOTTABLE
#define SLOTTABLE 0  // GROUPED: the first 32 SLOTTABLE experts' offsets read in one round trip (below); 0: 32 a trip
#endif
#if SILU && (!GROUPED || XG_ROW || GATHER || XSTREAM)
#error "SILU is for GROUPED W4A16 with the staged x slice (no XG_ROW, GATHER or XSTREAM)"
#endif
#ifndef PRENORM
#define PRENORM 0
#endif
#ifndef GU_SILU
#define GU_SILU 0
#endif
#ifndef RN_OUT
#define RN_OUT 0
#endif
#ifndef RN_IN
#define RN_IN 0
#endif
#if RN_OUT || RN_IN
#define RN_ARGS , const u16* rn_res, u16* __restrict__ rn_xo, const u16* __restrict__ rn_w, float* rn_ss, \
                int rn_stride_r, int rn_inv_bits, int rn_eps_bits
#else
#define RN_ARGS
#endif
#if PRENORM
#define PN_ARGS , const u16* __restrict__ hr, const u16* __restrict__ nw, u16* __restrict__ xo, int stride_h, \
                int inv_h_bits, int eps_bits, const int* mpos, const void* mw, int stride_mw
#else
#define PN_ARGS
#endif
// the row of x that row m of this CTA's rows reads (only evaluated for m < M)
#if GATHER
#define XROW(m) ld_routing(xrows + (m))
#else
#define XROW(m) (m)
#endif
#if XSTREAM && DEPTH < 2
#error "XSTREAM needs DEPTH >= 2"
#endif
#ifndef WGMMA
#define WGMMA 0  // 1: wgmma.mma_async (sm_90a) with the weights as register A, x from shared memory as B
#endif
#if WGMMA && (!XSTREAM || NT > 2 || GROUPED || MG > 32 || (MG > 16 && NT > 1))
#error "WGMMA needs XSTREAM, NT <= 2, MG <= 16 (MG <= 32 at NT 1) and no GROUPED"
#endif
#ifndef SWZ
#define SWZ 0  // WGMMA: x stages in the 128-byte swizzle (1) or in 8 x 16 B core matrices without swizzle (0)
#endif
#ifndef XPRE
// WGMMA: x's cp.async addresses per thread computed once (see issue_x): 1 one pointer and offset per chunk, 2 one
// running pointer for all of a thread's chunks (rows past M read a row < M). 2 measured 0-2% slower than 1 at
// 32 rows and 0-17% faster at 64, 15-25% at 128-512 (bench/RESULTS.md, nineteenth session).
#define XPRE (WGMMA && SWZ ? (MG <= 4 ? 1 : 2) : 0)
#endif
#if XPRE && !(WGMMA && SWZ)
#error "XPRE is for WGMMA with SWZ 1"
#endif
#ifndef WB
#define WB 1  // WGMMA: 16-k blocks per batch of multiplies (one fence / commit / wait per batch)
#endif
#if WGMMA && (8 % WB)
#error "WB must divide the 8 blocks of a 128-k step"
#endif
#ifndef ASH
// WGMMA: the weights' A operand staged in shared memory (1) instead of registers (0). Each warp unpacks and
// scales its 16 rows of a whole 128-k step into one of two A buffers (stmatrix, the 128 B swizzle of x's
// stages), and the warpgroup multiplies the step with 8 back-to-back wgmma (A and B from shared memory), one
// commit and one wait per step: the next step's unpack runs while this step's multiplies do, and no warp
// waits on a multiply per 16-k block. x is issued DEPTH - 2 steps ahead (the stage of step - 2 is free once
// every warpgroup passed its wait of step - 1: the CTA barrier of the step orders it). NT 1, DEPTH >= 3.
#define ASH 0
#endif
#if ASH && !(WGMMA && SWZ && NT == 1 && XSTREAM && DEPTH >= 3 && XPRE == 2)
#error "ASH needs WGMMA, SWZ 1, NT 1, XSTREAM, DEPTH >= 3 and XPRE 2"
#endif
#define ABUF (WARPS * 16 * 256)  // ASH: one A buffer (every warp's 16 rows x 128 k of bf16)
#ifndef WS
// WGMMA: warp-specialized stream. One more warp (the producer, warp WARPS) copies each 128-k step into a ring of
// DEPTH stages with the async proxy: the CTA's weight tiles (1 KB + 256 B each, contiguous in the mma16 copy) by
// cp.async.bulk, x's two 64-k halves of its XROWS rows by cp.async.bulk.tensor through a tensor map made on the
// host (the 128 B swizzle of the stages, rows past x zero-filled), all counted by the stage's `full` mbarrier;
// the WARPS consumer warps wait on it, multiply the step, and each gives the stage back on its `empty` mbarrier
// once its warpgroup's multiplies of the step are done. No CTA barrier, no per-thread copy instructions or
// address arithmetic in the consumers' loop, and the warpgroups run apart. The same multiplies in the same
// order as the WGMMA build: the same bits. Measured 8-16% slower than the WGMMA build on Qwen3-8B's shapes at 32
// rows on an H100 (bench/RESULTS.md, fifty-fifth session): an A/B build (gemv_cuda.WIDE_WS), not the default.
#define WS 0
#endif
#ifndef MINB
#define MINB 0  // the plain builds: CTAs per SM that ptxas must leave registers for (0: no bound; A/B)
#endif
#ifndef WS_MINB
// WS: CTAs per SM that ptxas must leave registers for (0: no bound). At 288 threads the unbounded build took 67-81
// registers, 2-3 CTAs per SM against the plain build's 4 (its 60 at 256 threads): 4 caps it at 56.
#define WS_MINB 0
#endif
#if WS && (WS != 1 || !(WGMMA && SWZ && XSTREAM && !ASH && !GROUPED && DEPTH >= 2))
#error "WS needs WGMMA, SWZ 1, XSTREAM, DEPTH >= 2, no ASH / GROUPED"
#endif
#ifndef KW
#define KW 1  // warps of a CTA that split one n-tile's K (in-CTA split-K; see the kernel's epilogue)
#endif
#if KW > 1 && (SPLIT > 1 || XSTREAM || WGMMA || (WARPS % KW))
#error "KW (in-CTA split-K) needs SPLIT 1, the staged x slice (no XSTREAM, no WGMMA) and KW dividing WARPS"
#endif
#if PRENORM && (SPLIT > 1 || XSTREAM || WGMMA || GROUPED || XG_ROW || SILU || WARPS != 8)
#error "PRENORM needs a dense W4A16 build that stages x whole (SPLIT 1, no XSTREAM, WGMMA, GROUPED, XG_ROW, SILU)"
#endif
#ifndef KTOP
#define KTOP 1  // PRENORM 2: the experts per token
#endif
#ifndef MW_F32
#define MW_F32 0
#endif
#if PRENORM == 2 && (KTOP < 1 || KTOP > 16)
#error "PRENORM 2 needs KTOP (the experts per token) in 1..16"
#endif
#define PN_ROWS (PRENORM == 2 ? KTOP : 1)  // rows of hr per row of x (PRENORM 2: the token's expert outputs)
#ifndef GSR
#define GSR 0  // KW > 1 with per-row global scales (WG_ROW): each thread's row scale read early too (below)
#endif
#if GSR && KW < 2
#error "GSR is for the in-CTA split (KW > 1)"
#endif
#if GSR
static_assert((WARPS * 32) % (WARPS / KW * NT * 16) == 0, "GSR: a thread's epilogue columns must be one");
#endif
#ifndef GSE
#define GSE (KW > 1)  // the weight's global scale read before griddepcontrol.wait, not in the epilogue (below)
#endif
#ifndef TIMING
#define TIMING 0  // timing-only variants (wrong results): 1 no x staging, 2 no unpack/MMA
#endif
#if WS && (GSE || TIMING)
#error "WS takes no GSE or TIMING"
#endif
// STAMP_BUF (diagnostics only, gemv_cuda.stamp_buffer; never in a normal build): thread 0 of every CTA records
// %globaltimer at its start, after griddepcontrol.wait, once x is staged, after its weight stream and before it
// leaves, and appends one record of 8 u64 to the buffer at STAMP_BUF (u64 [0] = records taken; gemv_cuda.stamps
// decodes them): where a decode GEMM's time goes inside the CUDA graph, PDL overlaps included. STAMP_AT moves
// the third stamp earlier, to split the time from the wait to x staged: 1 once a routed-experts CTA has found
// its expert (dense builds: right after the wait), 2 once x and the first weight steps are issued (before the
// cp.async wait; XSTREAM builds: where 0 stamps); 0 (default) once they have landed.
#ifndef STAMP_AT
#define STAMP_AT 0
#endif
#ifdef STAMP_BUF
#define STAMP(i)                                                                          \
    if (threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(stamp_t[i]) :: "memory")
#define STAMP_EXIT()                                                                      \
    do {                                                                                  \
        STAMP(4);                                                                         \
        if (threadIdx.x == 0) stamp_write(stamp_t, stamp_c0, N, K, M);                    \
    } while (0)
#else
#define STAMP(i)
#define STAMP_EXIT()
#endif
#define TW (WARPS / KW)  // warps per k range: TW x NT n-tiles per CTA
#define NB (TW * NT * 16)
#if GU_SILU && (WS || GSR || XG_ROW || GROUPED || PRENORM || SILU || (TW * NT) % 2 || (NB / 2) % SPLIT)
#error "GU_SILU needs a dense W4A16 build with an even number of n-tiles a CTA, SPLIT dividing NB / 2 (no WS, GSR, XG_ROW)"
#endif
#if (RN_OUT || RN_IN) && (SPLIT > 1 || XSTREAM || WGMMA || WS || XG_ROW || GROUPED || PRENORM || SILU)
#error "RN_OUT / RN_IN are for a dense W4A16 build that stages x whole (SPLIT 1; no XG_ROW, GROUPED, PRENORM or SILU)"
#endif
#if RN_OUT && KW < 2
#error "RN_OUT is for the in-CTA split (KW > 1)"
#endif
#if RN_OUT && (GU_SILU || RN_IN)
#error "RN_OUT writes x' and xt of a plain y: no GU_SILU or RN_IN with it"
#endif
#if RN_OUT
static_assert((WARPS * 32) % (WARPS / KW * NT * 16) == 0, "RN_OUT: a thread's epilogue columns must be one");
#endif
#ifndef GSU
#define GSU 0  // GU_SILU with per-row global scales (WG_ROW): each thread's gate / up row scales read early (below)
#endif
#if GSU && !(GU_SILU && SPLIT == 1 && !XSTREAM && !WGMMA)
#error "GSU is for GU_SILU builds with SPLIT 1 (the plain and in-CTA split epilogues)"
#endif
#if GSU && KW > 1
static_assert((WARPS * 32) % (NB / 2) == 0, "GSU: a thread's GU_SILU epilogue column must be one");
#endif
#if GU_SILU
// logical n-tile lt -> the weight's n-tile: the first half of a CTA's TW NT tiles are gate's, the second half
// the same rows' tiles of up (ntiles / 2 further)
#define PTILE(lt)                                                                                    \
    (((lt) % (TW * NT)) < (TW * NT) / 2                                                              \
         ? ((lt) / (TW * NT)) * ((TW * NT) / 2) + (lt) % (TW * NT)                                   \
         : (ntiles >> 1) + ((lt) / (TW * NT)) * ((TW * NT) / 2) + (lt) % (TW * NT) - (TW * NT) / 2)
#else
#define PTILE(lt) (lt)
#endif
#define XROWS (8 * MG)
#define STAGE_BYTES 1280  // one n-tile and step: 1 KB of weight words + 256 B of scales

__device__ __forceinline__ u32 smem_u32(const void* p);

// 16 bytes global -> shared, L2 only; src_bytes < 16 zero-fills the rest (0: no read at all)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
// an int the route wrote (the offsets, x_rows): read after griddepcontrol.wait. A const __restrict__ read
// compiles to ld.global.nc, which the compiler may move above the wait's asm: it did in a dry-prologue build
// (33d8ec2) and an L2-prefetch build (e14c14c). LDVOL: a volatile asm load keeps it after the wait; the default
// builds keep their SASS (tests/test_cuda_sources.py checks that their loads stay after the wait) until a
// device call shows LDVOL costs nothing.
__device__ __forceinline__ int ld_routing(const int* p) {
#if LDVOL
    int v;
    asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return *p;
#endif
}
#if RN_OUT || RN_IN
// what the previous kernels wrote (the residual, the tile sums): L2 loads kept after griddepcontrol.wait. The
// residual's bits stay a u16 until the epilogue: converted where it is read (as a float at the load), ptxas
// placed the conversion right after the staging barrier, and the warp waited there for the L2 round trip
// before its stream (SASS of the first build)
__device__ __forceinline__ u16 ld_u16_cg(const u16* p) {
    u16 v;
    asm volatile("ld.global.cg.b16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float bf16_bits_float(u16 v) { return __uint_as_float((u32)v << 16); }
__device__ __forceinline__ float ld_f32_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
#endif
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

__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

#if WGMMA
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// The compiler may not move an accumulator register while a wgmma that writes it is in flight (ptxas
// would serialize every wgmma: warning C7515); an empty asm that "redefines" each one pins them.
__device__ __forceinline__ void acc_fence(float* d) {
#pragma unroll
    for (int i = 0; i < NT * MG * 4; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// the accumulators zeroed and pinned there (not sunk into the path that skips the loop)
__device__ __forceinline__ void acc_zero(float* d) {
#pragma unroll
    for (int i = 0; i < NT * MG * 4; ++i) d[i] = 0.f;
    acc_fence(d);
}
// The shared-memory descriptor of 16-k block blk of a K-major tile of `rows` rows in the 128 B swizzle
// ([k half][row][128 B], 1024 B aligned): the block's 32 B of each row at (blk % 4) * 32 in k half blk / 4;
// SBO 1024 B (8 rows)
__device__ __forceinline__ unsigned long long swz_desc(u32 tile, int blk, int rows) {
    return (unsigned long long)(((tile + (blk >> 2) * (rows * 128) + (blk & 3) * 32) >> 4) & 0x3FFF)
           | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// wgmma_m64k16(float* d, a0..a3, desc): m64n(8 MG)k16, generated by gemv_cuda.source (the operand count
// depends on MG); d: 4 MG fp32 per thread, the same fragment order as MG m16n8 accumulators
#endif
#if WS
// the CUtensorMap of x (128 opaque bytes, 64-byte aligned), passed by value (tensor_map.x_tensor_map)
struct __align__(64) TMap {
    u64 v[16];
};
#define WS_ARGS , const __grid_constant__ TMap tmap
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// one arrival that also expects `bytes` more of the async copies counted on the barrier
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// until the phase of this parity has completed (acquire: the copies it counted are visible)
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// `bytes` contiguous bytes global -> shared by the bulk copy engine, counted on `bar`
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// the tensor map's box at (c0, c1) (k, row) -> shared memory, counted on `bar`
__device__ __forceinline__ void tma_2d(u32 dst, const void* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];" :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
#else
#define WS_ARGS
#endif

// The 4 bf16 pairs (e2m1 * 2^-126) of one gemv32-ordered word: pairs 0-2 are the word masked
// after a shift of 0, 3, 6; pair 3 gathers its bits from three places.
__device__ __forceinline__ void unpack(u32 w, u32& p0, u32& p1, u32& p2, u32& p3) {
    const u32 M = 0x81C081C0u;
    p0 = w & M;
    p1 = (w << 3) & M;
    p2 = (w << 6) & M;
    p3 = ((w >> 4) & 0x00C000C0u) | ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u);
}

// bf16 scale pair (lo: row g, hi: row g+8) -> each duplicated in both halves (ptxas folds the moves
// into the multiply's operand selector .H0_H0 / .H1_H1: no instruction).
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

// One word (16 rows x 16 k of weights): unpack, 4 scale multiplies, one MMA per 8 rows of x.
__device__ __forceinline__ void word_mma(float (*acc)[4], u32 w, u32 s, const u32 (*b)[2]) {
    u32 a0, a1, a2, a3;
    unpack(w, a0, a1, a2, a3);
    const u32 sg = dup_lo(s), sg8 = dup_hi(s);
    a0 = mul_bf16x2(a0, sg);
    a1 = mul_bf16x2(a1, sg8);
    a2 = mul_bf16x2(a2, sg);
    a3 = mul_bf16x2(a3, sg8);
#pragma unroll
    for (int mg = 0; mg < MG; ++mg) mma(acc[mg], a0, a1, a2, a3, b[mg][0], b[mg][1]);
}

__device__ __forceinline__ u32 word_of(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}
// one n-tile's step from its stage (1 KB of weight words, then 256 B of scales): the lane's 2 x 16 B of words and
// its group's (g4 = lane / 4) 32 B of scales
__device__ __forceinline__ void load_tile(const unsigned char* b, int lane, int g4, uint4 (&wv)[2],
                                          uint4 (&sv)[2]) {
    wv[0] = *reinterpret_cast<const uint4*>(b + lane * 16);
    wv[1] = *reinterpret_cast<const uint4*>(b + 512 + lane * 16);
    sv[0] = *reinterpret_cast<const uint4*>(b + 1024 + g4 * 32);
    sv[1] = *reinterpret_cast<const uint4*>(b + 1024 + g4 * 32 + 16);
}
#if WGMMA
// wgmma's register A of 16-k block blk of a loaded tile: the block's word unpacked, times the rows' block scales
// (zeros for a tile past N in the plain build: issue_w zero-fills it)
__device__ __forceinline__ void scaled_a(const uint4 (&wv)[2], const uint4 (&sv)[2], int blk, u32 (&a)[4]) {
    const u32 w = word_of(wv[blk >> 2], blk & 3);
    const u32 sw = word_of(sv[blk >> 2], blk & 3);
    unpack(w, a[0], a[1], a[2], a[3]);
    const u32 sg = dup_lo(sw), sg8 = dup_hi(sw);
    a[0] = mul_bf16x2(a[0], sg);
    a[1] = mul_bf16x2(a[1], sg8);
    a[2] = mul_bf16x2(a[2], sg);
    a[3] = mul_bf16x2(a[3], sg8);
}
#endif

__device__ __forceinline__ u32 f2_to_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u16 to_bf16(float v) { return (u16)(f2_to_bf16x2(v, 0.f) & 0xFFFFu); }
// v rounded to bfloat16, as a float (exact)
__device__ __forceinline__ float bf16_float(float v) { return __uint_as_float((u32)to_bf16(v) << 16); }

#if SILU || GU_SILU
// g / d correctly rounded (= __fdiv_rn(g, d), IEEE) for d = 1 + expf(-g) >= 1, without div.rn's slow-path
// branch (FCHK + call: it serializes the 8 divisions of a chunk). The fast path of div.rn's SASS, verbatim
// (MUFU.RCP, then r1 = r + r (1 - d r), q0 = g r1, q = q0 + r1 (g - d q0)), is correctly rounded wherever
// FCHK lets it through; the inputs it would not: d >= 2^64 (g < -44): g and d are both scaled by 2^-64 first
// (exact, the quotient unchanged); d = inf (g < -88.7): g * 0 (+-0, NaN for g = -inf); d = 1 (g > 16.6): g
// (also g = inf); tiny g (a subnormal quotient): d = 2 exactly and every step is exact. The sign of g: a
// zero quotient's sign. Checked against div.rn on every bf16 g on the GPU (tests/test_gemv_cuda.py).
__device__ __forceinline__ float silu_div(float g, float d) {
    const float sc = d >= 0x1p64f ? 0x1p-64f : 1.f;
    const float gs = __fmul_rn(g, sc), ds = __fmul_rn(d, sc);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(ds));
    const float r1 = __fmaf_rn(r, __fmaf_rn(-ds, r, 1.f), r);
    const float q0 = __fmaf_rn(gs, r1, 0.f);
    float q = __fmaf_rn(r1, __fmaf_rn(-ds, q0, gs), q0);
    q = d == 1.f ? g : q;
    q = isinf(d) ? __fmul_rn(g, 0.f) : q;
    return copysignf(q, g);
}
// fused.silu_mul's arithmetic on one element (float32 inside, each rounding explicit so that nothing is
// contracted or reassociated): s = bf16(g / (1 + expf(-g))), a = bf16(s * u). expf is libdevice's accurate
// __nv_expf (NVRTC without -use_fast_math, as gemv_cuda compiles), the division IEEE (silu_div).
__device__ __forceinline__ float silu_up1(float g, float u) {
    const float s = bf16_float(silu_div(g, __fadd_rn(1.f, expf(-g))));
    return __fmul_rn(s, u);
}
// 8 bf16 of gate and of up (16 B each) -> the 8 bf16 of a, in place (element 2i in the low half of word i)
__device__ __forceinline__ uint4 silu_up8(const uint4& g, const uint4& u) {
    uint4 a;
    u32* pa = &a.x;
    const u32* pg = &g.x;
    const u32* pu = &u.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float lo = silu_up1(__uint_as_float(pg[i] << 16), __uint_as_float(pu[i] << 16));
        const float hi = silu_up1(__uint_as_float(pg[i] & 0xFFFF0000u), __uint_as_float(pu[i] & 0xFFFF0000u));
        pa[i] = f2_to_bf16x2(lo, hi);
    }
    return a;
}
#endif

#ifdef STAMP_BUF
#define STAMP_SLOTS 524288  // fp4rl.benchmarks.stamps.SLOTS
__device__ __noinline__ void stamp_write(const u64* t, long long c0, int N, int K, int M) {
    u64* buf = reinterpret_cast<u64*>(STAMP_BUF);
    const u64 slot = atomicAdd(buf, 1ull);
    if (slot >= STAMP_SLOTS) return;
    u32 smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    u64* r = buf + 8 + slot * 8;
    for (int i = 0; i < 5; ++i) r[i] = t[i];
    r[5] = (u64)(u32)N | ((u64)(u32)K << 32);
    r[6] = (u64)blockIdx.x | ((u64)blockIdx.y << 16) | ((u64)blockIdx.z << 32) | ((u64)smid << 48);
    r[7] = (u64)(u32)M | ((u64)GROUPED << 16) | ((u64)SPLIT << 20) | ((u64)KW << 24)
           | ((u64)(u32)(clock64() - c0) << 32);
}
#endif

#if WS && WS_MINB
#define LAUNCH_BOUNDS __launch_bounds__((WARPS + WS) * 32, WS_MINB)
#elif !WS && MINB
#define LAUNCH_BOUNDS __launch_bounds__(WARPS * 32, MINB)
#else
#define LAUNCH_BOUNDS __launch_bounds__((WARPS + WS) * 32)
#endif
extern "C" __global__ void LAUNCH_BOUNDS CLUSTER
w4a16_mma16(const u16* __restrict__ x, const uint4* __restrict__ wt, const uint4* __restrict__ st,
            const float* __restrict__ wg, const float* __restrict__ xg, u16* __restrict__ y, int M, int N,
            int K, int stride_xm, int stride_ym, const int* __restrict__ offs, int E,
            const int* __restrict__ xrows PN_ARGS RN_ARGS WS_ARGS) {
    extern __shared__ __align__(16) unsigned char smem[];
#ifdef STAMP_BUF
    u64 stamp_t[5] = {0, 0, 0, 0, 0};
    const long long stamp_c0 = clock64();
#endif
    STAMP(0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = K >> 7;                    // 128-k steps
    const int per = (S + SPLIT - 1) / SPLIT;  // steps per split
    const int s0 = blockIdx.y * per;
    const int s1 = min(S, s0 + per);
    const int ntiles = N >> 4;
    const int tile0 = (blockIdx.x * TW + warp % TW) * NT;
    // this warp's steps: the CTA's range, or (KW) its KW-th part, split as SPLIT = KW CTAs would split K
    const int wper = (s1 - s0 + KW - 1) / KW;
    const int ws0 = KW > 1 ? s0 + (warp / TW) * wper : s0;
    const int ws1 = KW > 1 ? min(s1, ws0 + wper) : s1;
#if WGMMA
    const int XS = 128;  // unused: x stages hold core matrices (see issue_x)
#elif XSTREAM
    const int XS = 136;  // x comes in 128-k chunks through a CTA ring (16 B pad: conflict-free ldmatrix)
#else
    const int XS = per * 128 + 8;  // smem row stride of x in bf16 (16 B pad: conflict-free ldmatrix)
#endif
    // PDL (a no-op without the launch attribute): the next kernel may be scheduled once every CTA of this
    // grid has triggered (TRIGGER 1: at its start; 3: once past griddepcontrol.wait; 2: after its weight
    // stream; 0: at its exit); it waits
    // for this grid's completion before reading what it writes
    if (TRIGGER == 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#if GROUPED
    // Routed experts: x's rows are sorted by expert, offs[E + 1] the expert starts (written by the kernels
    // before this one: wait first). Slot blockIdx.z serves one chunk of up to XROWS rows of one expert
    // (any number of rows per expert: more chunks); slots past the last chunk exit. wt / st / wg are stacks
    // over experts ([E][N/16]... tiles; wg [E][N] or [E]).
    // (An EARLY build that read the offsets and issued the first weight steps before this wait was measured
    // and removed: unsound behind a route whose writes land late, and slower; bench/RESULTS.md, thirty-fifth
    // session.)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    STAMP(1);
    if (TRIGGER == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // slot z -> (expert, chunk of 8 MG rows): expert i owns ceil(rows_i / XROWS) consecutive slots
    // warp-uniform: every warp finds the same expert. The offsets of the first 32 SLOTTABLE experts are loaded
    // at once, before any is used: one L2 round trip for the search (SLOTTABLE 0: one per 32 experts); lane l
    // looks at experts b + l, 32 at a time, and eo0 / eo1 = offs[ex] / offs[ex + 1] come from the lane that
    // read them (no trip more for offs[ex])
    int ex = -1, chunk = 0, eo0 = 0, eo1 = 0, seen = 0;
    auto find = [&](int b, int a0, int a1) {  // experts b .. b + 31, lane l's offsets a0 / a1
        const int nch = (a1 - a0 + XROWS - 1) / XROWS;  // 0 past E (a0 = a1 = 0)
        int inc = nch;  // inclusive prefix sum of the slots over the lanes
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += t;
        }
        const int total = __shfl_sync(0xffffffffu, inc, 31);
        if ((int)blockIdx.z < seen + total) {
            const int z = (int)blockIdx.z - seen;
            const u32 hit = __ballot_sync(0xffffffffu, z >= inc - nch && z < inc);
            const int src = __ffs(hit) - 1;
            ex = b + src;
            chunk = z - __shfl_sync(0xffffffffu, inc - nch, src);
            eo0 = __shfl_sync(0xffffffffu, a0, src);
            eo1 = __shfl_sync(0xffffffffu, a1, src);
        } else {
            seen += total;
        }
    };
#if SLOTTABLE
    {
        int t0[SLOTTABLE], t1[SLOTTABLE];
#pragma unroll
        for (int q = 0; q < SLOTTABLE; ++q) {
            const int i = 32 * q + lane;
            t0[q] = i < E ? ld_routing(offs + i) : 0;
            t1[q] = i < E ? ld_routing(offs + i + 1) : 0;
        }
#pragma unroll
        for (int q = 0; q < SLOTTABLE; ++q)
            if (ex < 0 && 32 * q < E) find(32 * q, t0[q], t1[q]);
    }
#endif
    for (int b = 32 * SLOTTABLE; ex < 0 && b < E; b += 32) {
        const int i = b + lane;
        find(b, i < E ? ld_routing(offs + i) : 0, i < E ? ld_routing(offs + i + 1) : 0);
    }
    if (ex < 0) return;  // the whole cluster (same z) leaves before any barrier
#if STAMP_AT == 1
    STAMP(2);
#endif
    {
        const int r0 = eo0 + chunk * XROWS;
        M = min(XROWS, eo1 - r0);
        if (GATHER) xrows += r0;  // row m of this chunk is token xrows[m]
        else x += (u64)r0 * stride_xm;
        y += (u64)r0 * stride_ym;
        wt += (u64)ex * (u64)(N >> 4) * S * 64;
        st += (u64)ex * (u64)(N >> 4) * S * 16;
        wg += WG_ROW ? (u64)ex * N : (u64)ex;
        if (XG_ROW) xg += r0;
    }
#else
    {  // row block blockIdx.z of XROWS rows (launches with more rows than one configuration covers: WGMMA)
        const int r0 = blockIdx.z * XROWS;
        M = min(XROWS, M - r0);
        x += (u64)r0 * stride_xm;
        y += (u64)r0 * stride_ym;
        if (XG_ROW) xg += r0;
    }
#endif

    // shared memory: x's K slice [XR + 1][XS] bf16 (rows < M, then one zero row that the B fragments
    // of rows >= M read), then one ring per warp of DEPTH stages x NT x (1 KB of weight words + 256 B
    // of scales)
    const int XR = min(M, XROWS);
#if WGMMA
    // x stages 1024-byte aligned (the 128 B swizzle repeats every 1024 B of the address; smem_bytes adds 1 KB)
    u16* xs = reinterpret_cast<u16*>(smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u));
#else
    u16* xs = reinterpret_cast<u16*>(smem);
#endif
    // bytes of one x stage (XSTREAM) or of the whole slice; WGMMA: all 8 MG rows of a 128-k step as core
    // matrices (8 rows x 16 B): block kb (k 16 kb..), row group ng, half kh at kb * MG * 256 + ng * 256 + kh * 128
    const int XSTAGE = WGMMA ? XROWS * 256 : (XR + 1) * XS * 2;
#if PRENORM
    // PRENORM: then hr's rows [XR PN_ROWS][XS] (x' is formed in x's) and the norm weight [K]
    // (gemv_cuda.smem_bytes)
    u16* hs = xs + (XR + 1) * XS;
    u16* nsm = hs + XR * PN_ROWS * XS;
    const int PN_BYTES = XR * PN_ROWS * XS * 2 + K * 2;
#if PRENORM == 2
    __shared__ int pn_pos[XROWS * KTOP];  // the rows' expert positions (d's sorted rows) and weights
    __shared__ float pn_w[XROWS * KTOP];
#endif
#else
    const int PN_BYTES = 0;
#endif
#if RN_IN == 2
    // RN_IN 2: the rows' tile sums [XR][K / 16] fp32 after x (and PN's) in shared memory, copied with x
    float* rn_sm = reinterpret_cast<float*>(xs + (XR + 1) * XS);
    const int RN_BYTES = XR * (K >> 4) * 4;
#else
    const int RN_BYTES = 0;
#endif
#if !WS
    unsigned char* ring = reinterpret_cast<unsigned char*>(xs)
                          + (((XSTREAM ? DEPTH : 1) * XSTAGE + PN_BYTES + RN_BYTES + (ASH ? 2 * ABUF : 0) + 127)
                             & ~127)
                          + warp * (DEPTH * NT * STAGE_BYTES);
    const u32 ring_s = smem_u32(ring);

    // 1. the weight stream: per n-tile and step each lane copies its 2 x 16 B of weight words, lanes
    // 0-15 one 16 B chunk of the 256 B of scales; one commit group per step, DEPTH steps ahead
    const uint4* wp[NT];
    const uint4* sp[NT];
    bool ok[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        ok[j] = tile0 + j < ntiles;
        const u64 tile = ok[j] ? (u64)PTILE(tile0 + j) : 0;
        wp[j] = wt + (tile * S) * 64 + lane;
        sp[j] = st + (tile * S) * 16 + (lane & 15);
    }
#if XPRE
    // XPRE: running source pointers, one step further each call (the calls come in step order from ws0):
    // without them ptxas rebuilt every pointer from the block index in each step
    const uint4* wrun[NT];
    const uint4* srun[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) wrun[j] = wp[j] + (u64)ws0 * 64, srun[j] = sp[j] + (u64)ws0 * 16;
#endif
    auto issue_w = [&](int step, int stage) {
        if (step < ws1) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if (ok[j] || WGMMA) {  // WGMMA: a tile past N reads zeros (the warp still joins the multiply)
                    const u32 dst = ring_s + (stage * NT + j) * STAGE_BYTES;
                    const int nb = ok[j] ? 16 : 0;
#if XPRE
                    cp_async16(dst + lane * 16, wrun[j], nb);
                    cp_async16(dst + 512 + lane * 16, wrun[j] + 32, nb);
                    if (lane < 16) cp_async16(dst + 1024 + lane * 16, srun[j], nb);
#else
                    cp_async16(dst + lane * 16, wp[j] + (u64)step * 64, nb);
                    cp_async16(dst + 512 + lane * 16, wp[j] + (u64)step * 64 + 32, nb);
                    if (lane < 16) cp_async16(dst + 1024 + lane * 16, sp[j] + (u64)step * 16, nb);
#endif
                }
            }
        }
#if XPRE
#pragma unroll
        for (int j = 0; j < NT; ++j) wrun[j] += 64, srun[j] += 16;
#endif
    };
#if !XSTREAM
    auto issue = [&](int step, int stage) {
        issue_w(step, stage);
        cp_async_commit();  // possibly empty: one group per step keeps the count uniform
    };
#else
    // XSTREAM: the 128-k chunk of x for `step` (its rows, then the zero row) into x stage `stage`, by all
    // threads of the CTA (the chunk is read by every warp: a CTA barrier per step orders it)
#if XPRE == 2
    // XPRE 2 (WGMMA, SWZ): chunk c = tid + 32 WARPS i of a stage is row (tid >> 4) + XRI i, 16-byte column
    // tid & 15, so a thread's chunks share their column and their swizzle (row % 8) and lie XRI rows (16 at
    // 8 warps: 2 KB of the stage) apart: one running source pointer and one offset per thread. Rows past M read a row < M instead of zeros
    // (the thread's last row < M, or row M - 1 if it has none): x^T's column m of the product only reaches
    // output row m, and rows >= M are never stored or reduced (no registers per chunk, no per-chunk predicate
    // on the bytes).
    constexpr int XC = (XROWS * 16 + WARPS * 32 - 1) / (WARPS * 32);  // chunks per thread and stage
    constexpr int XRL = WARPS == 8 ? 4 : 3, XRI = 1 << XRL;  // rows between a thread's chunks (2 WARPS)
    const int xr0 = threadIdx.x >> 4, xq = threadIdx.x & 15;
    const bool xlast = xr0 + XRI * (XC - 1) < XROWS;  // the thread's last chunk is in the stage (MG odd: half)
    const int xnv = M > xr0 ? (M - xr0 + XRI - 1) >> XRL : 0;  // its chunks of rows < M
    const u16* xsrc = x + (u64)min(xr0, M - 1) * stride_xm + xq * 8 + (u64)s0 * 128;  // running (from s0)
    const u64 xrow16 = (u64)XRI * stride_xm;
    const u32 xdst = smem_u32(xs) + (xq >> 3) * (XROWS * 128) + xr0 * 128 + (((xq & 7) ^ (xr0 & 7)) << 4);
    auto issue_x = [&](int step, int stage) {
        if (!(TIMING & 1) && step < s1) {  // past the range: nothing (those stages are never multiplied)
            const u16* p = xsrc;
#pragma unroll
            for (int i = 0; i < XC; ++i) {
                if (i < XC - 1 || xlast) cp_async16(xdst + stage * XSTAGE + i * (XRI * 128), p, 16);
                if (i + 1 < xnv) p += xrow16;
            }
        }
        xsrc += 128;
    };
#elif XPRE
    // XPRE (WGMMA): each thread's chunks of a stage (source row and column, swizzled offset) computed once
    // here; a step adds its 128 k to the source and its stage to the offset. The per-step address arithmetic
    // of the loop below was ~a fifth of the 32-row kernel's instructions (ncu: issue slots 65% busy).
    constexpr int XC = (XROWS * 16 + WARPS * 32 - 1) / (WARPS * 32);  // chunks per thread and stage
    const u16* xsrc[XC];
    u32 xoff[XC];
    bool xin[XC], xon[XC];
#pragma unroll
    for (int i = 0; i < XC; ++i) {
        const int c = threadIdx.x + i * WARPS * 32;
        const int m = c >> 4, q = c & 15;
        xon[i] = !(TIMING & 1) && c < XROWS * 16;
        xin[i] = xon[i] && m < M;
        xsrc[i] = xin[i] ? x + (u64)m * stride_xm + q * 8 : x;
        xoff[i] = (q >> 3) * (XROWS * 128) + m * 128 + (((q & 7) ^ (m & 7)) << 4);
    }
#pragma unroll
    for (int i = 0; i < XC; ++i) xsrc[i] += (u64)s0 * 128;  // running: one step further each call (from s0)
    auto issue_x = [&](int step, int stage) {
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            if (xon[i]) {
                const bool in = xin[i] && step < s1;
                cp_async16(smem_u32(xs) + stage * XSTAGE + xoff[i], in ? xsrc[i] : x, in ? 16 : 0);
            }
            xsrc[i] += 128;
        }
    };
#else
    auto issue_x = [&](int step, int stage) {
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (WGMMA ? XROWS : XR + 1) * 16); c += WARPS * 32) {
#if WGMMA && !SWZ
            // chunk c -> (row m, 16-byte chunk q): a warp takes 8 rows x 4 chunks, so that it reads 64 B runs
            // of 8 rows and writes 4 whole 128 B lines (conflict-free)
            const int m = ((c >> 7) << 3) | (c & 7), q = (((c >> 5) & 3) << 2) | ((c >> 3) & 3);
#else
            const int m = c >> 4, q = c & 15;  // a warp: 2 rows x 16 chunks of 16 B
#endif
            const int kc = q * 8;
            const bool in = m < M && step < s1;
            const u16* src = in ? x + (u64)XROW(m) * stride_xm + (u64)step * 128 + kc : x;
#if WGMMA && SWZ
            // 128-byte swizzle, K-major: [k half (64 k)][row][128 B], 16 B chunk (q % 8) ^ (row % 8)
            const u32 off = (q >> 3) * (XROWS * 128) + m * 128 + (((q & 7) ^ (m & 7)) << 4);
#elif WGMMA
            const u32 off = (q >> 1) * (MG * 256) + (m >> 3) * 256 + (q & 1) * 128 + (m & 7) * 16;
#else
            const u32 off = (m * XS + kc) * 2;
#endif
            cp_async16(smem_u32(xs) + stage * XSTAGE + off, src, in ? 16 : 0);
        }
    };
#endif  // XPRE
#endif
#if XSTREAM
    // group 0 = weight steps 0 .. DEPTH-2 + x step 0, group d = x step d: the group of step i is the i-th
    // (ASH: the weight steps a group of their own, then x steps 0 .. DEPTH-3 one group each, so that weight
    // step i is always in a group older than x step i's: the loop waits for one, unpacks, then the other)
#pragma unroll
    for (int d = 0; d < DEPTH - 1; ++d) issue_w(ws0 + d, d);
    if (ASH) cp_async_commit();
#else
#if PRENORM
    // the norm weight (read-only during a decode step) before the wait: in the first weight step's group
    for (int c = threadIdx.x; c < K / 8; c += WARPS * 32) cp_async16(smem_u32(nsm + 8 * c), nw + 8 * c, 16);
#endif
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) issue(ws0 + d, d);
#endif

    // GSE (default: the KW builds, one row): the weight's global scale read now rather than in the epilogue
    // (6% of the one-row q/k/v call's stall samples were there, an L2 round trip on the critical path;
    // nothing on the stream writes it). Not for the other builds: the register held through the stream cost
    // 2 (MG 2: 64 -> 66, a CTA per SM less).
    const float gs_early = (WG_ROW || !GSE) ? 0.f : wg[0] * 256.f;
#if GSR && WG_ROW
    // GSR (gemv_cuda.ROW_SCALE_EARLY): per-row global scales (fused q/k/v, the experts' gate / up). In the KW
    // epilogue below thread t only ever writes columns nl = t % NB (NB divides the 256 threads), so
    // its one row scale is read now, off the epilogue's critical path; the same multiply, the same bits
    const int gsr_n = blockIdx.x * NB + (int)threadIdx.x % NB;
    const float gsr_early = gsr_n < N ? wg[gsr_n] * 256.f : 0.f;
#endif
#if GSU && WG_ROW && KW > 1
    // GSU (gemv_cuda.GU_SILU_EARLY): thread t finishes logical column t % (NB / 2) in the in-CTA split's GU_SILU
    // epilogue below: its gate row's and up row's scales read now (nothing writes them in a step), not after the
    // stream (an L2 round trip on the CTA's tail, after its last MMA, in the SASS). The same multiplies
    const int gsu_n = blockIdx.x * (NB / 2) + (int)threadIdx.x % (NB / 2);
    const float gsu_g = wg[gsu_n] * 256.f, gsu_u = wg[(N >> 1) + gsu_n] * 256.f;
#elif GSU && WG_ROW
    // GSU, SPLIT 1: the lane's 2 NT weight rows of the GU_SILU epilogue (PTILE(tile0 + j) * 16 + g + 8 hh)
    float gsu_r[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            gsu_r[j][hh] = ok[j] ? wg[PTILE(tile0 + j) * 16 + (lane >> 2) + 8 * hh] * 256.f : 0.f;
#endif
#if RN_OUT
    // RN_OUT: the next norm's weight at the one column thread t finishes in the epilogue (nl = t % NB: NB
    // divides the 256 threads; gemv_cuda.launch checks N % NB == 0), read-only during a step: before the wait
    const float rn_w_early = __uint_as_float((u32)rn_w[blockIdx.x * NB + (int)threadIdx.x % NB] << 16);
#endif
    // PDL: the first DEPTH weight steps above do not depend on the previous kernel; x (its output) does
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if !GROUPED
    STAMP(1);
    if (TRIGGER == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if !GROUPED && STAMP_AT == 1
    STAMP(2);
#endif
#if XSTREAM
    // (ASH: x one step less ahead; after the weights' group, group d + 1 = x step d)
#pragma unroll
    for (int d = 0; d < DEPTH - 1 - ASH; ++d) {
        issue_x(s0 + d, d);
        cp_async_commit();
    }
#else
    // 2. x[:, 128 s0 : 128 s1] -> shared memory (rows >= M and k beyond the range zero-filled), async
    {
        const int cw = per * 16;  // 16-byte chunks per row
        const int kbase = s0 * 128, kend = s1 * 128;
#if SILU
        // through registers: 16 B of gate and 16 B of up per chunk -> 16 B of a = bf16(bf16(silu(g)) * u)
        // stored where cp.async would have put x's chunk. Rows >= M and k past the range: zeros, no read.
        // Every n-block's CTA computes its rows' a again (N / 128 times in all): cheap for a few rows, not for
        // full 8-row chunks (gemm.MMA16_SILU_MAX_TOKENS). One chunk at a time per thread: loading 2 or 4
        // before their math measured slower on the H200 (more registers, fewer CTAs per SM).
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (XR + 1) * cw); c += WARPS * 32) {
            const int m = c / cw, kc = (c - m * cw) * 8;
            uint4 a = make_uint4(0u, 0u, 0u, 0u);
            if (m < M && kbase + kc < kend) {
                const uint4* src = reinterpret_cast<const uint4*>(x + (u64)XROW(m) * stride_xm + kbase + kc);
                const uint4 gv = __ldcg(src);  // L2 only, as cp.async.cg: written by the previous kernel
                const uint4 uv = __ldcg(src + (K >> 3));  // up: K columns further
                a = silu_up8(gv, uv);
            }
            *reinterpret_cast<uint4*>(xs + m * XS + kc) = a;
        }
#elif PRENORM == 2
        (void)kbase, (void)kend;  // (the whole K: 0 and K)
        // the residual's rows to x's place; the route's pos and weights of the rows' KTOP experts to shared
        // memory (loads from L2: the route wrote them; this SM's L1 may hold an earlier layer's), then each
        // row's KTOP expert outputs (cp.async gathers of d's sorted rows). The norm below
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (XR + 1) * cw); c += WARPS * 32) {
            const int m = c / cw, kc = (c - m * cw) * 8;
            const bool in = m < M;
            cp_async16(smem_u32(xs + m * XS + kc), in ? x + (u64)m * stride_xm + kc : x, in ? 16 : 0);
        }
        for (int q = threadIdx.x; q < XR * KTOP; q += WARPS * 32) {
            const int t = q / KTOP, j = q - t * KTOP;
            int pv;
            asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(pv) : "l"(mpos + q) : "memory");
            pn_pos[q] = pv;
#if MW_F32
            u32 wv;
            asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(wv) : "l"((const float*)mw + (u64)t * stride_mw + j)
                         : "memory");
            pn_w[q] = __uint_as_float(wv);
#else
            u16 wv;
            asm volatile("ld.global.cg.b16 %0, [%1];" : "=h"(wv) : "l"((const u16*)mw + (u64)t * stride_mw + j)
                         : "memory");
            pn_w[q] = __uint_as_float((u32)wv << 16);
#endif
        }
        __syncthreads();
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : XR * KTOP * cw); c += WARPS * 32) {
            const int r = c / cw, kc = (c - r * cw) * 8;
            cp_async16(smem_u32(hs + r * XS + kc), hr + (u64)pn_pos[r] * stride_h + kc, 16);
        }
#elif PRENORM
        (void)kbase, (void)kend;
        // the residual's rows to x's place, hr's to theirs (the whole K: kbase 0, kend K); the norm below
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (XR + 1) * cw); c += WARPS * 32) {
            const int m = c / cw, kc = (c - m * cw) * 8;
            const bool in = m < M;
            cp_async16(smem_u32(xs + m * XS + kc), in ? x + (u64)m * stride_xm + kc : x, in ? 16 : 0);
            if (in) cp_async16(smem_u32(hs + m * XS + kc), hr + (u64)m * stride_h + kc, 16);
        }
#else
        for (int c = threadIdx.x; c < ((TIMING & 1) ? 0 : (XR + 1) * cw); c += WARPS * 32) {
            const int m = c / cw, kc = (c - m * cw) * 8;
            const bool in = m < M && kbase + kc < kend;
            const u16* src = in ? x + (u64)XROW(m) * stride_xm + kbase + kc : x;
            cp_async16(smem_u32(xs + m * XS + kc), src, in ? 16 : 0);
        }
#if RN_IN == 2
        // the rows' tile sums (contiguous [M, K / 16] fp32) in the same group as x
        for (int c = threadIdx.x; c < XR * (K >> 6); c += WARPS * 32) cp_async16(smem_u32(rn_sm + 4 * c), rn_ss + 4 * c, 16);
#endif
#endif
        cp_async_commit();
    }

#if RN_OUT
    // the residual element thread t adds in the epilogue (row t / NB, its column), read while x lands; the
    // elements past the first 256 (more than 256 / NB rows) are read there
    const u16 rn_r_early = (int)threadIdx.x < XR * NB
        ? ld_u16_cg(rn_res + (u64)(threadIdx.x / NB) * rn_stride_r + blockIdx.x * NB + threadIdx.x % NB) : 0;
#endif
#if RN_IN
    __shared__ float rn_rstd[XROWS];
#endif
#if RN_IN == 1
    // rstd of each row from the producer's K / 16 tile sums: one warp a row, lane l adding sums l + 32 i in
    // ascending i (loaded 8 at a time before their adds), the warp's xor butterfly, IEEE sqrt and division;
    // its loads are in flight with x's, its result waits in shared memory for the epilogue (RN_IN 2: the sums
    // come with x into shared memory and rstd is made after the stream, below)
    for (int m = warp; m < XR; m += WARPS) {
        const int np = K >> 4;
        float sum = 0.f;
        for (int c0 = 0; c0 < np; c0 += 256) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int c = c0 + lane + 32 * i;
                v[i] = c < np ? ld_f32_cg(rn_ss + (u64)m * np + c) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) sum = __fadd_rn(sum, v[i]);
        }
        sum = pn_warp_sum(sum);
        if (lane == 0)
            rn_rstd[m] = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fmul_rn(sum, __int_as_float(rn_inv_bits)),
                                                             __int_as_float(rn_eps_bits))));
    }
#endif
    // x and the first weight steps have landed for this thread, then for every thread. (Staging x by plain
    // loads so that this wait excludes the weight steps was slower: bench/RESULTS.md, seventeenth session.)
#if STAMP_AT == 2
    STAMP(2);
#endif
    cp_async_wait<0>();
    __syncthreads();
#if PRENORM
    {
        // x' = bf16(x + hr) in x's place and each row's sum of squares in fp4rl.kernels.prenorm's order (lane:
        // its chunks 8 (lane + 32 i), i = warp, warp + 8, .. ascending; the warp's xor butterfly; the warps' sums
        // in warp order), then y = bf16(w * bf16(x' * rstd)) in place; CTA 0 writes x'
        __shared__ float pn_part[XROWS][WARPS];
        const int nch = (K + 255) >> 8;
        for (int t = 0; t < XR; ++t) {
            float ss = 0.f;
            for (int i = warp; i < nch; i += WARPS) {
                const int kc = 8 * (lane + 32 * i);
                if (kc < K) {
                    uint4* px = reinterpret_cast<uint4*>(xs + t * XS + kc);
#if PRENORM == 2
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int j = 0; j < KTOP; ++j)
                        pn_wsum8(acc, *reinterpret_cast<const uint4*>(hs + (t * KTOP + j) * XS + kc),
                                 pn_w[t * KTOP + j]);
                    const uint4 v = pn_add8(*px, pn_round8(acc));
#else
                    const uint4 v = pn_add8(*px, *reinterpret_cast<const uint4*>(hs + t * XS + kc));
#endif
                    *px = v;
                    ss = pn_sq8(ss, v);
                }
            }
            ss = pn_warp_sum(ss);
            if (lane == 0) pn_part[t][warp] = ss;
        }
        __syncthreads();
        for (int t = 0; t < XR; ++t) {
            const float rstd = pn_rstd(pn_part[t], inv_h_bits, eps_bits);
            for (int i = warp; i < nch; i += WARPS) {
                const int kc = 8 * (lane + 32 * i);
                if (kc < K) {
                    uint4* px = reinterpret_cast<uint4*>(xs + t * XS + kc);
                    const uint4 v = *px;
                    *px = pn_norm8(v, *reinterpret_cast<const uint4*>(nsm + kc), rstd);
                    if (blockIdx.x == 0) pn_st16(xo + (u64)t * K + kc, v);
                }
            }
        }
        __syncthreads();
    }
#endif
#endif
#if STAMP_AT == 0 || (STAMP_AT == 2 && XSTREAM)
    STAMP(2);
#endif

    // ldmatrix.x4 row addresses: matrix j = x rows 8 mg + (lane & 7) (the zero row past M) x k [8j, 8j+8):
    // b0, b1 of the block at k, b0, b1 of the block at k + 16
#if !WGMMA
    u32 xa[MG];
#pragma unroll
    for (int mg = 0; mg < MG; ++mg)
        xa[mg] = smem_u32(xs + min(8 * mg + (lane & 7), XR) * XS + (lane >> 3) * 8);
#endif

#if WGMMA
    float acc[NT][MG][4];
    acc_zero(&acc[0][0][0]);
#else
    float acc[NT][MG][4], acc2[NT][MG][4];  // even and odd blocks: two independent MMA chains
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int mg = 0; mg < MG; ++mg)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][mg][i] = acc2[j][mg][i] = 0.f;
#endif

#if ASH
    // stmatrix.x4 row addresses: lane l gives row l & 7 of matrix l >> 3 (a0: rows 0-7, k 0-7; a1: rows 8-15,
    // k 0-7; a2: rows 0-7, k 8-15; a3: rows 8-15, k 8-15) of this warp's 16 rows of its warpgroup's A tile
    // ([k half][64 rows][128 B], 16 B chunk q at q ^ (row % 8)); block blk adds (blk >> 2) k halves
    const int a_row = 16 * (warp & 3) + (lane & 7) + 8 * ((lane >> 3) & 1);
    const u32 a_lane = smem_u32(xs) + DEPTH * XSTAGE + (warp >> 2) * (64 * 256) + a_row * 128;
    u32 a_off[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) a_off[q] = (((2 * q + (lane >> 4)) ^ (lane & 7)) << 4);
#endif
    // 3. the stream
    const int g4 = lane >> 2;
    for (int s = ws0; s < ws1; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int sd = s + d;
#if ASH
            if (sd < ws1) {
                // weight step sd landed for this thread (its group is one older than x step sd's), then for
                // every lane of the warp
                cp_async_wait<DEPTH - 2>();
                __syncwarp();
                const unsigned char* b = ring + d * STAGE_BYTES;
                const uint4 wv0 = *reinterpret_cast<const uint4*>(b + lane * 16);
                const uint4 wv1 = *reinterpret_cast<const uint4*>(b + 512 + lane * 16);
                const uint4 sv0 = *reinterpret_cast<const uint4*>(b + 1024 + g4 * 32);
                const uint4 sv1 = *reinterpret_cast<const uint4*>(b + 1024 + g4 * 32 + 16);
                // A of step sd -> buffer sd & 1 (free: this warpgroup's step sd - 2 finished at the wait below)
                const u32 ab = a_lane + (u32)(sd & 1) * ABUF;
#pragma unroll
                for (int blk = 0; blk < 8; ++blk) {
                    const u32 w = word_of(blk < 4 ? wv0 : wv1, blk & 3);
                    const u32 sw = word_of(blk < 4 ? sv0 : sv1, blk & 3);
                    u32 a0, a1, a2, a3;
                    unpack(w, a0, a1, a2, a3);
                    const u32 sg = dup_lo(sw), sg8 = dup_hi(sw);
                    stmatrix_x4(ab + (blk >> 2) * (64 * 128) + a_off[blk & 3], mul_bf16x2(a0, sg),
                                mul_bf16x2(a1, sg8), mul_bf16x2(a2, sg), mul_bf16x2(a3, sg8));
                }
                // x step sd landed for this thread (its wait overlapped by the unpack above); A and x stage d
                // visible to the async proxy, for every thread of the CTA (and every warpgroup is past its wait
                // of step sd - 1: its multiplies of step sd - 2 are done)
                cp_async_wait<DEPTH - 3>();
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                __syncthreads();
                issue_w(sd + DEPTH - 1, (d + DEPTH - 1) % DEPTH);  // the ring stage read at step sd - 1
                issue_x(sd + DEPTH - 2, (d + DEPTH - 2) % DEPTH);  // the x stage of step sd - 2
                cp_async_commit();
                {
                    const u32 xb = smem_u32(xs) + (u32)d * XSTAGE;
                    const u32 aw = smem_u32(xs) + DEPTH * XSTAGE + (u32)(sd & 1) * ABUF + (warp >> 2) * (64 * 256);
                    wg_fence();
#pragma unroll
                    for (int blk = 0; blk < 8; ++blk) {
                        wgmma_m64k16_ss(&acc[0][0][0], swz_desc(aw, blk, 64), swz_desc(xb, blk, XROWS));
                    }
                    wg_commit();
                    wg_wait<1>();  // step sd - 1's multiplies are done: its A buffer and x stage are free
                }
            }
#else
            if (sd < ws1) {
#if XSTREAM
#if WGMMA
                wg_wait<0>();  // this warpgroup's multiplies of step sd - 1 have read their x stage
                acc_fence(&acc[0][0][0]);  // keep the accumulators in place across the loop (no moves)
#endif
                cp_async_wait<DEPTH - 2>();  // this step's group (and all older) landed, for this thread ...
#if WGMMA
                // ... and is visible to the async proxy that wgmma reads shared memory through
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
                __syncthreads();  // ... for every thread; and every warp is done with step sd - 1's stage
#else
                cp_async_wait<DEPTH - 1>();  // this step's group (and all older) landed
                __syncwarp();                // for every lane of the warp (scales come from lanes 0-15)
#endif
                uint4 wv[NT][2], sv[NT][2];
#pragma unroll
                for (int j = 0; j < NT; ++j) load_tile(ring + (d * NT + j) * STAGE_BYTES, lane, g4, wv[j], sv[j]);
#if XSTREAM
                issue_w(sd + DEPTH - 1, (d + DEPTH - 1) % DEPTH);  // into step sd - 1's stages
                issue_x(sd + DEPTH - 1, (d + DEPTH - 1) % DEPTH);
                cp_async_commit();
                const u32 kb = (u32)d * XSTAGE;  // byte offset of this step's x stage
#else
                __syncwarp();  // every lane has its copy: the stage can be refilled
                issue(sd + DEPTH, d);
                const u32 kb = (u32)(sd - s0) * 128 * 2;  // byte offset of this step in a smem row
#endif
#if WGMMA
                {
                    const u32 xb = smem_u32(xs) + kb;  // this step's x stage
#pragma unroll
                    for (int b0 = 0; b0 < 8; b0 += WB) {  // batches of WB blocks: one fence, commit, wait each
                        u32 a[WB][NT][4];
#pragma unroll
                        for (int bb = 0; bb < WB; ++bb) {
#pragma unroll
                            for (int j = 0; j < NT; ++j)  // NT m64 tiles per warpgroup share each x block
                                scaled_a(wv[j], sv[j], b0 + bb, a[bb][j]);
                        }
                        wg_fence();
#pragma unroll
                        for (int bb = 0; bb < WB; ++bb) {
#if SWZ
                            // B: x^T of block b0 + bb in the 128 B swizzle atoms (8 rows x 128 B)
                            const u64 desc = swz_desc(xb, b0 + bb, XROWS);
#else
                            // B: x^T of block b0 + bb, core matrices 8 rows x 16 B; LBO 128 B (k), SBO 256 B (rows)
                            const u64 desc = (u64)(((xb + (b0 + bb) * (MG * 256)) >> 4) & 0x3FFF)
                                             | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
#endif
#pragma unroll
                            for (int j = 0; j < NT; ++j)
                                wgmma_m64k16(&acc[j][0][0], a[bb][j][0], a[bb][j][1], a[bb][j][2], a[bb][j][3], desc);
                        }
                        wg_commit();
                        wg_wait<1>();  // the batch before this one has finished: its A registers are free
                    }
                }
#else
#pragma unroll
                for (int bp = 0; bp < 4; ++bp) {  // block pair bp: blocks 2bp, 2bp+1 (k 32bp .. 32bp+31)
                    u32 bf[MG][2][2];
#pragma unroll
                    for (int mg = 0; mg < MG; ++mg)
                        ldmatrix_x4(xa[mg] + kb + bp * 64, bf[mg][0][0], bf[mg][0][1], bf[mg][1][0],
                                    bf[mg][1][1]);
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {  // block 2bp + e = word (2bp + e) % 4 of half bp / 2
                            const int blk = 2 * bp + e;
                            const u32 w = word_of(wv[j][blk >> 2], blk & 3);
                            const u32 sw = word_of(sv[j][blk >> 2], blk & 3);
                            u32 bb[MG][2];
#pragma unroll
                            for (int mg = 0; mg < MG; ++mg) bb[mg][0] = bf[mg][e][0], bb[mg][1] = bf[mg][e][1];
                            if (TIMING & 2)
                                acc[j][0][0] += __uint_as_float((w ^ sw) & 0x3F000000u);
                            else
                                word_mma(e ? acc2[j] : acc[j], w, sw, bb);
                        }
                    }
                }
#endif
            }
#endif  // ASH
        }
    }
#if WGMMA
    wg_wait<0>();  // every multiply has landed in acc
    acc_fence(&acc[0][0][0]);
#endif
#else  // WS
    // the rings: x stage d at xs0 + d XSTAGE (1024-byte aligned), then the weights: stage d, tile l (the CTA's
    // warps' NT n-tiles in order) at wr0 + (d TILES + l) STAGE_BYTES; one full / empty mbarrier per stage
    constexpr int TILES = WARPS * NT;
    __shared__ __align__(8) u64 ws_full[DEPTH], ws_empty[DEPTH];
    const u32 full0 = smem_u32(ws_full), empty0 = smem_u32(ws_empty);
    const u32 xs0 = smem_u32(xs), wr0 = xs0 + DEPTH * XSTAGE;
    bool ok[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) ok[j] = tile0 + j < ntiles;
    const float gs_early = 0.f;  // (unused: GSE is off, the epilogue reads the global scale)
    // the tensor map's descriptor fetched while the barriers are set up (its first copy would wait for it)
    if (warp == WARPS && lane == 0) asm volatile("prefetch.tensormap [%0];" :: "l"(&tmap) : "memory");
    if (threadIdx.x == 0) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            mbar_init(full0 + 8 * d, 1);       // the producer's arrival (with the stage's bytes to expect)
            mbar_init(empty0 + 8 * d, WARPS);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int nst = ws1 - ws0;  // this CTA's steps (none past K's end)
    float acc[NT][MG][4];
    acc_zero(&acc[0][0][0]);
    if (warp == WARPS) {
        // the producer: lane l < nok copies tile l's weight words and scales of each step, lane 0 expects the
        // stage's bytes and copies x's two halves (the box: 64 k x XROWS rows, from row blockIdx.z XROWS)
        const int tb = blockIdx.x * TILES;
        const int nok = max(0, min(TILES, ntiles - tb));  // the CTA's tiles inside N (the rest: never copied)
        const u32 bytes = nok * STAGE_BYTES + 2 * XROWS * 128;
        const bool mine = lane < nok;
        const uint4* wsrc = wt + ((u64)(tb + (mine ? lane : 0)) * S + ws0) * 64;
        const uint4* ssrc = st + ((u64)(tb + (mine ? lane : 0)) * S + ws0) * 16;
        const int xrow = blockIdx.z * XROWS;
        auto issue_w = [&](int i, int d) {
            if (lane == 0) mbar_expect(full0 + 8 * d, bytes);
            __syncwarp();
            if (mine) {
                const u32 dst = wr0 + (d * TILES + lane) * STAGE_BYTES;
                bulk_g2s(dst, wsrc + (u64)i * 64, 1024, full0 + 8 * d);
                bulk_g2s(dst + 1024, ssrc + (u64)i * 16, 256, full0 + 8 * d);
            }
        };
        auto issue_x = [&](int i, int d) {
            if (lane == 0) {
                const int k = (ws0 + i) * 128;
                tma_2d(xs0 + d * XSTAGE, &tmap, k, xrow, full0 + 8 * d);
                tma_2d(xs0 + d * XSTAGE + XROWS * 128, &tmap, k + 64, xrow, full0 + 8 * d);
            }
        };
        // PDL: the first DEPTH weight steps before the wait (nothing on the stream writes weights), x after
        const int pro = min(DEPTH, nst);
        for (int i = 0; i < pro; ++i) issue_w(i, i);
        asm volatile("griddepcontrol.wait;" ::: "memory");
        if (TRIGGER == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        for (int i = 0; i < pro; ++i) issue_x(i, i);
        u32 d = 0, ph = 0;  // step i's stage (i % DEPTH) and the parity of its previous use's release
        for (int i = DEPTH; i < nst; ++i) {
            mbar_wait(empty0 + 8 * d, ph);  // every consumer warp is done with step i - DEPTH
            issue_w(i, d);
            issue_x(i, d);
            if (++d == DEPTH) d = 0, ph ^= 1;
        }
    } else {
        asm volatile("griddepcontrol.wait;" ::: "memory");  // (y: written after the previous kernel)
        STAMP(1);
        if (TRIGGER == 3) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        STAMP(2);
        const int g4 = lane >> 2;
        const unsigned char* wl = reinterpret_cast<const unsigned char*>(xs) + DEPTH * XSTAGE
                                  + warp * NT * STAGE_BYTES;
        // steps in rounds of DEPTH (the stage index a constant: its addresses and descriptors fold)
        u32 ph = 0;  // the parity of this round's full phases
        for (int i0 = 0; i0 < nst; i0 += DEPTH, ph ^= 1) {
#pragma unroll
            for (int d = 0; d < DEPTH; ++d) {
                if (i0 + d < nst) {
                    // the previous step's multiplies are done (for the whole warpgroup): its stage goes back
                    wg_wait<0>();
                    acc_fence(&acc[0][0][0]);
                    if (i0 + d > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((d + DEPTH - 1) % DEPTH));
                    mbar_wait(full0 + 8 * d, ph);  // this step's weights and x have landed
                    // (a tile past N reads bytes never copied: its rows of acc are never stored)
                    uint4 wv[NT][2], sv[NT][2];
#pragma unroll
                    for (int j = 0; j < NT; ++j) load_tile(wl + (d * TILES + j) * STAGE_BYTES, lane, g4, wv[j], sv[j]);
                    const u32 xb = xs0 + d * XSTAGE;
#pragma unroll
                    for (int b0 = 0; b0 < 8; b0 += WB) {  // as the WGMMA build: batches of WB blocks
                        u32 a[WB][NT][4];
#pragma unroll
                        for (int bb = 0; bb < WB; ++bb) {
#pragma unroll
                            for (int j = 0; j < NT; ++j) scaled_a(wv[j], sv[j], b0 + bb, a[bb][j]);
                        }
                        wg_fence();
#pragma unroll
                        for (int bb = 0; bb < WB; ++bb) {
                            const u64 desc = swz_desc(xb, b0 + bb, XROWS);
#pragma unroll
                            for (int j = 0; j < NT; ++j)
                                wgmma_m64k16(&acc[j][0][0], a[bb][j][0], a[bb][j][1], a[bb][j][2], a[bb][j][3],
                                             desc);
                        }
                        wg_commit();
                        wg_wait<1>();  // the batch before this one has finished: its A registers are free
                    }
                }
            }
        }
        wg_wait<0>();
        acc_fence(&acc[0][0][0]);
    }
#endif  // WS
    cp_async_wait<0>();  // no copy may still be in flight when shared memory is reused below
    STAMP(3);
#if RN_IN == 2
    // rstd from the tile sums that came with x (RN_IN 1's order), before the epilogue reuses shared memory:
    // its first barrier (or this one) orders it before the outputs
    for (int m = warp; m < XR; m += WARPS) {
        const int np = K >> 4;
        float sum = 0.f;
        for (int c = lane; c < np; c += 32) sum = __fadd_rn(sum, rn_sm[m * np + c]);
        sum = pn_warp_sum(sum);
        if (lane == 0)
            rn_rstd[m] = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fmul_rn(sum, __int_as_float(rn_inv_bits)),
                                                             __int_as_float(rn_eps_bits))));
    }
#if KW == 1 && !GU_SILU
    __syncthreads();  // (the plain epilogue has no barrier of its own)
#endif
#endif
    if (TRIGGER == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#if !WGMMA
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int mg = 0; mg < MG; ++mg)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][mg][i] += acc2[j][mg][i];
#endif

    // 4. epilogue. D fragment: c0, c1 = weight row g, x rows 2t, 2t+1; c2, c3 = weight row g + 8.
    const int g = lane >> 2, t = lane & 3;
    const float gs = WG_ROW ? 0.f : GSE ? gs_early : wg[0] * 256.f;
#if KW > 1
    {
        // in-CTA split-K: the KW warps of an n-tile leave their fp32 partials in shared memory (x and the
        // rings are no longer needed) and the CTA sums them in the cluster reduction's fixed tree order
        // ((p0 + p1) + (p2 + p3)) + ...: with the same step ranges, the bits of SPLIT = KW CTAs, without the
        // cluster barriers and distributed shared memory (1-1.5 us per call on the H200, bench/RESULTS.md)
        constexpr int PS = NB + 4;
        float* part = reinterpret_cast<float*>(smem);
        __syncthreads();
        const int kw = warp / TW, nw = warp % TW;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int mg = 0; mg < MG; ++mg)
#pragma unroll
                    for (int c = 0; c < 2; ++c)
                        part[(kw * XROWS + 8 * mg + 2 * t + c) * PS + (nw * NT + j) * 16 + g + 8 * hh] =
                            acc[j][mg][2 * hh + c];
        __syncthreads();
#if GU_SILU
        // logical columns nl (gate row blockIdx.x NB / 2 + nl) and nl + NB / 2 (the same row of up): y's bits
        // for each, then a = bf16(bf16(silu(g)) * u) to column blockIdx.x NB / 2 + nl of y [M, N / 2]
        for (int e = threadIdx.x; e < XR * (NB / 2); e += WARPS * 32) {
            const int m = e / (NB / 2), nl = e - m * (NB / 2);
            float gu[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // (the partials' tree as below)
                float p[KW];
#pragma unroll
                for (int r = 0; r < KW; ++r) p[r] = part[(r * XROWS + m) * PS + nl + h * (NB / 2)];
#pragma unroll
                for (int off = 1; off < KW; off <<= 1)
#pragma unroll
                    for (int r = 0; r + off < KW; r += 2 * off) p[r] += p[r + off];
                const int n = h * (N >> 1) + blockIdx.x * (NB / 2) + nl;  // the weight's row
#if GSU && WG_ROW
                const float sc = h ? gsu_u : gsu_g;  // (n = h N / 2 + blockIdx.x NB / 2 + t % (NB / 2))
                (void)n;
#else
                const float sc = WG_ROW ? wg[n] * 256.f : gs;
#endif
#if RN_IN
                gu[h] = bf16_float(__fmul_rn(p[0] * sc, rn_rstd[m]));
#else
                gu[h] = bf16_float(p[0] * sc);
#endif
            }
            y[(u64)m * stride_ym + blockIdx.x * (NB / 2) + nl] = to_bf16(silu_up1(gu[0], gu[1]));
        }
        STAMP_EXIT();
        return;
#endif
#if RN_OUT
        // x' = bf16(r + y), xt = bf16(w x') in y's place, x' to xo; the squares' tree per row and n-tile
        // (lanes 16 h + c hold its columns c: the pairs c, c + 8, then xor 1, 2, 4), lane c = 0 stores it.
        // Warp-uniform (the shuffles): XR NB is a multiple of 16, a group of 16 lanes all in or all out
        for (int e0 = warp * 32; e0 < XR * NB; e0 += WARPS * 32) {
            const int e = e0 + lane;
            const bool in = e < XR * NB;
            const int m = in ? e / NB : 0, nl = in ? e - m * NB : 0;
            const int n = blockIdx.x * NB + nl;
            float q = 0.f;
            if (in) {
                float p[KW];
#pragma unroll
                for (int r = 0; r < KW; ++r) p[r] = part[(r * XROWS + m) * PS + nl];
#pragma unroll
                for (int off = 1; off < KW; off <<= 1)
#pragma unroll
                    for (int r = 0; r + off < KW; r += 2 * off) p[r] += p[r + off];
#if GSR && WG_ROW
                const float gg = gsr_early;
#else
                const float gg = WG_ROW ? wg[n] * 256.f : gs;
#endif
                const float r = bf16_bits_float(e < WARPS * 32 ? rn_r_early
                                                               : ld_u16_cg(rn_res + (u64)m * rn_stride_r + n));
                const float xp = bf16_float(__fadd_rn(r, bf16_float(p[0] * gg)));
                rn_xo[(u64)m * N + n] = to_bf16(xp);
                y[(u64)m * stride_ym + n] = to_bf16(__fmul_rn(rn_w_early, xp));
                q = __fmul_rn(xp, xp);
            }
            q = __fadd_rn(q, __shfl_xor_sync(0xffffffffu, q, 8));
#pragma unroll
            for (int o = 1; o <= 4; o <<= 1) q = __fadd_rn(q, __shfl_xor_sync(0xffffffffu, q, o));
            if (in && (lane & 15) == 0) rn_ss[(u64)m * (N >> 4) + (n >> 4)] = q;
        }
        STAMP_EXIT();
        return;
#endif
        for (int e = threadIdx.x; e < XR * NB; e += WARPS * 32) {
            const int m = e / NB, nl = e - m * NB;
            const int n = blockIdx.x * NB + nl;
            float p[KW];
#pragma unroll
            for (int r = 0; r < KW; ++r) p[r] = part[(r * XROWS + m) * PS + nl];
#pragma unroll
            for (int off = 1; off < KW; off <<= 1)
#pragma unroll
                for (int r = 0; r + off < KW; r += 2 * off) p[r] += p[r + off];
            if (n < N) {
#if GSR && WG_ROW
                const float gg = gsr_early * (XG_ROW ? xg[m] : 1.f);  // n = blockIdx.x * NB + t % NB
#else
                const float gg = (WG_ROW ? wg[n] * 256.f : gs) * (XG_ROW ? xg[m] : 1.f);
#endif
#if RN_IN
                y[(u64)m * stride_ym + n] = to_bf16(__fmul_rn(p[0] * gg, rn_rstd[m]));
#else
                y[(u64)m * stride_ym + n] = (u16)(f2_to_bf16x2(p[0] * gg, 0.f) & 0xFFFFu);
#endif
            }
        }
        STAMP_EXIT();
        return;
    }
#endif
    if (WS && warp == WARPS && SPLIT == 1) return;  // the producer (WS) has no outputs
#if GU_SILU
    if (SPLIT == 1) {
        // each warp's outputs with y's bits (fp32 holding the bf16) to shared memory [XR][PS] by logical
        // column (x and the rings are no longer needed), then the gate / up pairs as in the KW epilogue above
        constexpr int PS = NB + 4;
        float* part = reinterpret_cast<float*>(smem);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int n = PTILE(tile0 + j) * 16 + g + 8 * hh;  // the weight's row
                const int nl = (warp * NT + j) * 16 + g + 8 * hh;  // the CTA's logical column
#if GSU && WG_ROW && KW == 1
                const float gn = gsu_r[j][hh];
                (void)n;
#else
                const float gn = WG_ROW ? wg[n] * 256.f : gs;
#endif
#pragma unroll
                for (int mg = 0; mg < MG; ++mg)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int m = 8 * mg + 2 * t + c;
#if RN_IN
                        if (ok[j] && m < XR)
                            part[m * PS + nl] = bf16_float(__fmul_rn(acc[j][mg][2 * hh + c] * gn, rn_rstd[m]));
#else
                        if (ok[j] && m < XR)
                            part[m * PS + nl] = bf16_float(acc[j][mg][2 * hh + c] * gn);
#endif
                    }
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < XR * (NB / 2); e += WARPS * 32) {
            const int m = e / (NB / 2), nl = e - m * (NB / 2);
            y[(u64)m * stride_ym + blockIdx.x * (NB / 2) + nl] =
                to_bf16(silu_up1(part[m * PS + nl], part[m * PS + nl + NB / 2]));
        }
        STAMP_EXIT();
        return;
    }
#endif
    if (SPLIT == 1) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (!ok[j] || (WS && warp == WARPS)) continue;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int n = (tile0 + j) * 16 + g + 8 * hh;
                const float gn = WG_ROW ? wg[n] * 256.f : gs;
#pragma unroll
                for (int mg = 0; mg < MG; ++mg) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int m = 8 * mg + 2 * t + c;
#if RN_IN
                        if (m < M) y[(u64)m * stride_ym + n] = to_bf16(__fmul_rn(acc[j][mg][2 * hh + c] * gn, rn_rstd[m]));
#else
                        if (m < M)
                            y[(u64)m * stride_ym + n] = to_bf16(acc[j][mg][2 * hh + c] * (XG_ROW ? gn * xg[m] : gn));
#endif
                    }
                }
            }
        }
        STAMP_EXIT();
        return;
    }
#if SPLIT > 1
    // partials -> own shared memory [XROWS][PS] fp32 (x is no longer needed); rows padded by 4 floats so
    // that the 4 lanes t of a group (rows 2t, 2t + 1) store to different banks
    constexpr int PS = NB + 4;
    __syncthreads();
    float* part = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int j = 0; j < NT && (!WS || warp < WARPS); ++j) {  // (WS: not the producer)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int nl = (warp * NT + j) * 16 + g + 8 * hh;
#pragma unroll
            for (int mg = 0; mg < MG; ++mg)
#pragma unroll
                for (int c = 0; c < 2; ++c) part[(8 * mg + 2 * t + c) * PS + nl] = acc[j][mg][2 * hh + c];
        }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    if (!WS || warp < WARPS) {  // (WS: not the producer; it only joins the cluster barriers)
        u32 rank;
        asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
        const int cols = (GU_SILU ? NB / 2 : NB) / SPLIT;  // (GU_SILU: the gate columns this rank finishes)
        const int total = XR * cols;
        const u32 base = smem_u32(part);
        const int r = threadIdx.x % SPLIT;  // the rank this thread reads
        constexpr int STEP = (WARPS * 32) / SPLIT, U = 4;  // U elements per thread in flight
        for (int e0 = 0; e0 < total; e0 += U * STEP) {  // uniform per warp: shuffles below
            float v[U], vu[U];  // (vu: GU_SILU, the up column's)
            int es[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {  // the U remote loads first (independent), then the sums
                const int e = e0 + u * STEP + (int)threadIdx.x / SPLIT;
                es[u] = e;
                v[u] = vu[u] = 0.f;
                if (e < total) {
                    const int m = e / cols, nl = rank * cols + (e - m * cols);
                    u32 ra;
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra)
                                 : "r"(base + (u32)(m * PS + nl) * 4), "r"(r));
                    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v[u]) : "r"(ra) : "memory");
#if GU_SILU
                    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(vu[u]) : "r"(ra + (NB / 2) * 4)
                                 : "memory");
#endif
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int off = 1; off < SPLIT; off <<= 1) {  // fixed tree over ranks: deterministic
                    const float o = __shfl_down_sync(0xffffffffu, v[u], off);
                    if ((r & (2 * off - 1)) == 0) v[u] += o;
#if GU_SILU
                    const float ou = __shfl_down_sync(0xffffffffu, vu[u], off);
                    if ((r & (2 * off - 1)) == 0) vu[u] += ou;
#endif
                }
                const int e = es[u];
                const int m = e / cols, nl = rank * cols + (e - m * cols);
#if GU_SILU
                if (r == 0 && e < total) {
                    const int n = blockIdx.x * (NB / 2) + nl;  // gate's row (and y's column); up's: N / 2 further
                    const float g0 = bf16_float(v[u] * (WG_ROW ? wg[n] * 256.f : gs));
                    const float u0 = bf16_float(vu[u] * (WG_ROW ? wg[(N >> 1) + n] * 256.f : gs));
                    y[(u64)m * stride_ym + n] = to_bf16(silu_up1(g0, u0));
                }
                continue;
#endif
                const int n = blockIdx.x * NB + nl;
                if (r == 0 && e < total && n < N) {
                    const float gg = (WG_ROW ? wg[n] * 256.f : gs) * (XG_ROW ? xg[m] : 1.f);
                    y[(u64)m * stride_ym + n] = (u16)(f2_to_bf16x2(v[u] * gg, 0.f) & 0xFFFFu);
                }
            }
        }
    }
    // nobody leaves while another CTA of the cluster may still read its shared memory
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    STAMP_EXIT();
#endif
}
