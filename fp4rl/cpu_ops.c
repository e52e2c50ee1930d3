/* Fused BF16 CPU kernels for the sampler's decoder layers (everything but the linears).
 *
 * Loaded by fp4rl/cpu_ops.py with ctypes; see its docstring for what each kernel computes and
 * how it rounds. Tensors are bfloat16 (uint16_t bit patterns); arithmetic is float32; every
 * bfloat16 result is rounded to nearest even as torch rounds (NaN -> 0x7fc0). Each elementwise
 * kernel rounds where the eager torch code rounds (after each bfloat16 op), so RoPE, the residual
 * adds and the weight multiply of RMSNorm give torch's bits; sums (RMSNorm's mean of squares,
 * attention) are float32 in this file's order.
 *
 * AVX-512 paths are compiled when the compiler targets it (-march=native on such a CPU); the
 * scalar code computes the same formulas everywhere else. Single-threaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FP4RL_AVX512 1
#else
#define FP4RL_AVX512 0
#endif

typedef uint16_t bf16;
typedef int64_t i64;

static inline float bf2f(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float rbf(float f) { return bf2f(f2bf(f)); } /* round to bfloat16, back to float */

#if FP4RL_AVX512
static inline __m512 ld16(const bf16 *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512BF16__)
/* one instruction; rounds to nearest even like torch (it flushes float32 subnormals below
 * 1.2e-38 to zero, which no activation of a BF16 model holds: BF16 keeps them as subnormals) */
static inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
static inline __m256i to_bf16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

static inline void st16(bf16 *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, to_bf16(x)); }

static inline __m512 rbf16(__m512 x) { /* round to bfloat16, back to float */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

/* exp(x) in float32 (Cephes' range reduction and polynomial, about 1 ulp); NaN stays NaN,
 * x > 88.7 gives inf, and x < -87.3 gives 0: results below float32's smallest normal are
 * flushed, since producing subnormals costs a microcode assist (~100x slower) per vector. */
static inline __m512 exp16(__m512 x) {
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 y = _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
    return _mm512_mask_mov_ps(y, nan, x);
}
#endif

/* ---- RMSNorm with the residual add ------------------------------------------------------------
 * For each of `rows` rows of n values: if delta, x = bf16(x + delta) (in place); then
 * out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), mean in float32. */
void cpu_add_rms_norm(i64 rows, i64 n, bf16 *x, i64 x_row, const bf16 *delta, i64 d_row, const bf16 *w,
                      float eps, bf16 *out, i64 out_row) {
    for (i64 i = 0; i < rows; i++) {
        bf16 *xr = x + i * x_row;
        const bf16 *dr = delta ? delta + i * d_row : NULL;
        bf16 *o = out + i * out_row;
        i64 j = 0;
        float ss = 0.0f;
#if FP4RL_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            __m512 v = ld16(xr + j);
            if (dr) {
                v = rbf16(_mm512_add_ps(v, ld16(dr + j)));
                st16(xr + j, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; j < n; j++) {
            float v = bf2f(xr[j]);
            if (dr) {
                v = rbf(v + bf2f(dr[j]));
                xr[j] = f2bf(v);
            }
            ss += v * v;
        }
        float r = 1.0f / sqrtf(ss / (float)n + eps);
        j = 0;
#if FP4RL_AVX512
        __m512 rv = _mm512_set1_ps(r);
        for (; j + 16 <= n; j += 16)
            st16(o + j, _mm512_mul_ps(ld16(w + j), rbf16(_mm512_mul_ps(ld16(xr + j), rv))));
#endif
        for (; j < n; j++) o[j] = f2bf(bf2f(w[j]) * rbf(bf2f(xr[j]) * r));
    }
}

/* ---- SiLU(gate) * up ----------------------------------------------------------------------------
 * out = bf16(bf16(g / (1 + exp(-g))) * up), rows x n, rows strided. */
void cpu_silu_mul(i64 rows, i64 n, const bf16 *g, i64 g_row, const bf16 *u, i64 u_row, bf16 *out, i64 out_row) {
    for (i64 i = 0; i < rows; i++) {
        const bf16 *gr = g + i * g_row, *ur = u + i * u_row;
        bf16 *o = out + i * out_row;
        i64 j = 0;
#if FP4RL_AVX512
        __m512 one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= n; j += 16) {
            __m512 x = ld16(gr + j);
            __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
            /* 1 / d: rcp14 and one Newton step (~2^-27 relative, below float32's own rounding
             * for what BF16 keeps); d = inf (x < -88) gives 0, as x / inf does */
            __m512 r = _mm512_rcp14_ps(d);
            r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
            r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ), r);
            st16(o + j, _mm512_mul_ps(rbf16(_mm512_mul_ps(x, r)), ld16(ur + j)));
        }
#endif
        for (; j < n; j++) {
            float x = bf2f(gr[j]);
            o[j] = f2bf(rbf(x / (1.0f + expf(-x))) * bf2f(ur[j]));
        }
    }
}

/* ---- RoPE on q and k, k and v written to their destination -------------------------------------
 * Rows r = b * T + t of q [rows, H * D], k and v [rows, Hkv * D] (row strides q_row, k_row, v_row);
 * cos, sin [rows, D] contiguous. q_out [rows, H, D] contiguous; k_out, v_out hold (b, h, slot)
 * at b * kv_b + h * kv_h + (start + t) * kv_t (a KV cache's [B, H_kv, T_max, D] buffers, or
 * fresh [B, H_kv, T, D] tensors with start = 0).
 * rot(x)[d] = bf16(bf16(x[d] * cos[d]) + bf16(x'[d] * sin[d])), x' = (-x2, x1): model.py's
 * q * cos + rotate_half(q) * sin, rounded as torch rounds each bfloat16 op. */
static void rope_head(const bf16 *x, const bf16 *c, const bf16 *s, i64 D, bf16 *o) {
    i64 half = D / 2, d = 0;
#if FP4RL_AVX512
    if (half % 16 == 0) {
        for (; d < half; d += 16) {
            __m512 x1 = ld16(x + d), x2 = ld16(x + half + d);
            __m512 c1 = ld16(c + d), c2 = ld16(c + half + d), s1 = ld16(s + d), s2 = ld16(s + half + d);
            __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x2);
            st16(o + d, _mm512_add_ps(rbf16(_mm512_mul_ps(x1, c1)), rbf16(_mm512_mul_ps(neg, s1))));
            st16(o + half + d, _mm512_add_ps(rbf16(_mm512_mul_ps(x2, c2)), rbf16(_mm512_mul_ps(x1, s2))));
        }
        return;
    }
#endif
    for (; d < half; d++) {
        float x1 = bf2f(x[d]), x2 = bf2f(x[half + d]);
        o[d] = f2bf(rbf(x1 * bf2f(c[d])) + rbf(-x2 * bf2f(s[d])));
        o[half + d] = f2bf(rbf(x2 * bf2f(c[half + d])) + rbf(x1 * bf2f(s[half + d])));
    }
}

void cpu_rope_qkv(i64 B, i64 T, i64 H, i64 Hkv, i64 D, const bf16 *q, i64 q_row, const bf16 *k, i64 k_row,
                  const bf16 *v, i64 v_row, const bf16 *cos, const bf16 *sin, bf16 *q_out, bf16 *k_out,
                  bf16 *v_out, i64 kv_b, i64 kv_h, i64 kv_t, i64 start) {
    for (i64 b = 0; b < B; b++)
        for (i64 t = 0; t < T; t++) {
            i64 r = b * T + t;
            const bf16 *c = cos + r * D, *s = sin + r * D;
            for (i64 h = 0; h < H; h++) rope_head(q + r * q_row + h * D, c, s, D, q_out + (r * H + h) * D);
            for (i64 h = 0; h < Hkv; h++) {
                i64 dst = b * kv_b + h * kv_h + (start + t) * kv_t;
                rope_head(k + r * k_row + h * D, c, s, D, k_out + dst);
                memcpy(v_out + dst, v + r * v_row + h * D, (size_t)D * sizeof(bf16));
            }
        }
}

/* ---- attention of T new queries over S = start + T key slots -------------------------------------
 * q [B, T, H, D] contiguous; k, v at b * kv_b + h * kv_h + s * kv_t; real [B, S] (row stride
 * real_b, nonzero = a real token) or NULL (all real). The query in slot p = start + t sees key
 * slot s when s <= p and (real[s] or s == p) (model.py's mask); query head h reads kv head
 * h / (H / Hkv). out [B, T, H, D] = softmax(scale * q.k) @ v, all in float32, rounded once.
 * Returns 0, or -1 when the scratch memory cannot be allocated. */
#if FP4RL_AVX512 && defined(__AVX512BF16__)
#define FP4RL_ATTN_BF16 1
/* float32 -> the same bits rounded to nearest even at bit 16 (the BF16 value in the high half),
 * NaN -> 0x7fc0 in the high half: what f2bf gives, without packing. */
static inline __m512i rne_hi(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

/* v[16] -> one vector whose lane L is the sum of v[PERM[L]]'s 16 lanes (a transposed reduction:
 * 45 instructions for 16 dot products instead of 16 horizontal sums). */
static const int PERM[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __m512 hsum16(const __m512 *v) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[i], d[i + 2]), _mm512_unpackhi_ps(d[i], d[i + 2]));
    __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)), _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
}

/* One query row (head r of kv head hk, slot p) for D % 32 == 0, D <= 256: scores by BF16 dot
 * products accumulated in float32 (vdpbf16ps), softmax and the weighted sum of values in float32. */
/* Scores of one query row against keys 0..p, softmax numerators into row[0..p] (0 where hidden);
 * returns 1 / their sum. */
static inline __attribute__((always_inline)) float attn_scores_bf16(i64 D, i64 p, const bf16 *qr, const bf16 *kb,
                                                                   i64 kv_t, const uint8_t *rb, float scale,
                                                                   float *row) {
    i64 n = p + 1, nq = D / 32;
    __m512bh qv[8];
    for (i64 k = 0; k < nq; k++) qv[k] = (__m512bh)_mm512_loadu_si512(qr + 32 * k);
    __m512 sv = _mm512_set1_ps(scale), mx = _mm512_set1_ps(-INFINITY);
    for (i64 s0 = 0; s0 < n; s0 += 16) {
        __m512 part[16];
        if (s0 + 16 <= n) {
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                const bf16 *ks = kb + (s0 + j) * kv_t;
                __m512 a = _mm512_setzero_ps();
                for (i64 k = 0; k < nq; k++) a = _mm512_dpbf16_ps(a, qv[k], (__m512bh)_mm512_loadu_si512(ks + 32 * k));
                part[PERM[j]] = a;
            }
        } else {
            for (int j = 0; j < 16; j++) {
                i64 s = s0 + j;
                __m512 a = _mm512_setzero_ps();
                if (s < n) {
                    const bf16 *ks = kb + s * kv_t;
                    for (i64 k = 0; k < nq; k++)
                        a = _mm512_dpbf16_ps(a, qv[k], (__m512bh)_mm512_loadu_si512(ks + 32 * k));
                }
                part[PERM[j]] = a;
            }
        }
        __m512 x = _mm512_mul_ps(hsum16(part), sv);
        __mmask16 hide = n - s0 >= 16 ? 0 : (__mmask16)(0xffffu << (n - s0));
        if (rb) {
            i64 cnt = n - s0 >= 16 ? 16 : n - s0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
            __m128i r16 = _mm_maskz_loadu_epi8((__mmask16)((1u << cnt) - 1u), rb + s0);
#else
            __m128i r16 = _mm_setzero_si128();
            memcpy(&r16, rb + s0, (size_t)cnt);
#endif
            __mmask16 pad = _mm_cmpeq_epi8_mask(r16, _mm_setzero_si128());
            if (p - s0 < 16) pad &= (__mmask16) ~(1u << (p - s0)); /* a query always sees its own slot */
            hide |= pad;
        }
        x = _mm512_mask_mov_ps(x, hide, _mm512_set1_ps(-INFINITY));
        mx = _mm512_max_ps(mx, x);
        _mm512_storeu_ps(row + s0, x);
    }
    float m = _mm512_reduce_max_ps(mx);
    if (m != m || m == -INFINITY) m = 0.0f;
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (i64 s0 = 0; s0 < n; s0 += 16) {
        __m512 x = _mm512_loadu_ps(row + s0);
        __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
        __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, mv)));
        _mm512_storeu_ps(row + s0, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* R query rows (the heads of one kv head, R <= 4, D <= 128) of one decode slot p: scores per row,
 * then one pass over the values for all R rows (each value row loaded and split once). */
static inline __attribute__((always_inline)) void attn_group_bf16(i64 D, i64 R, i64 p, const bf16 *q,
                                                                  const bf16 *kb, const bf16 *vb, i64 kv_t,
                                                                  const uint8_t *rb, float scale, float *sc,
                                                                  i64 Sp, bf16 *o) {
    i64 n = p + 1, nq = D / 32;
    float inv[4];
    for (i64 r = 0; r < R; r++) inv[r] = attn_scores_bf16(D, p, q + r * D, kb, kv_t, rb, scale, sc + r * Sp);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[4][8];
    for (i64 r = 0; r < R; r++)
        for (i64 c = 0; c < 2 * nq; c++) acc[r][c] = _mm512_setzero_ps();
    for (i64 s = 0; s < n; s++) {
        __m512 ve[4], vo[4];
        for (i64 c = 0; c < nq; c++) {
            __m512i x = _mm512_loadu_si512(vb + s * kv_t + 32 * c);
            ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            vo[c] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
        }
        for (i64 r = 0; r < R; r++) {
            __m512 ev = _mm512_set1_ps(sc[r * Sp + s]);
            for (i64 c = 0; c < nq; c++) {
                acc[r][2 * c] = _mm512_fmadd_ps(ev, ve[c], acc[r][2 * c]);
                acc[r][2 * c + 1] = _mm512_fmadd_ps(ev, vo[c], acc[r][2 * c + 1]);
            }
        }
    }
    for (i64 r = 0; r < R; r++) {
        __m512 iv = _mm512_set1_ps(inv[r]);
        for (i64 c = 0; c < nq; c++) {
            __m512i e = rne_hi(_mm512_mul_ps(acc[r][2 * c], iv)), od = rne_hi(_mm512_mul_ps(acc[r][2 * c + 1], iv));
            _mm512_storeu_si512(o + r * D + 32 * c, _mm512_or_si512(_mm512_and_si512(od, hi), _mm512_srli_epi32(e, 16)));
        }
    }
}

static inline __attribute__((always_inline)) void attn_row_bf16(i64 D, i64 p, const bf16 *qr, const bf16 *kb,
                                                                const bf16 *vb, const float *vf, i64 kv_t,
                                                                const uint8_t *rb, float scale, float *row,
                                                                bf16 *o) {
    i64 n = p + 1, nq = D / 32, nv = D / 16;
    float inv = attn_scores_bf16(D, p, qr, kb, kv_t, rb, scale, row);
    /* values from vf, the float32 copy of this kv head's V [n, D] (converted once per kv head);
     * two interleaved accumulator sets over even and odd slots: half the FMA dependency chain */
    __m512 acc[16], acc2[16];
    for (i64 k = 0; k < nv; k++) acc[k] = acc2[k] = _mm512_setzero_ps();
    i64 s = 0;
    if (vf) {
        for (; s + 2 <= n; s += 2) {
            __m512 ev = _mm512_set1_ps(row[s]), ev2 = _mm512_set1_ps(row[s + 1]);
            const float *vs = vf + s * D, *vs2 = vs + D;
            for (i64 k = 0; k < nv; k++) {
                acc[k] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(vs + 16 * k), acc[k]);
                acc2[k] = _mm512_fmadd_ps(ev2, _mm512_loadu_ps(vs2 + 16 * k), acc2[k]);
            }
        }
        if (s < n) {
            __m512 ev = _mm512_set1_ps(row[s]);
            for (i64 k = 0; k < nv; k++) acc[k] = _mm512_fmadd_ps(ev, _mm512_loadu_ps(vf + s * D + 16 * k), acc[k]);
        }
        __m512 iv = _mm512_set1_ps(inv);
        for (i64 k = 0; k < nv; k++) st16(o + 16 * k, _mm512_mul_ps(_mm512_add_ps(acc[k], acc2[k]), iv));
        return;
    }
    /* few rows per kv head (decode): values straight from BF16, 32 at a time: the even elements
     * are the low halves shifted up, the odd ones the high halves masked (exact float32 values);
     * acc[2c] / acc[2c + 1] hold the even / odd elements of chunk c */
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (; s + 2 <= n; s += 2) {
        __m512 ev = _mm512_set1_ps(row[s]), ev2 = _mm512_set1_ps(row[s + 1]);
        const bf16 *vs = vb + s * kv_t, *vs2 = vs + kv_t;
        for (i64 c = 0; c < nq; c++) {
            __m512i x = _mm512_loadu_si512(vs + 32 * c), x2 = _mm512_loadu_si512(vs2 + 32 * c);
            acc[2 * c] = _mm512_fmadd_ps(ev, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc[2 * c]);
            acc[2 * c + 1] = _mm512_fmadd_ps(ev, _mm512_castsi512_ps(_mm512_and_si512(x, hi)), acc[2 * c + 1]);
            acc2[2 * c] = _mm512_fmadd_ps(ev2, _mm512_castsi512_ps(_mm512_slli_epi32(x2, 16)), acc2[2 * c]);
            acc2[2 * c + 1] = _mm512_fmadd_ps(ev2, _mm512_castsi512_ps(_mm512_and_si512(x2, hi)),
                                              acc2[2 * c + 1]);
        }
    }
    if (s < n) {
        __m512 ev = _mm512_set1_ps(row[s]);
        for (i64 c = 0; c < nq; c++) {
            __m512i x = _mm512_loadu_si512(vb + s * kv_t + 32 * c);
            acc[2 * c] = _mm512_fmadd_ps(ev, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc[2 * c]);
            acc[2 * c + 1] = _mm512_fmadd_ps(ev, _mm512_castsi512_ps(_mm512_and_si512(x, hi)), acc[2 * c + 1]);
        }
    }
    __m512 iv = _mm512_set1_ps(inv);
    for (i64 c = 0; c < nq; c++) { /* round both halves to BF16 in place and interleave them back */
        __m512i e = rne_hi(_mm512_mul_ps(_mm512_add_ps(acc[2 * c], acc2[2 * c]), iv));
        __m512i od = rne_hi(_mm512_mul_ps(_mm512_add_ps(acc[2 * c + 1], acc2[2 * c + 1]), iv));
        _mm512_storeu_si512(o + 32 * c, _mm512_or_si512(_mm512_and_si512(od, hi), _mm512_srli_epi32(e, 16)));
    }
}
#else
#define FP4RL_ATTN_BF16 0
#endif

int cpu_attention(i64 B, i64 T, i64 H, i64 Hkv, i64 D, i64 start, const bf16 *q, const bf16 *k,
                  const bf16 *v, i64 kv_b, i64 kv_h, i64 kv_t, const uint8_t *real, i64 real_b, float scale,
                  bf16 *out) {
    i64 S = start + T, rep = H / Hkv;
    i64 Sp = (S + 15) & ~(i64)15;
    float *work = (float *)malloc(sizeof(float) * (size_t)(rep * (Sp + 2 * D) + D + S * D));
    if (!work) return -1;
    float *sc = work, *qf = work + rep * Sp, *acc = qf + rep * D, *kf = acc + rep * D;
#if FP4RL_ATTN_BF16
    if (D % 32 == 0 && D <= 256) {
        float *vf = kf + D; /* [S, D]: one kv head's values in float32 */
        for (i64 b = 0; b < B; b++)
            for (i64 hk = 0; hk < Hkv; hk++) {
                i64 off = b * kv_b + hk * kv_h;
                float *vfh = T * rep >= 8 ? vf : NULL; /* enough rows to share one float32 copy of V */
                if (vfh)
                    for (i64 s = 0; s < S; s++)
                        for (i64 d = 0; d < D; d += 16)
                            _mm512_storeu_ps(vf + s * D + d, ld16(v + off + s * kv_t + d));
                const uint8_t *rb = real ? real + b * real_b : NULL;
                if (!vfh && rep <= 4 && (D == 64 || D == 128)) { /* decode: the rep rows together */
                    for (i64 t = 0; t < T; t++) {
                        i64 qo = ((b * T + t) * H + hk * rep) * D;
#define FP4RL_GROUP(DD, RR) attn_group_bf16(DD, RR, start + t, q + qo, k + off, v + off, kv_t, rb, scale, sc, Sp, \
                                            out + qo)
                        if (D == 64) {
                            if (rep == 1) FP4RL_GROUP(64, 1); else if (rep == 2) FP4RL_GROUP(64, 2);
                            else if (rep == 3) FP4RL_GROUP(64, 3); else FP4RL_GROUP(64, 4);
                        } else {
                            if (rep == 1) FP4RL_GROUP(128, 1); else if (rep == 2) FP4RL_GROUP(128, 2);
                            else if (rep == 3) FP4RL_GROUP(128, 3); else FP4RL_GROUP(128, 4);
                        }
#undef FP4RL_GROUP
                    }
                    continue;
                }
                for (i64 t = 0; t < T; t++)
                    for (i64 h = hk * rep; h < (hk + 1) * rep; h++) {
                        i64 qo = ((b * T + t) * H + h) * D;
                        if (D == 64) /* constant head dims: loops unrolled, q and sums in registers */
                            attn_row_bf16(64, start + t, q + qo, k + off, v + off, vfh, kv_t, rb, scale, sc,
                                          out + qo);
                        else if (D == 128)
                            attn_row_bf16(128, start + t, q + qo, k + off, v + off, vfh, kv_t, rb, scale, sc,
                                          out + qo);
                        else
                            attn_row_bf16(D, start + t, q + qo, k + off, v + off, vfh, kv_t, rb, scale, sc,
                                          out + qo);
                    }
            }
        free(work);
        return 0;
    }
#endif
    for (i64 b = 0; b < B; b++)
        for (i64 hk = 0; hk < Hkv; hk++) {
            const bf16 *kb = k + b * kv_b + hk * kv_h, *vb = v + b * kv_b + hk * kv_h;
            const uint8_t *rb = real ? real + b * real_b : NULL;
            for (i64 t = 0; t < T; t++) {
                i64 p = start + t, n = p + 1;  /* keys 0..p */
                for (i64 r = 0; r < rep; r++) {
                    const bf16 *qr = q + ((b * T + t) * H + hk * rep + r) * D;
                    for (i64 d = 0; d < D; d++) qf[r * D + d] = bf2f(qr[d]);
                }
                /* scores */
                for (i64 s = 0; s < n; s++) {
                    int vis = s == p || !rb || rb[s];
                    if (!vis) {
                        for (i64 r = 0; r < rep; r++) sc[r * Sp + s] = -INFINITY;
                        continue;
                    }
                    const bf16 *ks = kb + s * kv_t;
                    i64 d = 0;
#if FP4RL_AVX512
                    if (D % 16 == 0) {
                        for (d = 0; d < D; d += 16) _mm512_storeu_ps(kf + d, ld16(ks + d));
                        for (i64 r = 0; r < rep; r++) {
                            __m512 a = _mm512_setzero_ps();
                            for (i64 e = 0; e < D; e += 16)
                                a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + e), _mm512_loadu_ps(kf + e), a);
                            sc[r * Sp + s] = _mm512_reduce_add_ps(a) * scale;
                        }
                        continue;
                    }
#endif
                    for (d = 0; d < D; d++) kf[d] = bf2f(ks[d]);
                    for (i64 r = 0; r < rep; r++) {
                        float a = 0.0f;
                        for (d = 0; d < D; d++) a += qf[r * D + d] * kf[d];
                        sc[r * Sp + s] = a * scale;
                    }
                }
                /* softmax numerators (in place) and sums */
                for (i64 r = 0; r < rep; r++) {
                    float *row = sc + r * Sp, m = -INFINITY, sum = 0.0f;
                    for (i64 s = 0; s < n; s++) m = row[s] > m ? row[s] : m;
                    if (m != m) m = 0.0f; /* NaN scores: keep them NaN below */
                    i64 s = 0;
#if FP4RL_AVX512
                    __m512 mv = _mm512_set1_ps(m), sv = _mm512_setzero_ps();
                    for (; s + 16 <= n; s += 16) {
                        __m512 x = _mm512_loadu_ps(row + s);
                        __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                        __m512 e = _mm512_maskz_mov_ps(~masked, exp16(_mm512_sub_ps(x, mv)));
                        _mm512_storeu_ps(row + s, e);
                        sv = _mm512_add_ps(sv, e);
                    }
                    sum = _mm512_reduce_add_ps(sv);
#endif
                    for (; s < n; s++) {
                        float e = row[s] == -INFINITY ? 0.0f : expf(row[s] - m);
                        row[s] = e;
                        sum += e;
                    }
                    for (i64 d = 0; d < D; d++) acc[r * D + d] = 0.0f;
                    qf[r * D] = 1.0f / sum; /* the query is no longer needed: keep 1/sum there */
                }
                /* weighted sum of values */
                for (i64 s = 0; s < n; s++) {
                    const bf16 *vs = vb + s * kv_t;
#if FP4RL_AVX512
                    if (D % 16 == 0) {
                        for (i64 d = 0; d < D; d += 16) _mm512_storeu_ps(kf + d, ld16(vs + d));
                        for (i64 r = 0; r < rep; r++) {
                            float e = sc[r * Sp + s];
                            if (e == 0.0f) continue;
                            __m512 ev = _mm512_set1_ps(e);
                            for (i64 d = 0; d < D; d += 16)
                                _mm512_storeu_ps(acc + r * D + d, _mm512_fmadd_ps(ev, _mm512_loadu_ps(kf + d),
                                                                                   _mm512_loadu_ps(acc + r * D + d)));
                        }
                        continue;
                    }
#endif
                    for (i64 d = 0; d < D; d++) kf[d] = bf2f(vs[d]);
                    for (i64 r = 0; r < rep; r++) {
                        float e = sc[r * Sp + s];
                        if (e == 0.0f) continue;
                        for (i64 d = 0; d < D; d++) acc[r * D + d] += e * kf[d];
                    }
                }
                for (i64 r = 0; r < rep; r++) {
                    bf16 *o = out + ((b * T + t) * H + hk * rep + r) * D;
                    float inv = qf[r * D];
                    for (i64 d = 0; d < D; d++) o[d] = f2bf(acc[r * D + d] * inv);
                }
            }
        }
    free(work);
    return 0;
}

/* ---- RoPE, the KV cache write and attention in one call (the plain BF16 cache) --------------------
 * cpu_rope_qkv into the cache buffers kc, vc at slots start.., then cpu_attention over slots
 * [0, start + T) of them; out [B, T, H, D]. Returns 0, or -1 when scratch memory runs out. */
int cpu_rope_attention(i64 B, i64 T, i64 H, i64 Hkv, i64 D, i64 start, const bf16 *q, i64 q_row, const bf16 *k,
                       i64 k_row, const bf16 *v, i64 v_row, const bf16 *cos, const bf16 *sin, bf16 *kc, bf16 *vc,
                       i64 kv_b, i64 kv_h, i64 kv_t, const uint8_t *real, i64 real_b, float scale, bf16 *out) {
    bf16 *q_rot = (bf16 *)malloc(sizeof(bf16) * (size_t)(B * T * H * D));
    if (!q_rot) return -1;
    cpu_rope_qkv(B, T, H, Hkv, D, q, q_row, k, k_row, v, v_row, cos, sin, q_rot, kc, vc, kv_b, kv_h, kv_t, start);
    int rc = cpu_attention(B, T, H, Hkv, D, start, q_rot, kc, vc, kv_b, kv_h, kv_t, real, real_b, scale, out);
    free(q_rot);
    return rc;
}

/* ---- a whole decode step of dense layers in one call ---------------------------------------------
 * The sequence FastCPUDecoder.forward runs per layer for one new token per row (T = 1), with every
 * linear a GEMM "site" of fp4rl/nvfp4/gemm_cpu.c (called through the function pointers it is given,
 * the kernels' own library): q/k/v fused, gate/up fused, a plain BF16 KV cache, no q/k norm:
 *     qkv = h @ Wqkv.T;  a = attention(RoPE(q), cache <- (RoPE(k), v));  x += a @ Wo.T; h = norm(x)
 *     gu = h @ Wgu.T;    x += (silu(g) * u) @ Wdown.T;  h = next_norm(x)
 * Same kernels, same order, same bits as the Python loop; only the per-call overhead goes.
 * step and layers are int64 records laid out by fp4rl/cpu_ops.py (DecodePlan); a site is
 * [kind (0 NVFP4, 1 BF16), ptr0..ptr3, bias, N, K]. Returns 0; -1 when attention's scratch memory runs
 * out, -2 for records of another layout, -3 when a GEMM refuses its arguments. */
typedef int (*nvfp4_gemm_fn)(const bf16 *x, i64 M, i64 K, i64 ldx, const uint8_t *codes, const uint8_t *scales,
                             const bf16 *tables, const int32_t *row_table, const bf16 *bias, i64 N, bf16 *y,
                             bf16 *x_vnni, bf16 *work);
typedef int (*bf16_gemm_fn)(const bf16 *x, i64 M, i64 K, i64 ldx, const bf16 *w, const bf16 *bias, i64 N, bf16 *y,
                            bf16 *x_vnni);

enum { ST_B, ST_START, ST_X, ST_H, ST_COS, ST_SIN, ST_REAL, ST_REAL_B, ST_HIDDEN, ST_H_Q, ST_H_KV, ST_D, ST_SCALE,
       ST_QKV, ST_A, ST_O, ST_GU, ST_ACT, ST_DOWN, ST_XV, ST_WORK, ST_NVFP4, ST_BF16, ST_I, ST_LEN };
enum { SITE = 8, LY_QKV = 0, LY_O = SITE, LY_GU = 2 * SITE, LY_DOWN = 3 * SITE, LY_POST_W = 4 * SITE, LY_POST_EPS,
       LY_NEXT_W, LY_NEXT_EPS, LY_KC, LY_VC, LY_KV_B, LY_KV_H, LY_KV_T, LY_LEN };

static float f32_bits(i64 v) {
    float f;
    uint32_t u = (uint32_t)v;
    memcpy(&f, &u, 4);
    return f;
}

static int site_gemm(const i64 *s, const i64 *st, const bf16 *x, bf16 *y) {
    const i64 M = st[ST_B], K = s[7], N = s[6];
    if (s[0] == 0)
        return ((nvfp4_gemm_fn)st[ST_NVFP4])(x, M, K, K, (const uint8_t *)s[1], (const uint8_t *)s[2],
                                               (const bf16 *)s[3], (const int32_t *)s[4], (const bf16 *)s[5], N, y,
                                               (bf16 *)st[ST_XV], (bf16 *)st[ST_WORK]);
    return ((bf16_gemm_fn)st[ST_BF16])(x, M, K, K, (const bf16 *)s[1], (const bf16 *)s[5], N, y, (bf16 *)st[ST_XV]);
}

int cpu_decode_layers(const i64 *st, i64 st_len, const i64 *layers, i64 ly_len, i64 n_layers) {
    if (st_len != ST_LEN || ly_len != LY_LEN) return -2; /* the Python side's records have another layout */
    const i64 B = st[ST_B], hidden = st[ST_HIDDEN], H = st[ST_H_Q], Hkv = st[ST_H_KV], D = st[ST_D], I = st[ST_I];
    const i64 nqkv = (H + 2 * Hkv) * D;
    bf16 *x = (bf16 *)st[ST_X], *h = (bf16 *)st[ST_H], *qkv = (bf16 *)st[ST_QKV], *a = (bf16 *)st[ST_A];
    bf16 *o = (bf16 *)st[ST_O], *gu = (bf16 *)st[ST_GU], *act = (bf16 *)st[ST_ACT], *dn = (bf16 *)st[ST_DOWN];
    for (i64 l = 0; l < n_layers; l++) {
        const i64 *ly = layers + l * LY_LEN;
        int rc = site_gemm(ly + LY_QKV, st, h, qkv);
        if (rc) return -3;
        rc = cpu_rope_attention(B, 1, H, Hkv, D, st[ST_START], qkv, nqkv, qkv + H * D, nqkv, qkv + (H + Hkv) * D,
                                nqkv, (const bf16 *)st[ST_COS], (const bf16 *)st[ST_SIN], (bf16 *)ly[LY_KC],
                                (bf16 *)ly[LY_VC], ly[LY_KV_B], ly[LY_KV_H], ly[LY_KV_T],
                                (const uint8_t *)st[ST_REAL], st[ST_REAL_B], f32_bits(st[ST_SCALE]), a);
        if (rc) return rc;
        if (site_gemm(ly + LY_O, st, a, o)) return -3;
        cpu_add_rms_norm(B, hidden, x, hidden, o, hidden, (const bf16 *)ly[LY_POST_W], f32_bits(ly[LY_POST_EPS]), h,
                         hidden);
        if (site_gemm(ly + LY_GU, st, h, gu)) return -3;
        cpu_silu_mul(B, I, gu, 2 * I, gu + I, 2 * I, act, I);
        if (site_gemm(ly + LY_DOWN, st, act, dn)) return -3;
        cpu_add_rms_norm(B, hidden, x, hidden, dn, hidden, (const bf16 *)ly[LY_NEXT_W], f32_bits(ly[LY_NEXT_EPS]), h,
                         hidden);
    }
    return 0;
}
