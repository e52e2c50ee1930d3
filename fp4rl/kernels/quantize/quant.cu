// NVFP4 quantize in CUDA C++ (1x16 blocks and 16x16 tiles, round to nearest): the reference's arithmetic
// (fp4rl/nvfp4/reference.py, TransformerEngine's order), so the same bytes, in fewer instructions per
// element than the Triton kernels (which are issue-bound at ~22-35 per element on an H200).
//
// Compiled by NVRTC at run time (fp4rl/kernels/quantize/cuda.py prepends the #defines):
//   RULE46     0: scale rule 6, 1: rule 4/6 (both candidates, the lower error wins, a tie keeps 6)
//   MAE        4/6 error: 0 summed squares, 1 summed absolute values
//   NONFINITE  1: NaN -> code 0, +-Inf -> +-6, amaxes over the finite values (allow_nonfinite)
//   SRC        0: amax of the tensor from nvfp4_amax's parts, 1: per-row amax (nvfp4_quant_rows),
//              2: imposed amax, 3: imposed decode-direction global scale g
//   GIVEN_ROWS SRC 2/3: one imposed value per row instead of one for the tensor
//   IN_F32     1: float32 input, 0: bfloat16
//   FAST46     rule 4/6: decide most blocks from a cheaper error with a proven bound, the exact errors only
//              where the bound cannot (see decide46): 2 with both candidates' codes packed in the same pass,
//              1 with the winner's codes in a pass of their own; 0: the exact errors of every block;
//              3: FAST46 2's arithmetic in fewer instructions for the blocks where it allows (see lean46), the
//              rest as FAST46 2
//   BPT, TPR, CTA  nvfp4_quant_rows: blocks per thread, threads per row (a power of two), threads per CTA
//   RELOAD     nvfp4_quant_rows: 1 reads each block twice (the row max, then one block at a time to quantize,
//              from L1 / L2) instead of holding all BPT blocks in registers
//   MINB       CTAs per SM the registers must allow (__launch_bounds__; cuda.py's table, no spills)
//
// Every float operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fmaf_rn where an
// FMA is meant: an exact product plus a constant, or the corrected division by 1536; __fdiv_rn, __frcp_rn): no contraction, no approximate division, whatever the
// compiler's flags. One 16-element block per thread: two 16-byte loads, the block max, the scale, the codes
// packed into one 8-byte store and the E4M3 scale byte; nothing crosses threads except the row max.

typedef unsigned int u32;

#define FLT_MAX_F 3.4028234663852886e38f
#define ONE_SIXTH_F 0.1666666716337204f  // fp32(1/6), as TE folds it
#ifndef CTA
#define CTA 256
#endif
#ifndef MINB
#define MINB 1
#endif
#ifndef RELOAD
#define RELOAD 0
#endif
#ifndef FAST46
#define FAST46 3  // cuda.py's default (it always defines it)
#endif
#define GENERAL46 (FAST46 == 3 ? 2 : FAST46)  // the path of the blocks that FAST46 3's lean46 leaves

struct Raw {  // one block: 16 values as float32 bit patterns' sources
#if IN_F32
  uint4 q[4];
#else
  uint4 q[2];
#endif
};

__device__ __forceinline__ void load_block(const void* __restrict__ x, long long blk, Raw& r) {
#if IN_F32
  const uint4* p = reinterpret_cast<const uint4*>(x) + blk * 4;
  r.q[0] = __ldg(p); r.q[1] = __ldg(p + 1); r.q[2] = __ldg(p + 2); r.q[3] = __ldg(p + 3);
#else
  const uint4* p = reinterpret_cast<const uint4*>(x) + blk * 2;
  r.q[0] = __ldg(p); r.q[1] = __ldg(p + 1);
#endif
}

__device__ __forceinline__ u32 word4(const uint4& q, int w) {  // w-th 32-bit word (0-3) of 16 bytes
  return w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w;
}

__device__ __forceinline__ u32 word(const Raw& r, int w) {  // w-th 32-bit word of the block
  return word4(r.q[w >> 2], w & 3);
}

// value i of a run of input values as float32, given the 32-bit word that holds it (bfloat16: two a word)
__device__ __forceinline__ float value_in(u32 w, int i) {
#if IN_F32
  return __uint_as_float(w);
#else
  return __uint_as_float((i & 1) ? (w & 0xFFFF0000u) : (w << 16));
#endif
}

// element i of the block as float32
__device__ __forceinline__ float elem(const Raw& r, int i) {
  return value_in(word(r, IN_F32 ? i : i >> 1), i);
}

// max |x| over the block as float32 bit patterns: raw (NaN/Inf included), fin (the finite values: the row and
// tensor amaxes, in every mode) and bmax (the block scale's max: fin with NONFINITE; without it, as the Triton
// kernels and the fused decode kernels take it, the max over the non-NaN values, Inf included, and NaN when
// all 16 are NaN: those bytes are refused by the caller's check but the engine quantizes without one, and the
// fused and unfused paths must agree). The NaN/Inf cases take a branch that ordinary blocks skip.
__device__ __forceinline__ void block_max_bits(const Raw& r, u32& raw, u32& fin, u32& bmax) {
#if IN_F32
  raw = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) raw = max(raw, word(r, i) & 0x7FFFFFFFu);
  fin = bmax = raw;
  if (raw >= 0x7F800000u) {
    u32 f = 0, nn = 0;
    bool any = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      u32 b = word(r, i) & 0x7FFFFFFFu;
      f = max(f, b >= 0x7F800000u ? 0u : b);
      nn = max(nn, b > 0x7F800000u ? 0u : b);
      any |= b <= 0x7F800000u;
    }
    fin = f;
    bmax = NONFINITE ? f : (any ? nn : 0x7FC00000u);
  }
#else
  u32 m = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) m = __vmaxu2(m, word(r, w) & 0x7FFF7FFFu);  // |bf16| pairs as u16 halves
  raw = max(m & 0xFFFFu, m >> 16) << 16;
  fin = bmax = raw;
  if (raw >= 0x7F800000u) {
    u32 f = 0, nn = 0, any = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      u32 b = word(r, w) & 0x7FFF7FFFu;
      f = __vmaxu2(f, b & __vcmpltu2(b, 0x7F807F80u));  // NaN/Inf halves -> 0
      u32 keep = __vcmpltu2(b, 0x7F817F81u);            // non-NaN halves
      nn = __vmaxu2(nn, b & keep);
      any |= keep;
    }
    fin = max(f & 0xFFFFu, f >> 16) << 16;
    bmax = NONFINITE ? fin : (any ? max(nn & 0xFFFFu, nn >> 16) << 16 : 0x7FC00000u);
  }
#endif
}

__device__ __forceinline__ float e4m3_round(float v) {  // v >= 0 -> nearest E4M3 of min(v, 448), ties even
  v = fminf(v, 448.0f);
  int b = __float_as_int(v);
  float normal = __int_as_float((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576);
  float sub = __fmul_rn(__fadd_rn(__fadd_rn(__fmul_rn(v, 512.0f), 8388608.0f), -8388608.0f), 0.001953125f);
  return v >= 0.015625f ? normal : sub;
}

__device__ __forceinline__ u32 e4m3_bits(float r) {  // an exact E4M3 value -> its bit pattern
  int b = __float_as_int(r);
  return r >= 0.015625f ? (u32)((((b >> 23) - 120) << 3) | ((b >> 20) & 7)) : (u32)(int)(r * 512.0f);
}

// a = min(|z|, 6) -> E2M1 code magnitude (0..7) + BIAS, round half to even; ev: its E2M1 value. The bias
// is taken off once per packed word (code words are sums of nibbles << 4i, so BIAS * 0x11111111 in all).
// One FADD rounds a at its binade's E2M1 step: M = 2^(e + 22) with e = max(exponent of a, 0) has ulp
// 2^(e - 1) (0.5 below 2, 1 below 4, 2 above), so t = a + M is M + j ulp with j = rint(a / 2^(e - 1)) (RNE);
// j is t's mantissa field and the code is j + 2e, t's exponent field (>> 22) giving 2e + BIAS (checked
// against the reference on every float32 |z| < 7). ~10% faster on an H200 than the Triton kernels' form
// (rint(a * mult), mult = 2, 1, 1/2 selected by two comparisons), which is ALU-bound.
#define BIAS 298u
__device__ __forceinline__ u32 e2m1_mag(float a, float& ev) {
  u32 e = max(__float_as_uint(a) & 0x7F800000u, 0x3F800000u);
  float m = __uint_as_float(e + (22u << 23));
  float t = __fadd_rn(a, m);
  u32 tb = __float_as_uint(t);
  ev = __fadd_rn(t, -m);
  return (tb & 0x7FFFFFu) + (tb >> 22);
}

// z (scaled) -> E2M1 code + BIAS with its sign bit (z < 0: -0.0 keeps code 0, a negative z that rounds to 0
// gets 8); NONFINITE: NaN -> code 0. ev: the magnitude's E2M1 value (the 4/6 error is the same with |x| and
// |value|: every step of ((value * s) * amax) / 1536 - x is symmetric under a sign flip of both).
__device__ __forceinline__ u32 e2m1(float z, float& ev) {
  u32 idx = e2m1_mag(fminf(fabsf(z), 6.0f), ev);
#if NONFINITE
  if (z != z) idx = BIAS;
#endif
  return idx + (z < 0.0f ? 8u : 0u);
}

__device__ __forceinline__ float div1536(float v) {  // fp32(v / 1536), exact for the amaxes that take it
  const float c = 6.510416860692203e-04f;  // fp32(1/1536)
  float q = __fmul_rn(v, c);
  float r = __fmaf_rn(-q, 1536.0f, v);
  return __fmaf_rn(r, c, q);
}

struct Scales {  // per tensor or per row
  float enc;     // S_enc
  float dec;     // S_dec (encoding only)
  float g;       // stored decode-direction scale
  float err;     // 4/6 error decode: amax (divided by 1536 after) or, SRC 3, g
  bool fast;     // 4/6: the division-free x / 1536 is exact for this amax
};

// the amax (or, SRC 3, g) range where decide46's bound holds: every decoded value and difference normal
#define BOUND_LO 8.470329472543003e-22f  // 2^-70
#define BOUND_HI 1.2676506002282294e30f  // 2^100

__device__ __forceinline__ Scales scales_from(float v) {  // v: amax (SRC 0-2) or imposed g (SRC 3)
  Scales s;
#if SRC == 3
  s.g = v; s.dec = v; s.enc = fminf(__frcp_rn(v), FLT_MAX_F); s.err = v;
  s.fast = v >= BOUND_LO && v <= BOUND_HI;  // SRC 3 needs no division; this only gates decide46
#else
  const float m = RULE46 ? 1536.0f : 2688.0f;
  float enc = fminf(__fdiv_rn(m, v), FLT_MAX_F);
  if (v == 0.0f || enc == 0.0f) enc = 1.0f;
  s.enc = enc; s.dec = __frcp_rn(enc); s.g = __fdiv_rn(v, m); s.err = v;
  s.fast = v >= BOUND_LO && v <= BOUND_HI;
#endif
  return s;
}

__device__ __forceinline__ float enc_for(float s, const Scales& sc) {  // min(1 / (s * S_dec), FLT_MAX)
  return fminf(__frcp_rn(__fmul_rn(s, sc.dec)), FLT_MAX_F);
}

// the block's 16 codes for encode factor enc, packed (element i in nibble i)
__device__ __forceinline__ uint2 codes_of(const Raw& r, float enc) {
  u32 w0 = 0, w1 = 0;
  float unused;
#pragma unroll
  for (int i = 0; i < 8; ++i) w0 += e2m1(__fmul_rn(elem(r, i), enc), unused) << (4 * i);
#pragma unroll
  for (int i = 0; i < 8; ++i) w1 += e2m1(__fmul_rn(elem(r, 8 + i), enc), unused) << (4 * i);
  return make_uint2(w0 - BIAS * 0x11111111u, w1 - BIAS * 0x11111111u);
}

// one element's term of a 4/6 candidate's error: (decoded - x)^2 or |decoded - x|, decoded = ((value * s) *
// amax) / 1536 (SRC 3: (value * s) * g); the division division-free when FAST
template <bool FAST>
__device__ __forceinline__ float error_term(float x, float s, float enc, const Scales& sc) {
  float ev;
  e2m1_mag(fminf(fabsf(__fmul_rn(x, enc)), 6.0f), ev);
  const float v = __fmul_rn(ev, s);
#if SRC == 3
  const float dq = __fmul_rn(v, sc.err);
#else
  const float dq = FAST ? div1536(__fmul_rn(v, sc.err)) : __fdiv_rn(__fmul_rn(v, sc.err), 1536.0f);
#endif
  const float d = __fadd_rn(dq, -fabsf(x));
  return MAE ? fabsf(d) : __fmul_rn(d, d);
}

// one 4/6 candidate's error: the sum, left to right, of its terms over the block
template <bool FAST>
__device__ __forceinline__ float candidate_error(const Raw& r, float s, float enc, const Scales& sc) {
  float err = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float e = error_term<FAST>(elem(r, i), s, enc, sc);
    err = i == 0 ? e : __fadd_rn(err, e);
  }
  return err;
}

// both errors with IEEE division (amaxes outside 2^-70 .. 2^100: rare), out of line so that its registers
// do not weigh on the common path
__device__ __noinline__ void errors_ieee(const Raw r, float s6, float enc6, float s4, float enc4, const Scales sc,
                                         float* e6, float* e4) {
  *e6 = candidate_error<false>(r, s6, enc6, sc);
  *e4 = candidate_error<false>(r, s4, enc4, sc);
}

// both exact errors, division-free (FAST46: the blocks decide46 leaves, out of line as errors_ieee)
__device__ __noinline__ void errors_exact(const Raw r, float s6, float enc6, float s4, float enc4, const Scales sc,
                                          float* e6, float* e4) {
  *e6 = candidate_error<true>(r, s6, enc6, sc);
  *e4 = candidate_error<true>(r, s4, enc4, sc);
}

// FAST46: one candidate's error in units of its own decode step, E = sum (ev - |z|)^2 (MAE: sum |ev - |z||) over
// z = x * enc, the encoded values the codes round (ev: their E2M1 values, the reference's). Two chains of 8
// (even and odd elements, added at the end). 9 instructions per element against the exact error's 15: no
// decode (value * s * amax / 1536) and no x-domain difference.
// FAST46 2: the candidate's codes too (codes_of's, from the same rounding: e2m1 is e2m1_mag plus the sign).
__device__ __forceinline__ float approx_error(const Raw& r, float enc, uint2& codes) {
  float acc[2] = {0.0f, 0.0f};
  u32 w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float z = __fmul_rn(elem(r, i), enc);
    float za = fabsf(z);
    float ev;
#if GENERAL46 == 2
    w[i >> 3] += e2m1(z, ev) << (4 * (i & 7));
#else
    e2m1_mag(fminf(za, 6.0f), ev);
#endif
    float d = __fadd_rn(ev, -za);
    acc[i & 1] = MAE ? __fadd_rn(acc[i & 1], fabsf(d)) : __fmaf_rn(d, d, acc[i & 1]);
  }
  codes = make_uint2(w[0] - BIAS * 0x11111111u, w[1] - BIAS * 0x11111111u);
  return __fadd_rn(acc[0], acc[1]);
}

// FAST46: the reference's choice (e4 < e6) from the approximate errors E6, E4, or false when they cannot tell.
// Let sigma = s * amax / 1536 (SRC 3: s * g), X_i = |x_i| / sigma and R_i = ev_i - X_i (exact reals). With
// u = 2^-24 the unit roundoff, the reference's decoded value (ev s amax) / 1536 is ev sigma (1 + eta), |eta| <=
// 2u; the encode factor 1 / fl(s fl(1 / fl(1536 / amax))) is (1 + theta) / sigma, |theta| <= 4u, so |z| =
// X (1 + phi), |phi| <= 5u. Then d / sigma (the reference's rounded difference) and fl(ev - |z|) are both
// within eps_i <= 6.04 u X_i of R_i, using |R_i| <= X_i (1 + 10u) (ev is the E2M1 value nearest |z| and 0 is
// one; a clamped |z| > 6 has ev = 6).
// MSE: |d^2 / sigma^2 - R^2| and |r^2 - R^2| <= eps (2|R| + eps); the two ordered sums of 16 nonnegative terms
// are within 16u of their exact sums; so |e_ref / sigma^2 - E| <= 24.2u sum X|R| + 33u E + O(u^2 X^2), and
// sum X|R| <= Xmax sum |R| <= 4 Xmax sqrt(sum R^2) <= 8 Xmax sqrt(E) + 800u Xmax^2. Bound used (each term
// twice that): B = u (400 Xmax sqrt(E) + 70 E) + 45000 u^2 Xmax^2 + 2^-60. MAE (e_ref / sigma, sums of |d|):
// |e_ref / sigma - E| <= 12.1u sum X + 33u E <= 194u Xmax + 33u E: B = u (400 Xmax + 70 E) + 1000 u^2 Xmax +
// 2^-60. Then e_ref = sigma^2 (E +- B) (MAE: sigma (E +- B)); the factor (amax / 1536)^2 (or g^2) is common to
// both candidates, so e4 < e6 for certain when s4^2 (E4 + B4) < s6^2 (E6 - B6) (MAE: s, not s^2), with
// 2^-20 of slack for the float products here; e6 < e4 for certain in the mirror case (the reference keeps
// 6 on a tie: only a strict e6 < e4 decides it). Xmax = fl(bamax * enc) (1 + 2^-20) >= max X. Valid when
// amax (SRC 3: g) is in 2^-70..2^100 (sc.fast), bamax in 2^-40..2^40, s4, s6 >= 2^-9 (no zero scale) and
// enc4, enc6 unclamped: the decoded values are normal, and a reference square d^2 that falls below the normal
// range (an absolute error of at most 2^-150 a term) is at most 2^-59.7 in units of sigma^2 (sigma >=
// bamax / 9 >= 2^-43.2), far inside 45000 u^2 Xmax^2. A NaN or Inf anywhere makes every comparison false.
// The arithmetic here (and Xmax) uses plain operators: NVRTC may contract them into FMAs, which the factor 2
// and the 2^-20 slack absorb (the host build in the tests does not contract: its decisions may differ from
// the GPU's only where both are certain). Tests: tests/test_quant_fast46.py (this file compiled for the CPU:
// near ties by bisection, blocks on both candidates' grids moved by ulps, NaN / Inf / -0.0, the guards'
// edges) and the GPU tests in tests/test_quant_cuda.py.
__device__ __forceinline__ bool decide46(float e6, float e4, float s6, float s4, float xm6, float xm4,
                                         bool& pick4) {
  const float U = 5.9604644775390625e-08f;  // 2^-24
  const float T = 8.673617379884035e-19f;   // 2^-60
#if MAE
  const float b6 = U * (400.0f * xm6 + 70.0f * e6) + 1000.0f * U * U * xm6 + T;
  const float b4 = U * (400.0f * xm4 + 70.0f * e4) + 1000.0f * U * U * xm4 + T;
  const float w6 = s6, w4 = s4;
#else
  // sqrt(E) as E / sqrt(E) with the hardware's reciprocal square root (relative error < 2^-21, inside the
  // bound's factor 2; E = 0 gives 0, a subnormal E that it flushes gives Inf: that block goes exact)
  const float r6 = e6 > 0.0f ? e6 * rsqrtf(e6) : 0.0f, r4 = e4 > 0.0f ? e4 * rsqrtf(e4) : 0.0f;
  const float b6 = U * (400.0f * xm6 * r6 + 70.0f * e6) + 45000.0f * U * U * xm6 * xm6 + T;
  const float b4 = U * (400.0f * xm4 * r4 + 70.0f * e4) + 45000.0f * U * U * xm4 * xm4 + T;
  const float w6 = s6 * s6, w4 = s4 * s4;
#endif
  const float up = 1.00000095367431640625f, dn = 0.99999904632568359375f;  // 1 +- 2^-20
  const float hi6 = w6 * (e6 + b6) * up, lo6 = w6 * (e6 - b6) * dn;
  const float hi4 = w4 * (e4 + b4) * up, lo4 = w4 * (e4 - b4) * dn;
  if (hi4 < lo6) { pick4 = true; return true; }
  if (hi6 < lo4) { pick4 = false; return true; }
  return false;
}

#if RULE46
// rule 4/6's two candidates for a block (or tile) of max amax: scales s6 = e4m3((amax / 6) S_enc), s4 =
// e4m3(1.5 that), and their encode factors (IEEE, as the reference)
__device__ __forceinline__ void candidates46(const Scales& sc, float amax, float& s6, float& s4, float& enc6,
                                             float& enc4) {
  const float base = __fmul_rn(__fdiv_rn(amax, 6.0f), sc.enc);
  s6 = e4m3_round(base);
  s4 = e4m3_round(__fmul_rn(base, 1.5f));
  enc6 = enc_for(s6, sc);
  enc4 = enc_for(s4, sc);
}

// rule 4/6, one block: codes (8 bytes) and the E4M3 scale bits. The error of each candidate, then the codes of
// the winner only (its encode factor, so the same codes as the candidate's); FAST46 2 (and FAST46 3's blocks
// that lean46 leaves): both candidates' codes from decide46's pass, the winner's kept.
__device__ __forceinline__ void quantize46(const Raw& r, const Scales& sc, float bamax, uint2& codes, u32& sbits) {
  float s6, s4, enc6, enc4;
  candidates46(sc, bamax, s6, s4, enc6, enc4);
  float e6, e4;
  bool pick4;
#if GENERAL46
  bool known = false;
  uint2 c6, c4;
  const bool in_range = sc.fast && bamax >= 9.094947017729282e-13f && bamax <= 1.099511627776e12f &&
                        s6 >= 0.001953125f && enc6 < FLT_MAX_F && enc4 < FLT_MAX_F;  // bamax 2^-40..2^40, s4 >= s6
  if (GENERAL46 == 2 || in_range) {  // FAST46 2: every block, for the codes
    const float xs = 1.00000095367431640625f;  // 1 + 2^-20
    const float a6 = approx_error(r, enc6, c6), a4 = approx_error(r, enc4, c4);
    if (in_range) known = decide46(a6, a4, s6, s4, __fmul_rn(bamax, enc6) * xs, __fmul_rn(bamax, enc4) * xs, pick4);
  }
#ifdef HOST_COUNT
  HOST_COUNT(known);  // tests/test_quant_fast46.py: this code compiled for the CPU counts decided blocks
#endif
  if (!known) {
    if (sc.fast) errors_exact(r, s6, enc6, s4, enc4, sc, &e6, &e4);
    else errors_ieee(r, s6, enc6, s4, enc4, sc, &e6, &e4);
    pick4 = e4 < e6;
  }
#else
  if (sc.fast) {
    e6 = candidate_error<true>(r, s6, enc6, sc);
    e4 = candidate_error<true>(r, s4, enc4, sc);
  } else {
    errors_ieee(r, s6, enc6, s4, enc4, sc, &e6, &e4);
  }
  pick4 = e4 < e6;
#endif
#if GENERAL46 == 2
  codes = pick4 ? c4 : c6;
#else
  codes = codes_of(r, pick4 ? enc4 : enc6);
#endif
  sbits = e4m3_bits(pick4 ? s4 : s6);
}

#if FAST46 == 3
// FAST46 3 (lean46): FAST46 2's arithmetic, the same bytes, in fewer instructions, for the blocks where its
// guards hold: block max in 2^-40..2^40, both scales nonzero (subnormal E4M3 ones, s < 2^-6, take the general
// rounding in a branch of their own: since the twenty-eighth session; before, such blocks, a few per row of
// a tensor with 4 decades between its columns, sent a warp in 20 down quantize46's path), max |z| < 7 for both
// candidates (no clamp at 6 needed: the E2M1 rounding of |z| < 7 never reaches 8), enc4 >= 2^-15, the
// tensor's (or row's) amax in decide46's range, and no NaN / Inf in the block. Every other block (zero and
// padding blocks, NaN / Inf, tiny block maxima against the amax) takes FAST46 2's path (quantize46; inline:
// out of line, under the row kernel's 64-register cap, it spilled).
// - bamax / 6 without a division (div6: correctly rounded wherever v / 6 is normal, as bamax >= 2^-40 keeps it;
//   tests/test_quant_fast46.py checks two binades, and scaling by 2 commutes with it), the scales' E4M3
//   rounding and bits by their normal-range formulas (subnormal scales: the general ones, in a branch).
// - Per element, both candidates in one pass: the sign once (bfloat16: x < 0; with enc >= 2^-15 no nonzero
//   x underflows to -0 and -0.0 stays 0, so z's sign is x's for both candidates), the E2M1 rounding of
//   e2m1_mag with its power of two m * 2^22 taken by the FMA that rounds (m = 2^max(exponent of a, 0)), the
//   code + BIAS as tb + (tb >> 22): its low 23 bits are (tb & 0x7FFFFF) + (tb >> 22), the rest (the exponent
//   field, bits 23 up) leaves the word when shifted by 4k >= 12 (elements k = 3..7 of a word); elements 0..2
//   go shifted by 4k + 9 into a word of their own, shifted back once (code + BIAS < 2^9: nothing carries).
// - decide46's bound per candidate without a square root: sqrt(E) <= (E + 2.25) / 3 (AM-GM, equal at E =
//   2.25, near the typical E of a 16-element block), so MSE B <= u (133.34 Xmax (E + 2.25) + 70 E + 1) and MAE
//   B <= u (400 Xmax + 70 E + 1), the 1 covering 45000 u^2 Xmax^2 + 2^-60 (MAE 1000 u^2 Xmax + 2^-60) with
//   Xmax < 7 (1 + 2^-20). (Until the twenty-eighth session the bound's maximum under the guards, 12800 u /
//   4096 u, whatever the block: ~0.3% of blocks then went to the exact errors, a tenth of the row kernel's
//   warps at 32 blocks a warp instruction, ~9% of its instructions.) The bound does not need E <= 16.5, but
//   every finite block has it (each |ev - |z|| <= 1 when |z| < 7): a larger E, NaN or Inf means a non-finite
//   block, which goes to quantize46. The blocks the bound leaves take the exact errors (errors_exact).

__device__ __forceinline__ float div6(float v) {  // fp32(v / 6) where v / 6 is normal
  const float c = 0.1666666716337204f;  // fp32(1/6)
  float q = __fmul_rn(v, c);
  float r = __fmaf_rn(-q, 6.0f, v);
  return __fmaf_rn(r, c, q);
}

// 1 / y correctly rounded for y in 2^-126 .. 2^126: __frcp_rn's own fast path (the hardware's approximate
// reciprocal and one Newton step by FMAs) without its range check and slow path. Where lean46's guards pass,
// y = s * S_dec = 1 / enc lies in about 2^-43 .. 2^15 (bamax * enc6 < 7 with bamax >= 2^-40, enc4 >= 2^-15);
// elsewhere the value is unused.
__device__ __forceinline__ float rcp_lean(float y) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return __fmaf_rn(r, __fmaf_rn(-y, r, 1.0f), r);
#else
  return __frcp_rn(y);  // the host build (tests): IEEE division
#endif
}

__device__ __forceinline__ float e4m3_normal(float v) {  // e4m3_round for v >= 2^-6 (min(v, 448), ties even)
  v = fminf(v, 448.0f);
  int b = __float_as_int(v);
  return __int_as_float((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576);
}

// one element of one candidate (|z| < 7): ev - |z| (ev: |z|'s E2M1 value), t for its code
__device__ __forceinline__ float lean_diff(float z, float& t) {
  const float a = fabsf(z);  // (an operand modifier below; the mask takes z's exponent without it)
  const float m = __uint_as_float(max(__float_as_uint(z) & 0x7F800000u, 0x3F800000u));
  t = __fmaf_rn(m, 4194304.0f, a);                // a + 2^(e + 22), one rounding: e2m1_mag's t
  const float ev = __fmaf_rn(-m, 4194304.0f, t);  // exact
  return __fadd_rn(ev, -a);
}

// one element of one candidate: the error term into acc, code + BIAS (its sign apart) into the word it goes to
__device__ __forceinline__ void lean_elem(float z, int k, float& acc, u32& lo, u32& w) {
  float t;
  const float d = lean_diff(z, t);
  acc = MAE ? __fadd_rn(acc, fabsf(d)) : __fmaf_rn(d, d, acc);
  const u32 tb = __float_as_uint(t);
  const u32 v = tb + (tb >> 22);
  if (k < 3) lo += v << (4 * k + 9);
  else w += v << (4 * k);
}

#if !IN_F32
// the sign bits (8 << 4k for x_k < 0, strictly: -0.0 gives 0) of elements 8h .. 8h + 7 of a bfloat16 block, as
// a code word's: per word one packed compare (x < 0 on both halves: 0xFFFF or 0), then four byte permutes
// gather a byte per element (e: elements 0-3, f: 4-7; ev: the even elements, od: the odd ones), whose bit 3
// (even) and bit 7 (odd) land on the nibbles' sign bits. 10 instructions for 8 elements (a compare and a
// select per element before).
__device__ __forceinline__ u32 lt0_bf16x2(u32 w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  u32 m;
  asm("set.lt.u32.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(w), "r"(0u));  // sm_90: one instruction
  return m;
#elif defined(__CUDA_ARCH__)
  return __vcmpgtu2(w, 0x80008000u);  // sm_80-89: a half above 0x8000 is a sign with a nonzero magnitude
#else
  const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xFFFF0000u);
  return (lo < 0.0f ? 0xFFFFu : 0u) | (hi < 0.0f ? 0xFFFF0000u : 0u);
#endif
}

__device__ __forceinline__ u32 signs8(const uint4& q) {  // the 8 values of 16 bytes
  const u32 m0 = lt0_bf16x2(q.x), m1 = lt0_bf16x2(q.y), m2 = lt0_bf16x2(q.z), m3 = lt0_bf16x2(q.w);
  const u32 e = __byte_perm(m0, m1, 0x7531), f = __byte_perm(m2, m3, 0x7531);
  const u32 ev = __byte_perm(e, f, 0x6420), od = __byte_perm(e, f, 0x7531);
  return (ev & 0x08080808u) | (od & 0x80808080u);
}
#endif

// lean46's pass over a block at encode factors enc6, enc4 (max |z| < 7 and enc4 >= 2^-15: the caller's guards):
// both candidates' cheap errors E (two chains, added at the end) and both candidates' codes
__device__ __forceinline__ void lean46_pass(const Raw& r, float enc6, float enc4, float& e6, float& e4, uint2& c6o,
                                            uint2& c4o) {
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // [6, 4][even, odd elements]
  u32 c6[2], c4[2];                                  // the candidates' code words, 8 elements each
  const u32 bias = BIAS * 0x11111111u;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // a word's accumulators end with its 8 elements (fewer live registers)
    u32 lo6 = 0u, w6 = 0u, lo4 = 0u, w4 = 0u, sg6 = 0u, sg4 = 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = 8 * h + k;
      const float x = elem(r, i);
      const float z6 = __fmul_rn(x, enc6), z4 = __fmul_rn(x, enc4);
#if IN_F32
      sg6 += z6 < 0.0f ? 8u << (4 * k) : 0u;  // float32 input: a nonzero x may underflow, per candidate
      sg4 += z4 < 0.0f ? 8u << (4 * k) : 0u;
#endif
      lean_elem(z6, k, acc[0][i & 1], lo6, w6);
      lean_elem(z4, k, acc[1][i & 1], lo4, w4);
    }
#if !IN_F32
    sg4 = sg6 = signs8(r.q[h]);
#endif
    c6[h] = (lo6 >> 9) + w6 + sg6 - bias;
    c4[h] = (lo4 >> 9) + w4 + sg4 - bias;
  }
  e6 = __fadd_rn(acc[0][0], acc[0][1]);
  e4 = __fadd_rn(acc[1][0], acc[1][1]);
  c6o = make_uint2(c6[0], c6[1]);
  c4o = make_uint2(c4[0], c4[1]);
}

// lean46's bound B on |e_ref / sigma^2 - E| (MAE: e_ref / sigma) for a block of cheap error e and max |z| xm
__device__ __forceinline__ float lean46_bound(float xm, float e) {
  const float U = 5.9604644775390625e-08f, xs = 1.00000095367431640625f;  // 2^-24, 1 + 2^-20
#if MAE
  return U * (400.0f * xs * xm + 70.0f * e + 1.0f);
#else
  return U * (133.34f * xs * xm * (e + 2.25f) + 70.0f * e + 1.0f);
#endif
}

// candidates46's scales and encode factors for a block (or tile) of max amax where lean46's guards hold, by
// formulas without division calls: div6, the normal-range E4M3 rounding, rcp_lean
__device__ __forceinline__ void lean_candidates(const Scales& sc, float amax, float& s6, float& s4, float& enc6,
                                                float& enc4) {
  const float base = __fmul_rn(div6(amax), sc.enc);
  s6 = e4m3_normal(base);
  s4 = e4m3_normal(__fmul_rn(base, 1.5f));
  if (base < 0.015625f) {  // a subnormal E4M3 scale (a block far below the amax): the general rounding
    s6 = e4m3_round(base);
    s4 = e4m3_round(__fmul_rn(base, 1.5f));
  }
  enc6 = rcp_lean(__fmul_rn(s6, sc.dec));  // enc_for's
  enc4 = rcp_lean(__fmul_rn(s4, sc.dec));
}

__device__ __forceinline__ bool lean46(const Raw& r, const Scales& sc, float bamax, uint2& codes, u32& sbits) {
  float s6, s4, enc6, enc4;
  lean_candidates(sc, bamax, s6, s4, enc6, enc4);
  const float xm6 = __fmul_rn(bamax, enc6), xm4 = __fmul_rn(bamax, enc4);  // max |z| (Xmax: * (1 + 2^-20))
  if (!(sc.fast && bamax >= 9.094947017729282e-13f && bamax <= 1.099511627776e12f && s6 >= 0.001953125f &&
        xm6 < 7.0f && enc4 >= 3.0517578125e-05f))  // 2^-40, 2^40, 2^-9 (s4 >= s6: so xm4 <= xm6), 2^-15
    return false;
  float e6, e4;
  uint2 c6, c4;
  lean46_pass(r, enc6, enc4, e6, e4, c6, c4);
  if (!(e6 <= 16.5f && e4 <= 16.5f)) return false;  // NaN or Inf in the block
  bool pick4 = false, known = false;
  {
    const float w6 = MAE ? s6 : s6 * s6, w4 = MAE ? s4 : s4 * s4;  // exact: 4 significant bits
    const float c = 1.0000019073486328125f;  // 1 + 2^-19: the float roundings of these products (< 5u)
    const float b6 = lean46_bound(xm6, e6), b4 = lean46_bound(xm4, e4);
    if (w4 * (e4 + b4) * c < w6 * (e6 - b6)) { pick4 = true; known = true; }
    else if (w6 * (e6 + b6) * c < w4 * (e4 - b4)) { known = true; }
  }
#ifdef HOST_COUNT
  HOST_COUNT(known);
#endif
#ifdef HOST_LEAN
  HOST_LEAN();  // tests/test_quant_fast46.py: the blocks this path took
#endif
  if (!known) {
    float x6, x4;
    errors_exact(r, s6, enc6, s4, enc4, sc, &x6, &x4);
    pick4 = x4 < x6;
  }
  codes = pick4 ? c4 : c6;
  const float ps = pick4 ? s4 : s6;
  sbits = (__float_as_uint(ps) >> 20) - 960u;  // normal E4M3: ((exponent - 120) << 3) | mantissa
  if (ps < 0.015625f) sbits = e4m3_bits(ps);
  return true;
}

// 16x16 tiles (nvfp4_quant_tile16, FAST46 3): decide46 per tile. The tile's 16 blocks share s6, s4 and so
// sigma, so the tile's reference error over sigma^2 (MAE: sigma) is the tree sum of its blocks' and lies
// within the sum of their lean46 bounds of the sum of their cheap errors, widened for the sums' roundings:
// the reference's tree and the shuffles' here (4 levels each: relative 4u on sums of nonnegative terms). With
// E, B the computed sums, the true tile value lies in [E - B', (E + B)(1 + 9u)], B' = B + 2^-17 (E + B)
// (2^-17 = 128u covers 8u (E + B) and the roundings of B' itself); the comparison then takes lean46's form
// with its 2^-19 for the products. The guards are lean46's at the tile's scales: the tile's max in
// 2^-40..2^40 (sigma >= tmax / 9 >= 2^-43.2: a block far below the tile's max has tiny X and its terms'
// absolute errors, ~2^-149, stay far inside the bound's constant u), s6 >= 2^-9, max |z| < 7 over the tile,
// enc4 >= 2^-15; and each block's E <= 16.5 (no NaN / Inf). Tests: tests/test_quant_tile46.py runs this on
// the CPU tile by tile against the reference, near ties included.
__device__ __forceinline__ bool tile46_guards(const Scales& sc, float tmax, float s6, float enc6, float enc4) {
  return sc.fast && tmax >= 9.094947017729282e-13f && tmax <= 1.099511627776e12f && s6 >= 0.001953125f &&
         __fmul_rn(tmax, enc6) < 7.0f && enc4 >= 3.0517578125e-05f;
}

// one block of a tile: lean46's pass at the tile's factors, its bounds; false for a NaN / Inf block
__device__ __forceinline__ bool tile46_block(const Raw& r, float bamax, float enc6, float enc4, float& e6,
                                             float& e4, float& b6, float& b4, uint2& c6, uint2& c4) {
  lean46_pass(r, enc6, enc4, e6, e4, c6, c4);
  b6 = lean46_bound(__fmul_rn(bamax, enc6), e6);  // (lean46_bound widens max |z| to Xmax itself)
  b4 = lean46_bound(__fmul_rn(bamax, enc4), e4);
  return e6 <= 16.5f && e4 <= 16.5f;
}

// the tile's choice from its summed cheap errors E and bounds B: 1 (4), 0 (6), -1 (the bound cannot tell)
__device__ __forceinline__ int tile46_decide(float s6, float s4, float E6, float E4, float B6, float B4) {
  const float w6 = MAE ? s6 : s6 * s6, w4 = MAE ? s4 : s4 * s4;  // exact: 4 significant bits
  const float c = 1.0000019073486328125f, t = 7.62939453125e-06f;  // 1 + 2^-19, 2^-17
  const float v6 = B6 + t * (E6 + B6), v4 = B4 + t * (E4 + B4);
  int pick = -1;
  if (w4 * (E4 + v4) * c < w6 * (E6 - v6)) pick = 1;
  else if (w6 * (E6 + v6) * c < w4 * (E4 - v4)) pick = 0;
#ifdef HOST_COUNT
  HOST_COUNT(pick >= 0);
#endif
  return pick;
}
#endif
#endif

// one block: codes (8 bytes) and the E4M3 scale bits
__device__ __forceinline__ void quantize_block(const Raw& r, const Scales& sc, u32 bmax_bits, uint2& codes,
                                               u32& sbits) {
  float bamax = __uint_as_float(bmax_bits);
#if RULE46 && FAST46 == 3
  if (!lean46(r, sc, bamax, codes, sbits)) quantize46(r, sc, bamax, codes, sbits);
#elif RULE46
  quantize46(r, sc, bamax, codes, sbits);
#else
  float s = e4m3_round(__fmul_rn(bamax, __fmul_rn(sc.enc, ONE_SIXTH_F)));
  codes = codes_of(r, enc_for(s, sc));
  sbits = e4m3_bits(s);
#endif
}

// per-tensor amax: parts[0] = max finite |x| bits, parts[1] = max raw |x| bits (>= 0x7F800000: NaN/Inf);
// atomic max per CTA (exact, order-free; parts start at 0). n_blk: 16-element blocks.
extern "C" __global__ void __launch_bounds__(256) nvfp4_amax(const void* __restrict__ x, int* __restrict__ parts,
                                                             int n_blk) {
  u32 raw = 0, fin = 0;
  const int stride = gridDim.x * 256;
  for (int b = blockIdx.x * 256 + threadIdx.x; b < n_blk; b += 2 * stride) {
    Raw r0, r1;
    load_block(x, b, r0);
    bool two = b + stride < n_blk;
    if (two) load_block(x, b + stride, r1);
    u32 a, f, unused;
    block_max_bits(r0, a, f, unused);  // the tensor amax is over the finite values in every mode
    raw = max(raw, a); fin = max(fin, f);
    if (two) {
      block_max_bits(r1, a, f, unused);
      raw = max(raw, a); fin = max(fin, f);
    }
  }
  raw = __reduce_max_sync(0xFFFFFFFFu, raw);
  fin = __reduce_max_sync(0xFFFFFFFFu, fin);
  __shared__ u32 sm[2][8];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sm[0][warp] = raw; sm[1][warp] = fin; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < 8; ++i) { raw = max(raw, sm[0][i]); fin = max(fin, sm[1][i]); }
    atomicMax(parts, (int)fin);
    atomicMax(parts + 1, (int)raw);
  }
}

#if SRC != 1
// the tensor's scales (SRC 0: from nvfp4_amax's parts; 2 / 3: the imposed amax or g), g stored once
__device__ __forceinline__ Scales tensor_scales(const float* __restrict__ given, const int* __restrict__ parts,
                                                float* __restrict__ g_out) {
#if SRC == 0
  const Scales sc = scales_from(__int_as_float(parts[0]));
#else
  const Scales sc = scales_from(given[0]);
#endif
  if (blockIdx.x == 0 && threadIdx.x == 0) g_out[0] = sc.g;
  return sc;
}

// blocks of the flat tensor (a block never straddles a row: K % 16 == 0), grid-stride; SRC 0, 2, 3
extern "C" __global__ void __launch_bounds__(256, MINB) nvfp4_quant_flat(
    const void* __restrict__ x, uint2* __restrict__ d, unsigned char* __restrict__ sc_out, float* __restrict__ g_out,
    const float* __restrict__ given, const int* __restrict__ parts, int n_blk, int nb_row) {
#if !GIVEN_ROWS
  const Scales sc = tensor_scales(given, parts, g_out);
#endif
  for (int b = blockIdx.x * 256 + threadIdx.x; b < n_blk; b += gridDim.x * 256) {
    Raw r;
    load_block(x, b, r);
#if GIVEN_ROWS
    int row = b / nb_row;
    const Scales sc = scales_from(given[row]);
    if (b == row * nb_row) g_out[row] = sc.g;
#endif
    u32 raw, fin, bmax;
    block_max_bits(r, raw, fin, bmax);
    uint2 codes;
    u32 sbits;
    quantize_block(r, sc, bmax, codes, sbits);
    d[b] = codes;
    sc_out[b] = (unsigned char)sbits;
  }
}

#if !GIVEN_ROWS
// 16x16 tiles (one E4M3 scale per 16 rows x 16 columns, so per 16 blocks of a block column; per-tensor or
// imposed scale): a half-warp per tile, lane r (of 16) holding row r's block, a warp two tiles side by side.
// The tile's max and (4/6) its two candidates' errors are reduced across the 16 lanes by xor shuffles with
// lane distance 8, 4, 2, 1: TransformerEngine's order, the reference's tree (rows r + r+8, then r + r+4,
// r + r+2, r + r+1), each step one rounded addition of the same two values. Each block's own error is the
// left-to-right sum over its 16 elements (candidate_error); FAST46 3 decides most tiles from lean46's
// cheaper errors and bounds summed over the tile (tile46_decide), the exact errors only where they cannot.
__device__ __forceinline__ float tile_sum(float v) {
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}

__device__ __forceinline__ u32 tile_max(u32 v) {  // over float32 bit patterns of values >= 0
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, m));
  return v;
}

__device__ __forceinline__ bool tile_all(bool p) {
  int v = p;
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) v &= __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v != 0;
}

// TILE_U tile pairs a warp at a time: their loads issued together, then each pair's work (more bytes in flight
// a warp); cuda.TILE16_U picks 2, staged (TILE_SMEM, below)
#ifndef TILE_U
#define TILE_U 1
#endif
#ifndef TILE_SMEM
#define TILE_SMEM 0
#endif
// CTAs of 256 threads per SM the tile kernel's registers allow: its own, not the flat kernel's MINB (rule 6
// at 32 registers spilled): 64 / 80 / 128 registers for bfloat16 at 1 / 2 / 4 pairs (4 staged with rule 4/6
// spilled at 128: 1), none for float32 (4/6 takes 80-168); tests/test_cuda_sources.py checks every build
#ifndef TILE_MINB
#define TILE_MINB (IN_F32 ? 1 : TILE_U == 1 ? 4 : TILE_U == 2 ? 3 : TILE_SMEM && RULE46 ? 1 : 2)
#endif
// TILE_SMEM 1 (with TILE_U 2 or 4; the launcher sends it only where a tile row's pairs are a multiple of
// TILE_U, so a warp's U pairs are adjacent in one tile row): the warp stages its 16 rows x 2U blocks through
// its own shared memory, each load instruction covering rows' 2U x 32 (fp32 64) contiguous bytes, instead of
// each lane reading its block (16 rows x 64 B a warp instruction); rows padded by 16 B (no bank conflicts
// when lane r reads row r)

// one tile pair after its loads: lane r of each half-warp holds row r's block of its tile, the block's max
// bmax; every lane of the warp calls it (shuffles)
__device__ __forceinline__ void tile_pair(const Raw& r, u32 bmax, bool live, long long b, const Scales& sc,
                                          uint2* __restrict__ d, unsigned char* __restrict__ sc_out) {
  const float tmax = __uint_as_float(tile_max(bmax));
  uint2 codes;
  u32 sbits;
#if RULE46
  float s6, s4, enc6, enc4;
  candidates46(sc, tmax, s6, s4, enc6, enc4);
  int pick = -1;  // 1: 4, 0: 6, -1: not known yet
#if FAST46 == 3
  // decide46 per tile (tile46_decide): lean46's pass over every block at the tile's factors, the cheap
  // errors and their bounds summed over the tile
  uint2 c6, c4;
  float l6, l4, b6, b4;
  const bool lean = tile_all(tile46_guards(sc, tmax, s6, enc6, enc4) &
                             tile46_block(r, __uint_as_float(bmax), enc6, enc4, l6, l4, b6, b4, c6, c4));
  const float E6 = tile_sum(l6), E4 = tile_sum(l4), B6 = tile_sum(b6), B4 = tile_sum(b4);
  if (lean) pick = tile46_decide(s6, s4, E6, E4, B6, B4);
  // an all-zero (or all-NaN with allow_nonfinite) tile, and the dead half past the last column: s6 = s4 = 0,
  // so both candidates' errors are the same and the reference keeps 6 (without this, the tile's guard fails
  // and sends the warp's other tile to the exact errors too)
  if (tmax == 0.0f) pick = 0;
#endif
  if (__any_sync(0xFFFFFFFFu, pick < 0)) {  // a tile of the warp not decided: the exact errors (every lane)
    float e6, e4;
    if (sc.fast) {
#if FAST46 == 3  // out of line, as lean46's (inline, the per-tile decide46 build spilled)
      errors_exact(r, s6, enc6, s4, enc4, sc, &e6, &e4);
#else
      e6 = candidate_error<true>(r, s6, enc6, sc);
      e4 = candidate_error<true>(r, s4, enc4, sc);
#endif
    } else {
      errors_ieee(r, s6, enc6, s4, enc4, sc, &e6, &e4);
    }
    const bool pick4 = tile_sum(e4) < tile_sum(e6);
    if (pick < 0) pick = pick4;
  }
#if FAST46 == 3
  codes = lean ? (pick ? c4 : c6) : codes_of(r, pick ? enc4 : enc6);  // (lean46's codes: codes_of's there)
#else
  codes = codes_of(r, pick ? enc4 : enc6);
#endif
  sbits = e4m3_bits(pick ? s4 : s6);
#else
  const float s = e4m3_round(__fmul_rn(tmax, __fmul_rn(sc.enc, ONE_SIXTH_F)));
  codes = codes_of(r, enc_for(s, sc));
  sbits = e4m3_bits(s);
#endif
  if (live) {
    d[b] = codes;
    sc_out[b] = (unsigned char)sbits;
  }
}

extern "C" __global__ void __launch_bounds__(256, TILE_MINB) nvfp4_quant_tile16(
    const void* __restrict__ x, uint2* __restrict__ d, unsigned char* __restrict__ sc_out, float* __restrict__ g_out,
    const float* __restrict__ given, const int* __restrict__ parts, int n_tr, int nb_row) {
  const Scales sc = tensor_scales(given, parts, g_out);
  const int lane = threadIdx.x & 31;
  const int pairs = (nb_row + 1) >> 1;  // tile pairs per tile row
  const long long n_warps = (long long)n_tr * pairs;
  // w0 (and so every w) is the same for the warp's 32 lanes, so every shuffle has all of them (a half past the
  // last block column, or a pair past the last, reduces zeros among its own 16 lanes and stores nothing)
  for (long long w0 = (((long long)blockIdx.x * 256 + threadIdx.x) >> 5) * TILE_U; w0 < n_warps;
       w0 += (long long)gridDim.x * 8 * TILE_U) {
    Raw r[TILE_U];
    u32 bmax[TILE_U];
    bool live[TILE_U];
    long long b[TILE_U];
#if TILE_SMEM
    constexpr int QB = IN_F32 ? 4 : 2;            // 16-byte words a block
    constexpr int QR = 2 * TILE_U * QB;           // words of a row's segment
    constexpr int PITCH = QR + 1;                 // words a staged row (one of padding)
    __shared__ uint4 stage[8][16 * PITCH];
    uint4* st = stage[threadIdx.x >> 5];
    {
      const long long tr = w0 / pairs;
      const int col0 = (int)(w0 - tr * pairs) * 2;  // the segment's first block column
      const uint4* xq = reinterpret_cast<const uint4*>(x);
#pragma unroll
      for (int i = lane; i < 16 * QR; i += 32) {
        const int rr = i / QR, c = i - rr * QR;
        st[rr * PITCH + c] = col0 + c / QB < nb_row
            ? __ldg(xq + ((tr * 16 + rr) * nb_row + col0) * QB + c) : uint4{0u, 0u, 0u, 0u};
      }
    }
    __syncwarp();
#endif
#pragma unroll
    for (int u = 0; u < TILE_U; ++u) {
      const long long w = w0 + u;
      const long long tr = w / pairs;
      const int col = (int)(w - tr * pairs) * 2 + (lane >> 4);
      live[u] = w < n_warps && col < nb_row;
      b[u] = (tr * 16 + (lane & 15)) * nb_row + col;
      r[u] = Raw{};
#if TILE_SMEM
      const uint4* src = st + (lane & 15) * PITCH + (2 * u + (lane >> 4)) * QB;
#pragma unroll
      for (int k = 0; k < QB; ++k) r[u].q[k] = src[k];
#else
      if (live[u]) load_block(x, b[u], r[u]);
#endif
    }
#if TILE_SMEM
    __syncwarp();  // (the next segment's stores after every lane's reads)
#endif
#pragma unroll
    for (int u = 0; u < TILE_U; ++u) {
      bmax[u] = 0;
      if (live[u]) {
        u32 raw, fin;
        block_max_bits(r[u], raw, fin, bmax[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < TILE_U; ++u) tile_pair(r[u], bmax[u], live[u], b[u], sc, d, sc_out);
  }
}

#if !RULE46 || (FAST46 == 3 && !IN_F32)
// 16x16 tiles with rule 6 (nvfp4_quant_strip16): a warp a strip of 16 rows x SPW block columns, LPB lanes a
// block (bfloat16: 2 lanes of 8 values, float32: 4 of 4; 16 bytes a lane a row), so that each load is one
// row's 512 contiguous bytes across the warp (the tile kernel's warp reads 16 rows x 64 B, which made its rule
// 6 slower than the Triton kernel's). The lane holds its 16 rows (16 x 16 B); the tile's max is the lane's max
// over them, then over the block's LPB lanes (xor shuffles inside the aligned group); codes are stored a row
// at a time (the lane's 8 or 4 nibbles: the block's element 8j + i, or 4j + i, in nibble i of lane j's part),
// the scale byte by the block's first lane. No per-element work crosses lanes, so any split gives the same
// bytes as one thread a block. Rule 4/6 (bfloat16, FAST46 3): decide46 per tile from each lane's cheap errors
// and bound (strip_decide46 below), the exact errors in the reference's order only for a warp with a tile
// that bound leaves (strip_exact). (Rule 4/6 with the exact errors for every tile, a block's error
// continued from lane 0's sum by lane 1 and the tile's tree inside a lane, took 0.47-0.49 ms against the tile
// kernel's 0.395 on an H100: removed, bench/RESULTS.md, forty-fifth session.)
#define EPL (IN_F32 ? 4 : 8)  // values a lane a row
#define LPB (16 / EPL)        // lanes a block
#define SPW (32 / LPB)        // block columns a warp
// CTAs of 256 threads per SM the strip kernel's registers allow: 16 rows x 16 B held a lane (64 registers) and
// the rest take 128 (bfloat16; float32 spilled 8 B at 2, more at 3); tests/test_cuda_sources.py checks builds.
// (Reading the rows again for the codes instead, from L1 / L2 at 64 registers and 4 CTAs an SM, took 0.159 ms
// against 0.124 held on 32768x4096 on an H100: removed, bench/RESULTS.md, forty-fifth session.)
#ifndef STRIP_MINB
#define STRIP_MINB (IN_F32 ? 1 : 2)
#endif

__device__ __forceinline__ float lane_elem(const uint4& q, int i) {  // the lane's value i as float32
  return value_in(word4(q, IN_F32 ? i : i >> 1), i);
}

__device__ __forceinline__ u32 lane_raw_bits(const uint4& q) {  // max |x| bit patterns, NaN / Inf included
#if IN_F32
  return max(max(q.x & 0x7FFFFFFFu, q.y & 0x7FFFFFFFu), max(q.z & 0x7FFFFFFFu, q.w & 0x7FFFFFFFu));
#else
  const u32 m = __vmaxu2(__vmaxu2(q.x & 0x7FFF7FFFu, q.y & 0x7FFF7FFFu), __vmaxu2(q.z & 0x7FFF7FFFu,
                                                                                 q.w & 0x7FFF7FFFu));
  return max(m & 0xFFFFu, m >> 16) << 16;
#endif
}

// block_max_bits' bmax for a block split over LPB lanes (every lane of the warp calls it: shuffles): the
// finite max with NONFINITE, else the max over the non-NaN values (Inf included), NaN bits when all 16 are NaN
__device__ __forceinline__ u32 split_bmax_bits(const uint4& q) {
  u32 f = 0, nn = 0, any = 0;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const u32 b = __float_as_uint(lane_elem(q, i)) & 0x7FFFFFFFu;
    f = max(f, b >= 0x7F800000u ? 0u : b);
    nn = max(nn, b > 0x7F800000u ? 0u : b);
    any |= b <= 0x7F800000u;
  }
#pragma unroll
  for (int m = 1; m < LPB; m <<= 1) {
    f = max(f, __shfl_xor_sync(0xFFFFFFFFu, f, m));
    nn = max(nn, __shfl_xor_sync(0xFFFFFFFFu, nn, m));
    any |= __shfl_xor_sync(0xFFFFFFFFu, any, m);
  }
  return NONFINITE ? f : (any ? nn : 0x7FC00000u);
}

__device__ __forceinline__ u32 lane_codes(const uint4& q, float enc) {  // the lane's EPL codes, packed
  u32 w = 0;
  float unused;
#pragma unroll
  for (int i = 0; i < EPL; ++i) w += e2m1(__fmul_rn(lane_elem(q, i), enc), unused) << (4 * i);
  return w - BIAS * (IN_F32 ? 0x1111u : 0x11111111u);
}

// one row's part of a block: the lane's codes (lane_codes' word), the scale byte from the block's first lane
__device__ __forceinline__ void strip_store(void* __restrict__ d, unsigned char* __restrict__ sc_out, long long b,
                                            int j, u32 codes, unsigned char sbits) {
#if IN_F32
  reinterpret_cast<unsigned short*>(d)[b * LPB + j] = (unsigned short)codes;
#else
  reinterpret_cast<u32*>(d)[b * LPB + j] = codes;
#endif
  if (j == 0) sc_out[b] = sbits;
}

#if RULE46
// Rule 4/6 on the strip layout (bfloat16: lane j of a block's two holds elements 8j..8j+7 of its 16 rows).
// decide46 per tile from lane sums: the tile's reference error over sigma^2 (MAE: sigma) is within
// B_0 + B_1 (widened by tile46_decide) of E_0 + E_1, E_j lane j's cheap error (lean_diff's terms: per row a
// chain of 8, the rows' sums chained, then the lanes' sum) and B_j its bound:
// - decide46's analysis (above) holds per element: with eps_i <= 6.04u X_i, the tile's two error sums differ
//   by at most 24.2u sum X_i |R_i| + 44u E (MAE: 12.1u sum X_i + 44u E) plus O(u^2 X^2) terms, 44u for the
//   roundings a term meets on sums of nonnegative terms: the reference's 20 (the square, a chain of 16, a tree
//   of 4) and the lanes' 24 (the square in the FMA, a chain of 8, one of 16 rows, the lanes' sum);
// - over a lane's 128 elements (Cauchy-Schwarz, where decide46 takes a block's 16): sum X |R| <= Xm sqrt(128)
//   sqrt(sum R^2) <= 11.32 Xm sqrt(E_j) (1 + 2^-20) + 774u Xm^2, Xm = the lane's max |z| widened to cover
//   max X (as lean46_bound's);
// - each term doubled, as decide46's: B_j = u (1132 Xm sqrt(E_j) + 88 E_j + 16) (MAE: u (3200 Xm + 88 E_j +
//   16)); 1132 = 400 sqrt(8), decide46's block coefficient over 8 blocks' worth of elements, 3200 = 8 x 400
//   (derived: 548 and 3098), the 16 covering 16 rows' O(u^2 Xm^2) terms (37500 u^2 Xm^2 < 0.12u at Xm < 7)
//   and the squares below the normal range. sqrt(E) as E rsqrt(E) (the hardware's: relative 2^-21, inside
//   the doubling; a flushed subnormal E gives Inf and the exact errors).
// Guards: tile46_guards (the tile kernel's) at the tile's scales; a warp with NaN / Inf takes the exact errors.
// the lane's pass at both candidates' factors (lean46_pass's per row, its guards: the tile's): cheap errors
// e6, e4 and the lane's code words c6, c4 of its 16 rows (lane_codes' for these guards)
__device__ __forceinline__ void strip_pass46(const uint4 (&v)[16], float enc6, float enc4, float& e6, float& e4,
                                             u32 (&c6)[16], u32 (&c4)[16]) {
  e6 = e4 = 0.0f;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float a6 = 0.0f, a4 = 0.0f;
    u32 lo6 = 0u, w6 = 0u, lo4 = 0u, w4 = 0u;
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
      const float x = lane_elem(v[r], k);
      lean_elem(__fmul_rn(x, enc6), k, a6, lo6, w6);
      lean_elem(__fmul_rn(x, enc4), k, a4, lo4, w4);
    }
    const u32 sg = signs8(v[r]);
    c6[r] = (lo6 >> 9) + w6 + sg - BIAS * 0x11111111u;
    c4[r] = (lo4 >> 9) + w4 + sg - BIAS * 0x11111111u;
    e6 = __fadd_rn(e6, a6);
    e4 = __fadd_rn(e4, a4);
  }
}

__device__ __forceinline__ float strip_bound(float xm, float e) {  // B_j for the lane's max |z| xm, error e
  const float U = 5.9604644775390625e-08f, xs = 1.00000095367431640625f;  // 2^-24, 1 + 2^-20
#if MAE
  return U * (3200.0f * xs * xm + 88.0f * e + 16.0f);
#else
  const float r = e > 0.0f ? e * rsqrtf(e) : 0.0f;
  return U * (1132.0f * xs * xm * r + 88.0f * e + 16.0f);
#endif
}

// the tile's choice decided by the lane sums: 1 (4), 0 (6), -1 (the exact errors), and both candidates' codes
// (the winner's where it decides); every lane calls it (shuffles with its block's other lane). lane_max: max
// |x| over the lane's 16 rows; lean: tile46_guards at the tile's scales.
__device__ __forceinline__ int strip_decide46(const uint4 (&v)[16], float lane_max, bool lean, float s6, float s4,
                                              float enc6, float enc4, u32 (&c6)[16], u32 (&c4)[16]) {
  float e6, e4;
  strip_pass46(v, enc6, enc4, e6, e4, c6, c4);
  float b6 = strip_bound(__fmul_rn(lane_max, enc6), e6), b4 = strip_bound(__fmul_rn(lane_max, enc4), e4);
  e6 = __fadd_rn(e6, __shfl_xor_sync(0xFFFFFFFFu, e6, 1));  // (a + b on one lane, b + a on the other: equal)
  e4 = __fadd_rn(e4, __shfl_xor_sync(0xFFFFFFFFu, e4, 1));
  b6 = __fadd_rn(b6, __shfl_xor_sync(0xFFFFFFFFu, b6, 1));
  b4 = __fadd_rn(b4, __shfl_xor_sync(0xFFFFFFFFu, b4, 1));
  return lean ? tile46_decide(s6, s4, e6, e4, b6, b4) : -1;
}

// one block's error for one candidate in the reference's order (the left-to-right sum over its 16 elements):
// lane 0 sums its 8 terms, lane 1 continues from lane 0's sum; lane 1's result is the block's
template <bool FAST>
__device__ __forceinline__ float split_error(const uint4& q, float s, float enc, const Scales& sc, int j) {
  float t[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) t[i] = error_term<FAST>(lane_elem(q, i), s, enc, sc);
  float a = t[0];
#pragma unroll
  for (int i = 1; i < EPL; ++i) a = __fadd_rn(a, t[i]);
  float b = __shfl_xor_sync(0xFFFFFFFFu, a, 1);
#pragma unroll
  for (int i = 0; i < EPL; ++i) b = __fadd_rn(b, t[i]);
  return j ? b : a;
}

__device__ __forceinline__ uint4 strip_row(const uint4* __restrict__ p0, long long row_q, bool live, int r) {
  const uint4 z = {0u, 0u, 0u, 0u};
  return live ? __ldg(p0 + r * row_q) : z;
}

// both candidates' tile errors in the reference's order: the block errors summed over the 16 rows in TE's tree
// (rows r + r+8, then r + r+4, r + r+2, r + r+1: the tile kernel's butterfly, here inside lane 1; lane 1's
// sums are the tile's). A rolled loop (this path's registers fit beside the kernel's): the pairs a_r = row r +
// row r+8 in the order r = 0, 4, 2, 6, 1, 5, 3, 7 (i's 3 bits reversed), where the tree's pairs are
// consecutive, so each pair's sum joins the one before it as a binary counter carries (one pending partial
// sum a level).
template <bool FAST>
__device__ __forceinline__ void strip_tile_errors(const uint4* __restrict__ p0, long long row_q, bool live,
                                                  float s6, float enc6, float s4, float enc4, const Scales& sc, int j,
                                                  float& e6, float& e4) {
  float p6[3], p4[3];  // the pending partial sum of level 1, 2, 3
#pragma unroll 1
  for (int i = 0; i < 8; ++i) {
    const int r = ((i & 1) << 2) | (i & 2) | ((i >> 2) & 1);
    const uint4 q0 = strip_row(p0, row_q, live, r), q1 = strip_row(p0, row_q, live, r + 8);
    float t6 = __fadd_rn(split_error<FAST>(q0, s6, enc6, sc, j), split_error<FAST>(q1, s6, enc6, sc, j));
    float t4 = __fadd_rn(split_error<FAST>(q0, s4, enc4, sc, j), split_error<FAST>(q1, s4, enc4, sc, j));
#pragma unroll
    for (int l = 0; l < 3; ++l) {
      if (!((i >> l) & 1)) {
        p6[l] = t6;
        p4[l] = t4;
        break;
      }
      t6 = __fadd_rn(p6[l], t6);
      t4 = __fadd_rn(p4[l], t4);
    }
    e6 = t6;  // (after i = 7: the root)
    e4 = t4;
  }
}

// a warp with a tile the bound left (or NaN / Inf, or amaxes outside decide46's range): each undecided tile's
// pick by its exact errors (lane 1's, shared with lane 0), then the tile's codes and scale bytes, the rows
// read again (from L1 / L2): the held rows are dead here (the caller goes on to its next strip), so this path
// takes their registers (128 without spills; out of line, the call's saves spilled 32-52 B). Every lane calls
// it (shuffles).
__device__ __forceinline__ void strip_exact(const uint4* __restrict__ p0, long long row_q, bool live, int pick,
                                            float tmax, const Scales& sc, int j, void* __restrict__ d,
                                            unsigned char* __restrict__ sc_out, long long b0, int nb_row) {
  float s6, s4, enc6, enc4, e6, e4;
  candidates46(sc, tmax, s6, s4, enc6, enc4);
  if (sc.fast)  // (the same for every lane)
    strip_tile_errors<true>(p0, row_q, live, s6, enc6, s4, enc4, sc, j, e6, e4);
  else
    strip_tile_errors<false>(p0, row_q, live, s6, enc6, s4, enc4, sc, j, e6, e4);
  const int mine = e4 < e6;
  const int other = __shfl_xor_sync(0xFFFFFFFFu, mine, 1);
  if (pick < 0) pick = j ? mine : other;
  const float enc = pick ? enc4 : enc6;
  const unsigned char sbits = (unsigned char)e4m3_bits(pick ? s4 : s6);
  if (live) {
#pragma unroll 4
    for (int r = 0; r < 16; ++r)
      strip_store(d, sc_out, b0 + (long long)r * nb_row, j, lane_codes(strip_row(p0, row_q, true, r), enc),
                  sbits);
  }
}
#endif

extern "C" __global__ void __launch_bounds__(256, STRIP_MINB) nvfp4_quant_strip16(
    const void* __restrict__ x, void* __restrict__ d, unsigned char* __restrict__ sc_out, float* __restrict__ g_out,
    const float* __restrict__ given, const int* __restrict__ parts, int n_tr, int nb_row) {
  const Scales sc = tensor_scales(given, parts, g_out);
  const int lane = threadIdx.x & 31, j = lane % LPB;
  const int strips = (nb_row + SPW - 1) / SPW;  // a tile row's strips
  const long long n_warps = (long long)n_tr * strips;
  const uint4* __restrict__ xq = reinterpret_cast<const uint4*>(x);
  const long long row_q = (long long)nb_row * LPB;  // 16-byte words a row
  // w is the same for the warp's 32 lanes, so every shuffle below has all of them (lanes past the last block
  // column hold zeros and store nothing)
  for (long long w = ((long long)blockIdx.x * 256 + threadIdx.x) >> 5; w < n_warps; w += (long long)gridDim.x * 8) {
    const long long tr = w / strips;
    const int col = (int)(w - tr * strips) * SPW + lane / LPB;
    const bool live = col < nb_row;
    const long long b0 = tr * 16 * nb_row + col;  // the tile's row-0 block
    const uint4* p0 = xq + b0 * LPB + j;
    u32 m = 0;
    uint4 v[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) v[r] = live ? __ldg(p0 + r * row_q) : uint4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int r = 0; r < 16; ++r) m = max(m, lane_raw_bits(v[r]));
#if RULE46
    const float lane_max = __uint_as_float(m);
#endif
#pragma unroll
    for (int k = 1; k < LPB; k <<= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, k));
    const bool nonfinite = __any_sync(0xFFFFFFFFu, m >= 0x7F800000u);
    if (nonfinite) {  // NaN / Inf in a tile of the warp: per block, as bmax
      m = 0;
#pragma unroll
      for (int r = 0; r < 16; ++r) m = max(m, split_bmax_bits(v[r]));
    }
#if RULE46
    const float tmax = __uint_as_float(m);
    float s6, s4, enc6, enc4;
    lean_candidates(sc, tmax, s6, s4, enc6, enc4);  // (no division calls on the common path)
    const bool lean = tile46_guards(sc, tmax, s6, enc6, enc4);  // (where these are candidates46's values)
    u32 c6[16], c4[16];
    int pick = nonfinite ? -1 : strip_decide46(v, lane_max, lean, s6, s4, enc6, enc4, c6, c4);  // (uniform)
    // a zero tile or past the last column: the candidates tie (zero codes, scale 0), the reference keeps 6
    const bool zero = tmax == 0.0f;
    if (zero) pick = 0;
    // a tile of the warp not decided, or NaN / Inf in the warp (a tile of zeros and NaN / Inf has the max 0 but
    // not zero codes: +-Inf -> +-6 with NONFINITE, NaN -> 6 without): the exact path (every lane)
    if (nonfinite || __any_sync(0xFFFFFFFFu, pick < 0)) {
      strip_exact(p0, row_q, live, pick, tmax, sc, j, d, sc_out, b0, nb_row);
      continue;
    }
    const unsigned char sbits = zero ? 0 : (unsigned char)e4m3_bits(pick ? s4 : s6);
    if (live) {
#pragma unroll
      for (int r = 0; r < 16; ++r)
        strip_store(d, sc_out, b0 + (long long)r * nb_row, j, zero ? 0u : pick ? c4[r] : c6[r], sbits);
    }
#else
    const float s = e4m3_round(__fmul_rn(__uint_as_float(m), __fmul_rn(sc.enc, ONE_SIXTH_F)));
    const float enc = enc_for(s, sc);
    const unsigned char sbits = (unsigned char)e4m3_bits(s);
    if (live) {
#pragma unroll
      for (int r = 0; r < 16; ++r) strip_store(d, sc_out, b0 + (long long)r * nb_row, j, lane_codes(v[r], enc),
                                               sbits);
    }
#endif
  }
}
#endif
#endif

#else
// per-row scales in one pass (SRC 1): TPR threads per row (CTA / TPR rows per CTA), each holding BPT blocks
// (thread t: blocks t, t + TPR, ...); the row max is a warp reduction (and, past 32 threads, shared memory).
extern "C" __global__ void __launch_bounds__(CTA, MINB) nvfp4_quant_rows(
    const void* __restrict__ x, uint2* __restrict__ d, unsigned char* __restrict__ sc_out, float* __restrict__ g_out,
    int* __restrict__ flag, int n_rows, int nb_row) {
  const int t = threadIdx.x % TPR;
  const int row = blockIdx.x * (CTA / TPR) + threadIdx.x / TPR;
  const bool live = row < n_rows;
  u32 raw = 0, fin = 0;
#if RELOAD
  // the row max from up to 4 blocks' loads in flight at a time; the blocks are read again below, their max |x|
  // kept here in shared memory (bfloat16: a bfloat16 value, its upper half kept; NaN / Inf: found again below)
#if IN_F32
  __shared__ u32 bm_s[NONFINITE ? 1 : BPT][CTA];
#else
  __shared__ unsigned short bm_s[NONFINITE ? 1 : BPT][CTA];
#endif
#pragma unroll
  for (int j0 = 0; j0 < BPT; j0 += 4) {
    Raw r[4];
#pragma unroll
    for (int jj = 0; jj < 4 && j0 + jj < BPT; ++jj) {
      int col = t + (j0 + jj) * TPR;
      if (live && col < nb_row) load_block(x, (long long)row * nb_row + col, r[jj]);
    }
#pragma unroll
    for (int jj = 0; jj < 4 && j0 + jj < BPT; ++jj) {
      int col = t + (j0 + jj) * TPR;
      u32 braw = 0, bfin = 0, unused;
      if (live && col < nb_row) block_max_bits(r[jj], braw, bfin, unused);
      if (!NONFINITE) bm_s[NONFINITE ? 0 : j0 + jj][threadIdx.x] = IN_F32 ? braw : braw >> 16;
      raw = max(raw, braw); fin = max(fin, bfin);
    }
  }
#else
  Raw r[BPT];
  u32 bmax[BPT];
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    int col = t + j * TPR;
    if (live && col < nb_row) load_block(x, (long long)row * nb_row + col, r[j]);
  }
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    int col = t + j * TPR;
    u32 braw = 0, bfin = 0;
    bmax[j] = 0;
    if (live && col < nb_row) block_max_bits(r[j], braw, bfin, bmax[j]);
    raw = max(raw, braw); fin = max(fin, bfin);
  }
#endif
#if TPR < 32
  const u32 mask = ((1u << TPR) - 1u) << ((threadIdx.x & 31) & ~(TPR - 1));
  raw = __reduce_max_sync(mask, raw);
  fin = __reduce_max_sync(mask, fin);
#else
  raw = __reduce_max_sync(0xFFFFFFFFu, raw);
  fin = __reduce_max_sync(0xFFFFFFFFu, fin);
#if TPR > 32
  __shared__ u32 sm[2][CTA / 32];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) { sm[0][warp] = raw; sm[1][warp] = fin; }
  __syncthreads();
  const int w0 = (threadIdx.x / TPR) * (TPR / 32);
#pragma unroll 4
  for (int i = 0; i < TPR / 32; ++i) { raw = max(raw, sm[0][w0 + i]); fin = max(fin, sm[1][w0 + i]); }
#endif
#endif
  if (!live) return;
  const Scales sc = scales_from(__uint_as_float(fin));
  if (t == 0) { g_out[row] = sc.g; flag[row] = (int)raw; }
#if RELOAD
  // each block read again (from L1 or L2: this thread read it above) and quantized; a loop, not unrolled: one
  // copy of the block's code whatever BPT. The block is loaded at the top of its iteration (other warps cover
  // the latency): with the next one prefetched into registers instead, 8 moves a block made it 1.5-2.5% slower
  // (bench/RESULTS.md, twenty-eighth session; unrolled by 2 to rename them, it spilled)
  const long long row0 = (long long)row * nb_row;
#pragma unroll 1
  for (int col = t, j = 0; col < nb_row; col += TPR, ++j) {
    Raw cur;
    load_block(x, row0 + col, cur);
#if NONFINITE  // the block max again (NONFINITE builds keep none from above: with MAE that spilled)
    u32 braw, bfin, bmax;
    block_max_bits(cur, braw, bfin, bmax);
#else
    u32 bmax = IN_F32 ? bm_s[j][threadIdx.x] : (u32)bm_s[j][threadIdx.x] << 16;  // (this thread's own)
    if (bmax >= 0x7F800000u) {  // NaN / Inf in the block: the block scale's max as block_max_bits gives it
      u32 braw, bfin;
      block_max_bits(cur, braw, bfin, bmax);
    }
#endif
    uint2 codes;
    u32 sbits;
    quantize_block(cur, sc, bmax, codes, sbits);
    d[row0 + col] = codes;
    sc_out[row0 + col] = (unsigned char)sbits;
  }
#else
#pragma unroll
  for (int j = 0; j < BPT; ++j) {
    int col = t + j * TPR;
    if (col < nb_row) {
      uint2 codes;
      u32 sbits;
      quantize_block(r[j], sc, bmax[j], codes, sbits);
      long long b = (long long)row * nb_row + col;
      d[b] = codes;
      sc_out[b] = (unsigned char)sbits;
    }
  }
#endif
}
#endif
