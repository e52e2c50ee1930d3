

#include <float.h>
#include <stdint.h>
#include <string.h>

/* dtype codes: 0 float32, 1 bfloat16, 2 float16 */

static inline float f32_of(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t bits_of(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static const float E2M1_SIGNED[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 16 consecutive elements as float32 (every conversion here is exact). */
static inline void load16(const void *x, int dtype, int64_t off, float *v) {
    if (dtype == 0) {
        const float *p = (const float *)x + off;
        for (int i = 0; i < 16; i++) v[i] = p[i];
    } else if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)x + off;
        for (int i = 0; i < 16; i++) v[i] = f32_of((uint32_t)p[i] << 16);
    } else {
        const _Float16 *p = (const _Float16 *)x + off;
        for (int i = 0; i < 16; i++) v[i] = (float)p[i];
    }
}

/* max |v| of 16 float32 values: the integer max of the sign-cleared bit patterns. */
static inline float absmax16(const float *v) {
    uint32_t m = 0;
    for (int i = 0; i < 16; i++) {
        uint32_t b = bits_of(v[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    return f32_of(m);
}

/* torch's v.clamp(max=448).to(float8_e4m3fn) for v >= 0: returns the value, sets the byte. */
static inline float e4m3_rn(float v, uint8_t *byte) {
    if (v != v) { *byte = 0x7F; return v; }
    if (v > 448.0f) v = 448.0f;
    if (v < 0x1p-6f) {  /* subnormal E4M3: a multiple of 2^-9, round half to even */
        float n = (v * 512.0f + 0x1p23f) - 0x1p23f;  /* exact scaling, then RNE to an integer */
        *byte = (uint8_t)n;                          /* 0..8; 8 is 2^-6, the first normal (0x08) */
        return n * 0x1p-9f;
    }
    uint32_t b = bits_of(v);
    b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;  /* RNE to 3 mantissa bits */
    *byte = (uint8_t)((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));
    return f32_of(b);
}

/* min(1 / (s * S_dec), FLT_MAX): format.block_encode_scale */
static inline float encode_factor(float s, float sdec) {
    float e = 1.0f / (s * sdec);
    return e > FLT_MAX ? FLT_MAX : e;
}

/* format.round_to_e2m1, nearest: threshold comparisons, sign bit only for z < 0; also the
   code's value (the same comparisons add exact dyadic steps), signed. */
static inline void encode16(const float *v, float e, uint32_t *c, float *q) {
    for (int i = 0; i < 16; i++) {
        float z = v[i] * e;
        float a = z < 0.0f ? -z : z;
        uint32_t m1 = a > 0.25f, m2 = a >= 0.75f, m3 = a > 1.25f, m4 = a >= 1.75f, m5 = a > 2.5f,
                 m6 = a >= 3.5f, m7 = a > 5.0f;
        float mag = (m1 ? 0.5f : 0.0f) + (m2 ? 0.5f : 0.0f) + (m3 ? 0.5f : 0.0f) + (m4 ? 0.5f : 0.0f)
                    + (m5 ? 1.0f : 0.0f) + (m6 ? 1.0f : 0.0f) + (m7 ? 2.0f : 0.0f);
        uint32_t neg = z < 0.0f;
        c[i] = (m1 + m2 + m3 + m4 + m5 + m6 + m7) | (neg << 3);
        q[i] = neg ? -mag : mag;
    }
}

/* reference._block_error's per-element errors of one block row (summed by the caller). */
static inline void error16(const float *v, const float *q, float s, float es, int es_is_amax,
                           int mae, float *e) {
    for (int i = 0; i < 16; i++) {
        float w = q[i] * s;
        float dec = es_is_amax ? (w * es) / 1536.0f : w * es;
        float d = dec - v[i];
        e[i] = mae ? (d < 0.0f ? -d : d) : d * d;
    }
}

/* left-to-right sum of 16 values */
static inline float sum16(const float *e) {
    float t = e[0];
    for (int i = 1; i < 16; i++) t = t + e[i];
    return t;
}

static inline void pack16(const uint32_t *c, uint8_t *out) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(c[2 * i] | (c[2 * i + 1] << 4));
}

/* max |x[r, :]|; sets *bad if any value is NaN or Inf. */
static inline float row_absmax(const void *x, int dtype, int64_t r, int64_t k, int *bad) {
    if (dtype == 0) {
        const uint32_t *p = (const uint32_t *)x + r * k;
        uint32_t m = 0;
        for (int64_t i = 0; i < k; i++) {
            uint32_t b = p[i] & 0x7FFFFFFFu;
            m = b > m ? b : m;
        }
        *bad |= m >= 0x7F800000u;
        return f32_of(m);
    }
    const uint16_t *p = (const uint16_t *)x + r * k;
    uint16_t m = 0;
    for (int64_t i = 0; i < k; i++) {
        uint16_t b = p[i] & 0x7FFFu;
        m = b > m ? b : m;
    }
    if (dtype == 1) {
        *bad |= m >= 0x7F80u;
        return f32_of((uint32_t)m << 16);
    }
    _Float16 h;
    memcpy(&h, &m, 2);
    *bad |= m >= 0x7C00u;
    return (float)h;
}

/* Pass 1: amax[r] = max |x[r, :]| for rows r0..r1-1; returns 1 if any value is NaN or Inf. */
int nvfp4_row_amax(const void *x, int dtype, int64_t r0, int64_t r1, int64_t k, float *amax) {
    int bad = 0;
    for (int64_t r = r0; r < r1; r++) amax[r] = row_absmax(x, dtype, r, k, &bad);
    return bad;
}

/* reference.global_scales_from_amax for one amax: S_enc, the S_dec used for encoding, g. */
static inline void scales_from_amax(float amax, float m, float *enc, float *sdec, float *g) {
    float e = m / amax;
    e = e > FLT_MAX ? FLT_MAX : e;
    if (amax == 0.0f || e == 0.0f) e = 1.0f;
    *enc = e;
    *sdec = 1.0f / e;
    *g = amax / m;
}

/* Pass 2: rows r0..r1-1 (multiples of 16 for 16x16 tiles) -> packed codes, E4M3 bytes, and the
   stored decode-direction global scale g_out[r * gstride] (written by the chunk holding row 0
   when gstride is 0). Global scales come from (mode)
     0: each row's own amax, computed here (scale_scope "row");
     1: an amax src[r * gstride] (the tensor's, or imposed): 4/6 errors ((q*s)*amax)/M;
     2: an imposed decode scale g = src[r * gstride]: S_dec = g, S_enc = min(1/g, FLT_MAX),
        4/6 errors (q*s)*g.
   m: 2688 (rule 6) or 1536 (4/6). Returns 1 if any value is NaN or Inf (outputs are then
   incomplete: the caller uses the reference). */
int nvfp4_quantize_rows(const void *x, int dtype, int64_t r0, int64_t r1, int64_t k, int tile16,
                        int rule46, int mae, int mode, const float *src, int64_t gstride, float m,
                        float one_sixth, uint8_t *data, uint8_t *scale, float *g_out) {
    const int64_t nb = k / 16;
    int bad = 0;
    float en = 1.0f, sd = 1.0f, ee = 1.0f;
    const int es_is_amax = mode != 2;
    if (mode != 0 && gstride == 0) {
        float g;
        if (mode == 1) {
            scales_from_amax(src[0], m, &en, &sd, &g);
            ee = src[0];
        } else {
            g = src[0];
            en = 1.0f / g;
            en = en > FLT_MAX ? FLT_MAX : en;
            sd = ee = g;
        }
        if (r0 == 0) g_out[0] = g;
    }
    if (!tile16) {
        /* groups of up to 16 blocks of one row: the 4/6 error sums of a group run as 16
           independent left-to-right chains */
        for (int64_t r = r0; r < r1; r++) {
            if (mode == 0) {
                float a = row_absmax(x, dtype, r, k, &bad);
                scales_from_amax(a, m, &en, &sd, &g_out[r]);
                ee = a;
            } else if (gstride) {
                if (mode == 1) {
                    scales_from_amax(src[r], m, &en, &sd, &g_out[r]);
                    ee = src[r];
                } else {
                    en = 1.0f / src[r];
                    en = en > FLT_MAX ? FLT_MAX : en;
                    sd = ee = g_out[r] = src[r];
                }
            }
            const float en6 = en * one_sixth;
            for (int64_t j0 = 0; j0 < nb; j0 += 16) {
                const int ng = nb - j0 < 16 ? (int)(nb - j0) : 16;
                float v[16][16], q[16][16], q4[16][16], e6[16][16], e4[16][16];
                uint32_t c[16][16], c4[16][16];
                float s6[16], s4[16];
                uint8_t b6[16], b4[16];
                for (int j = 0; j < ng; j++) {
                    load16(x, dtype, r * k + (j0 + j) * 16, v[j]);
                    float bam = absmax16(v[j]);
                    bad |= !(bam <= FLT_MAX);
                    if (!rule46) {
                        s6[j] = e4m3_rn(bam * en6, &b6[j]);
                        encode16(v[j], encode_factor(s6[j], sd), c[j], q[j]);
                    } else {
                        float base = (bam / 6.0f) * en;
                        s6[j] = e4m3_rn(base, &b6[j]);
                        s4[j] = e4m3_rn(base * 1.5f, &b4[j]);
                        encode16(v[j], encode_factor(s6[j], sd), c[j], q[j]);
                        encode16(v[j], encode_factor(s4[j], sd), c4[j], q4[j]);
                        error16(v[j], q[j], s6[j], ee, es_is_amax, mae, e6[j]);
                        error16(v[j], q4[j], s4[j], ee, es_is_amax, mae, e4[j]);
                    }
                }
                if (rule46) {
                    float t6[16], t4[16];
                    for (int j = 0; j < ng; j++) { t6[j] = e6[j][0]; t4[j] = e4[j][0]; }
                    for (int i = 1; i < 16; i++)
                        for (int j = 0; j < ng; j++) { t6[j] = t6[j] + e6[j][i]; t4[j] = t4[j] + e4[j][i]; }
                    for (int j = 0; j < ng; j++) {
                        if (t4[j] < t6[j]) {
                            b6[j] = b4[j];
                            memcpy(c[j], c4[j], sizeof c[j]);
                        }
                    }
                }
                for (int j = 0; j < ng; j++) {
                    scale[r * nb + j0 + j] = b6[j];
                    pack16(c[j], data + r * (k / 2) + (j0 + j) * 8);
                }
            }
        }
        return bad;
    }
    /* 16x16 tiles: one scale per tile; per-tensor global scale only (gstride 0, mode 1 or 2). */
    const float en6 = en * one_sixth;
    for (int64_t t = r0; t < r1; t += 16) {
        for (int64_t j = 0; j < nb; j++) {
            float v[16][16], q[16][16];
            uint32_t c[16][16];
            float bam = 0.0f;
            for (int i = 0; i < 16; i++) {
                load16(x, dtype, (t + i) * k + j * 16, v[i]);
                float a = absmax16(v[i]);
                bad |= !(a <= FLT_MAX);  /* a NaN row max: the compare below would drop it */
                bam = a > bam ? a : bam;
            }
            bad |= !(bam <= FLT_MAX);
            uint8_t byte;
            if (!rule46) {
                float s = e4m3_rn(bam * en6, &byte);
                float e = encode_factor(s, sd);
                for (int i = 0; i < 16; i++) encode16(v[i], e, c[i], q[i]);
            } else {
                uint8_t b6, b4;
                uint32_t c4[16][16];
                float q4[16][16];
                float base = (bam / 6.0f) * en;
                float s6 = e4m3_rn(base, &b6), s4 = e4m3_rn(base * 1.5f, &b4);
                float e6 = encode_factor(s6, sd), e4 = encode_factor(s4, sd);
                float err6[16], err4[16];
                for (int i = 0; i < 16; i++) {
                    encode16(v[i], e6, c[i], q[i]);
                    encode16(v[i], e4, c4[i], q4[i]);
                    float e[16];
                    error16(v[i], q[i], s6, ee, es_is_amax, mae, e);
                    err6[i] = sum16(e);
                    error16(v[i], q4[i], s4, ee, es_is_amax, mae, e);
                    err4[i] = sum16(e);
                }
                for (int h = 8; h >= 1; h /= 2) {  /* rows 0-7 + 8-15, 0-3 + 4-7, 0-1 + 2-3, 0 + 1 */
                    for (int i = 0; i < h; i++) {
                        err6[i] = err6[i] + err6[i + h];
                        err4[i] = err4[i] + err4[i + h];
                    }
                }
                byte = b6;
                if (err4[0] < err6[0]) {
                    byte = b4;
                    memcpy(c, c4, sizeof c);
                }
            }
            for (int i = 0; i < 16; i++) {
                scale[(t + i) * nb + j] = byte;
                pack16(c[i], data + (t + i) * (k / 2) + j * 8);
            }
        }
    }
    return bad;
}

/* Dequantize rows r0..r1-1: out = (e2m1[code] * e4m3[byte]) * g[r * gstride], as float32
   (out_dtype 0) or bfloat16 (1, round to nearest even as torch's cast). Each block's 16
   possible values are computed once, in that order, then looked up. Returns 1 (output
   incomplete: the caller uses the reference) if a NaN could appear (a NaN scale byte, a NaN
   or infinite g): torch's casts do not agree with each other on NaN bits. */
int nvfp4_dequantize_rows(const uint8_t *data, const uint8_t *scale, const float *g,
                          int64_t gstride, const float *e4m3_table, int64_t r0, int64_t r1,
                          int64_t k, int out_dtype, void *out) {
    const int64_t nb = k / 16;
    for (int64_t r = r0; r < r1; r++) {
        const float gr = g[r * gstride];
        if (gr != gr || gr > FLT_MAX || gr < -FLT_MAX) return 1;
        for (int64_t j = 0; j < nb; j++) {
            const float s = e4m3_table[scale[r * nb + j]];
            if (s != s) return 1;
            float t[16];
            for (int c = 0; c < 16; c++) t[c] = (E2M1_SIGNED[c] * s) * gr;
            const uint8_t *d = data + r * (k / 2) + j * 8;
            if (out_dtype == 0) {
                float *o = (float *)out + r * k + j * 16;
                for (int i = 0; i < 8; i++) {
                    o[2 * i] = t[d[i] & 15];
                    o[2 * i + 1] = t[d[i] >> 4];
                }
            } else {
                uint16_t tb[16];
                for (int c = 0; c < 16; c++) {
                    uint32_t b = bits_of(t[c]);
                    tb[c] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
                }
                uint16_t *o = (uint16_t *)out + r * k + j * 16;
                for (int i = 0; i < 8; i++) {
                    o[2 * i] = tb[d[i] & 15];
                    o[2 * i + 1] = tb[d[i] >> 4];
                }
            }
        }
    }
    return 0;
}

/* Test hooks: the two roundings on their own (tests/test_nvfp4_cpu.py sweeps them against
   torch's cast and format.round_to_e2m1). v >= 0 for the E4M3 one; n a multiple of 16. */
void nvfp4_cast_e4m3(const float *v, int64_t n, uint8_t *byte, float *value) {
    for (int64_t i = 0; i < n; i++) value[i] = e4m3_rn(v[i], &byte[i]);
}

void nvfp4_round_e2m1(const float *z, int64_t n, uint8_t *code, float *value) {
    for (int64_t i = 0; i < n; i += 16) {
        uint32_t c[16];
        encode16(z + i, 1.0f, c, value + i);
        for (int j = 0; j < 16; j++) code[i + j] = (uint8_t)c[j];
    }
}
