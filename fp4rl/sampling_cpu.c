/* The sampler's last step on the CPU, fused: from logits [B, V] (bfloat16 or float32) to one token
   per row and its logprob under log_softmax(logits / T), in three passes over each row.

   pass 1  m = max_i z_i (z = logits / T, divided as torch divides; argmax = the first index of m, as torch.argmax)
   pass 2  s = sum_i exp(z_i - m), in float32 per 16 lanes then float64 across lane groups
   pass 3  (sampling only) the inverse CDF: the first index i whose running sum of exp(z_j - m),
           j <= i, exceeds u * s, u ~ U[0, 1) given by the caller (drawn from a torch.Generator)
   logprob = z_token - (m + log s)

   exp is a degree-6 polynomial on [-ln2/2, ln2/2] after Cody-Waite range reduction (~2 ulp in
   float32), exact 0 below -87 (where float32 exp underflows anyway); z - m <= 0 always. The same
   arithmetic runs for every row and call, so a seed gives the same tokens on every run. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline __m512 load16(const void *p, int bf16, int64_t i, __mmask16 mask) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
}

static inline __m512 exp16(__m512 x) {  /* x <= 0 */
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(~tiny, y);
}

static inline float value(const void *p, int bf16, int64_t i) {
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* One row. u < 0: greedy (argmax); else sample with that uniform. Returns 0, or -1 on a non-finite
   maximum (NaN or +inf logits, all -inf): the caller falls back to torch, which raises or copes. */
static int row_head(const void *z, int bf16, int64_t V, float t, double u, int64_t *token, float *logprob) {
    const __m512 scale = _mm512_set1_ps(t);  /* z = logits / t, divided as torch divides */
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    __mmask16 nan = 0;
    for (; i + 16 <= V; i += 16) {
        __m512 x = _mm512_div_ps(load16(z, bf16, i, 0xFFFF), scale);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, x);
    }
    float m = _mm512_reduce_max_ps(vmax);
    for (; i < V; i++) {
        float v = value(z, bf16, i) / t;
        if (v != v) nan = 1;
        if (v > m) m = v;
    }
    if (nan) return -1;
    if (!(m > -INFINITY && m < INFINITY)) return -1;
    const __m512 vm = _mm512_set1_ps(m);
    int64_t argmax = V;  /* the first index holding m (NaNs never compare equal: the sum catches them) */
    for (i = 0; i + 16 <= V && argmax == V; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_div_ps(load16(z, bf16, i, 0xFFFF), scale), vm, _CMP_EQ_OQ);
        if (hit) argmax = i + __builtin_ctz((unsigned)hit);
    }
    for (; i < V && argmax == V; i++) {
        if (value(z, bf16, i) / t == m) argmax = i;
    }
    double total = 0.0;
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_div_ps(load16(z, bf16, i, 0xFFFF), scale), vm));
        total += (double)_mm512_reduce_add_ps(e);
    }
    if (i < V) {
        __mmask16 mask = (__mmask16)((1u << (V - i)) - 1u);
        __m512 x = _mm512_div_ps(load16(z, bf16, i, mask), scale);
        __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, vm)));
        total += (double)_mm512_reduce_add_ps(e);
    }
    if (!(total >= 1.0 && total < INFINITY)) return -1;  /* a NaN somewhere */
    int64_t tok = argmax;
    if (u >= 0.0) {  /* inverse CDF over the same exp values, block by block */
        const double target = u * total;
        double run = 0.0;
        tok = -1;
        for (i = 0; i < V; i += 16) {
            int64_t n = V - i < 16 ? V - i : 16;
            __mmask16 mask = (__mmask16)(n == 16 ? 0xFFFF : ((1u << n) - 1u));
            __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_div_ps(load16(z, bf16, i, mask), scale), vm)));
            double block = (double)_mm512_reduce_add_ps(e);
            if (run + block > target) {
                float lanes[16];
                _mm512_storeu_ps(lanes, e);
                for (int64_t j = 0; j < n; j++) {
                    run += (double)lanes[j];
                    if (run > target && lanes[j] > 0.0f) {
                        tok = i + j;
                        break;
                    }
                }
                if (tok >= 0) break;
            } else {
                run += block;
            }
        }
        if (tok < 0) {  /* rounding left u * total past the last positive term: take that term */
            for (i = V - 1; i >= 0; i--) {
                if (value(z, bf16, i) / t - m > -87.0f) break;
            }
            tok = i;
        }
    }
    *token = tok;
    *logprob = (float)((double)(value(z, bf16, tok) / t) - ((double)m + log(total)));
    return 0;
}

/* rows [r0, r1) of logits (row stride ld elements); uniforms NULL for greedy. Returns the first
   failing row + 1, or 0. */
int sampling_head(const void *logits, int bf16, int64_t r0, int64_t r1, int64_t V, int64_t ld, float t,
                  const double *uniforms, int64_t *tokens, float *logprobs) {
    for (int64_t r = r0; r < r1; r++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)logits + r * ld)
                               : (const void *)((const float *)logits + r * ld);
        if (row_head(row, bf16, V, t, uniforms ? uniforms[r] : -1.0, tokens + r, logprobs + r) != 0)
            return (int)(r + 1);
    }
    return 0;
}
