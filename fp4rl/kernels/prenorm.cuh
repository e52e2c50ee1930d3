// The decode step's residual add + RMSNorm as it is folded into the launch of the kernel that consumes it (the
// MoE router + route's PRENORM build, moe_router_route.cu; the dense mma16 GEMM's PRENORM build,
// gemv_mma16.cu): the per-chunk arithmetic both share, so that both give fp4rl.kernels.prenorm.reference's
// bits. A chunk is 16 bytes: 8 bf16, element 2i in the low half of word i. Prepended to either source by its
// launcher (no typedefs assumed).

__device__ __forceinline__ float pn_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float pn_hi(unsigned int v) { return __uint_as_float(v & 0xFFFF0000u); }

// fp32 -> bf16 bits, round to nearest even; a NaN as 0x7FC0 (c10::BFloat16's on the host; the GPU's
// __float2bfloat16 may give another NaN)
__device__ __forceinline__ unsigned short pn_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)0x7FC0u;
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// acc + the 8 exact products of a chunk, in element order (an exact product: fmaf = one rounding of the add)
__device__ __forceinline__ float pn_dot8(float acc, const uint4& a, const uint4& b) {
    acc = fmaf(pn_lo(a.x), pn_lo(b.x), acc);
    acc = fmaf(pn_hi(a.x), pn_hi(b.x), acc);
    acc = fmaf(pn_lo(a.y), pn_lo(b.y), acc);
    acc = fmaf(pn_hi(a.y), pn_hi(b.y), acc);
    acc = fmaf(pn_lo(a.z), pn_lo(b.z), acc);
    acc = fmaf(pn_hi(a.z), pn_hi(b.z), acc);
    acc = fmaf(pn_lo(a.w), pn_lo(b.w), acc);
    acc = fmaf(pn_hi(a.w), pn_hi(b.w), acc);
    return acc;
}

// x' = bf16(a + b) of a chunk's 8 bf16 pairs (fp32 add, one rounding, then RNE to bf16)
__device__ __forceinline__ uint4 pn_add8(const uint4& a, const uint4& b) {
    const unsigned int av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    unsigned int o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        o[k] = (unsigned int)pn_bf16(__fadd_rn(pn_lo(av[k]), pn_lo(bv[k])))
               | ((unsigned int)pn_bf16(__fadd_rn(pn_hi(av[k]), pn_hi(bv[k]))) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// acc + the 8 squares of a chunk in element order (a bf16 square is exact in fp32: one rounding, of the add)
__device__ __forceinline__ float pn_sq8(float acc, const uint4& a) { return pn_dot8(acc, a, a); }

// y = bf16(w * bf16(x' * rstd)) of a chunk (each product rounded: no FMA)
__device__ __forceinline__ uint4 pn_norm8(const uint4& a, const uint4& w, float rstd) {
    const unsigned int av[4] = {a.x, a.y, a.z, a.w}, wv[4] = {w.x, w.y, w.z, w.w};
    unsigned int o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float l = __uint_as_float((unsigned int)pn_bf16(__fmul_rn(pn_lo(av[k]), rstd)) << 16);
        const float h = __uint_as_float((unsigned int)pn_bf16(__fmul_rn(pn_hi(av[k]), rstd)) << 16);
        o[k] = (unsigned int)pn_bf16(__fmul_rn(pn_lo(wv[k]), l))
               | ((unsigned int)pn_bf16(__fmul_rn(pn_hi(wv[k]), h)) << 16);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// the warp's xor butterfly (16, 8, 4, 2, 1) of a lane's sum: every lane ends with the same bits
__device__ __forceinline__ float pn_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// rstd = 1 / sqrt(sum * inv_h + eps) of a row from its 8 warps' sums (added in warp order), IEEE square root
// and division (torch's on the reference's side); inv_h and eps as their float32 bit patterns
__device__ __forceinline__ float pn_rstd(const float* part, int inv_h_bits, int eps_bits) {
    float sum = part[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) sum = __fadd_rn(sum, part[w]);
    return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fmul_rn(sum, __int_as_float(inv_h_bits)),
                                               __int_as_float(eps_bits))));
}

// one 16-byte global store (st.global.v4: NVVM split a plain uint4 store of a value read from shared memory
// into four 32-bit ones in the GEMM's build)
__device__ __forceinline__ void pn_st16(void* p, const uint4& v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// acc[e] += bf16 element e of d times w, the product rounded (no FMA): moe_route.combine's step for one expert
__device__ __forceinline__ void pn_wsum8(float* acc, const uint4& d, float w) {
    const unsigned int dv[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        acc[2 * k] = __fadd_rn(acc[2 * k], __fmul_rn(w, pn_lo(dv[k])));
        acc[2 * k + 1] = __fadd_rn(acc[2 * k + 1], __fmul_rn(w, pn_hi(dv[k])));
    }
}

// 8 fp32 -> the chunk of their bf16 roundings (RNE)
__device__ __forceinline__ uint4 pn_round8(const float* acc) {
    unsigned int o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
        o[k] = (unsigned int)pn_bf16(acc[2 * k]) | ((unsigned int)pn_bf16(acc[2 * k + 1]) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}
