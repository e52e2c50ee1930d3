/* W4A16 GEMM on packed NVFP4 weights for x86 CPUs with AMX-BF16: y = x @ DQ(W).T (+ b).

   x      bfloat16 [M, K] (row stride ldx elements), K a multiple of 16
   W      packed NVFP4, 1x16 blocks: data uint8 [N, K/2], swizzled per 32 weights (see
          cpu_gemm.swizzle: byte j of a 32-weight group holds element j in its low nibble and
          element j + 16 in its high one; a last group of 16 keeps the NVFP4 order, 2i low),
          block scales E4M3 bytes [N, K/16], global scale float32 (one, or one per row of W)
   y      bfloat16 [M, N] (row stride ldy elements)

   DQ(W) is formed 16 rows of W at a time ("panel", bfloat16 [16, K32], K32 = K rounded up to
   32 and zero-filled) from tables of the 16 values a block with scale byte s can take,
   bf16((e2m1[c] * e4m3[s]) * g) (see dequantize_panel): bit for bit what
   fp4rl.nvfp4.dequantize(q, torch.bfloat16) returns. The panel never leaves L1/L2: the weight
   bytes are read once, 0.5625 byte per weight, against 2 for a BF16 weight.

   The product runs on AMX tiles, transposed so that W is the row-major A operand:
       C[n, m] += sum_k A[n, k] * B[k, m]     A = panel (16 x 32 bf16), B = x in VNNI pairs
   x is rearranged once per call ("x_vnni", by nvfp4_gemm_pack_x) into blocks of 16 rows,
   [M16][K32 / 2][16][2] bf16, zero-padded. Each panel's A tile is reused across every 16-row
   block of x, so a prefill of hundreds of tokens dequantizes each weight once.

   Accumulation is float32 over k in increasing tile order (hardware order inside a tile),
   bias added in float32, one rounding to bfloat16. Results therefore match F.linear on the
   bfloat16 DQ(W) up to accumulation order (products are exact in float32 either way).

   Threads: callers split [0, N) into ranges that are multiples of 16 and call
   nvfp4_gemm_rows on each range from its own thread with its own panel workspace; the AMX
   tile configuration is per thread and loaded on every call. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Ask the kernel for the AMX tile state (Linux). 0 on success. */
int nvfp4_gemm_init(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1;
    return 0;
}

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {  /* 0-3: C (16 x 16 fp32), 4: A, 5-6: B; all 16 rows x 64 bytes */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x [M, K] bf16 -> x_vnni [ceil(M/16)][K32/2][16][2] bf16, zero-padded. */
void nvfp4_gemm_pack_x(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, uint16_t *x_vnni) {
    const int64_t K32 = (K + 31) / 32 * 32, M16 = (M + 15) / 16;
    memset(x_vnni, 0, (size_t)(M16 * K32 * 16) * sizeof(uint16_t));
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * ldx;
        uint16_t *block = x_vnni + (m / 16) * K32 * 16 + (m % 16) * 2;
        for (int64_t k = 0; k < K; k += 2) {
            uint16_t *dst = block + (k / 2) * 32;
            dst[0] = row[k];
            dst[1] = row[k + 1];
        }
    }
}

static inline void dequantize_row(const uint8_t *data, const uint8_t *scale, const uint16_t *tables,
                                  const int32_t *row_table, int64_t n, int64_t K, uint16_t *out) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i bit5 = _mm_set1_epi8(0x20);  /* upper 16 indices read the second table */
    const uint8_t *codes = data + n * (K / 2);
    const uint8_t *scales = scale + n * (K / 16);
    const uint16_t *table = tables + (int64_t)row_table[n] * 256 * 16;
    /* the same row of the next panel, to L2 while this one is unpacked (prefetches never fault) */
    for (int64_t p = 0; p < K / 2; p += 64) _mm_prefetch((const char *)(codes + 16 * (K / 2) + p), _MM_HINT_T1);
    _mm_prefetch((const char *)(scales + 16 * (K / 16)), _MM_HINT_T1);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i lut0 = _mm512_loadu_si512((const void *)(table + scales[k / 16] * 16));
        __m512i lut1 = _mm512_loadu_si512((const void *)(table + scales[k / 16 + 1] * 16));
        /* swizzled: byte j holds element j (low nibble) and element j + 16 (high nibble) */
        __m128i b = _mm_loadu_si128((const __m128i *)(codes + k / 2));
        __m128i lo = _mm_and_si128(b, low4);
        __m128i hi = _mm_ternarylogic_epi32(_mm_srli_epi16(b, 4), low4, bit5, 0xEA);  /* (a & b) | c */
        __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
        _mm512_storeu_si512((void *)(out + k), _mm512_permutex2var_epi16(lut0, idx, lut1));
    }
    if (k < K) {  /* one block of 16 left, NVFP4 order (element 2i in the low nibble of byte i) */
        __m256i lut = _mm256_loadu_si256((const __m256i *)(table + scales[k / 16] * 16));
        __m128i b = _mm_loadl_epi64((const __m128i *)(codes + k / 2));
        __m128i lo = _mm_and_si128(b, low4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        __m256i idx = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
        _mm256_storeu_si256((__m256i *)(out + k), _mm256_permutexvar_epi16(idx, lut));
        memset(out + k + 16, 0, 16 * sizeof(uint16_t));
    }
}

/* DQ of rows [n0, n0 + 16) of W into panel [16][K32] bf16 (rows >= N and k >= K zero).
   tables[t][s][c] = bf16((e2m1[c] * e4m3[s]) * g_t), made by the caller once per weight version
   (torch's own float32 products and cast: bit for bit what dequantize returns), with one row of
   padding after the last table; row n uses table row_table[n]. A block's 16 values are then one
   load, and two blocks (32 weights) one vpermt2w over their two tables. */
static void dequantize_panel(const uint8_t *data, const uint8_t *scale, const uint16_t *tables,
                             const int32_t *row_table, int64_t n0, int64_t N, int64_t K, uint16_t *panel) {
    const int64_t K32 = (K + 31) / 32 * 32;
    for (int64_t r = 0; r < 16; r++) {
        uint16_t *out = panel + r * K32;
        const int64_t n = n0 + r;
        if (n >= N) {
            memset(out, 0, (size_t)K32 * sizeof(uint16_t));
            continue;
        }
        dequantize_row(data, scale, tables, row_table, n, K, out);
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void store_block(const float *c, int64_t n0, int64_t N, int64_t m0, int64_t M,
                        const uint16_t *bias, uint16_t *y, int64_t ldy) {
    /* c[n][m] (16 x 16 fp32) -> y[m0 + m, n0 + n] */
    for (int64_t m = 0; m < 16 && m0 + m < M; m++) {
        uint16_t *row = y + (m0 + m) * ldy + n0;
        for (int64_t n = 0; n < 16 && n0 + n < N; n++) {
            float v = c[n * 16 + m];
            if (bias) v += from_bf16(bias[n0 + n]);
            row[n] = to_bf16(v);
        }
    }
}

/* Products of one dequantized panel with every 16-row block of x into y. The four C tiles
   accumulate either four blocks of x at once, or, for one or two blocks (decode), the K steps
   split over 4 or 2 partial sums (summed in float32 at the end, in a fixed order), so that
   consecutive tile products do not wait on each other. */
static void panel_products(const uint16_t *panel, const uint16_t *x_vnni, int64_t M, int64_t K32,
                           int64_t n0, int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    const int64_t M16 = (M + 15) / 16, stride_b = K32 * 16 * 2;
    float c[4][256] __attribute__((aligned(64)));
    for (int64_t mb = 0; mb < M16; mb += 4) {
        const int64_t nb = M16 - mb < 4 ? M16 - mb : 4;
        const char *b0 = (const char *)(x_vnni + mb * K32 * 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (nb == 1) {  /* K split over 4 accumulators */
            int64_t k = 0;
            for (; k + 128 <= K32; k += 128) {
                _tile_loadd(4, panel + k, K32 * 2);
                _tile_loadd(5, b0 + k * 32, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, panel + k + 32, K32 * 2);
                _tile_loadd(7, b0 + (k + 32) * 32, 64);
                _tile_dpbf16ps(1, 6, 7);
                _tile_loadd(4, panel + k + 64, K32 * 2);
                _tile_loadd(5, b0 + (k + 64) * 32, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, panel + k + 96, K32 * 2);
                _tile_loadd(7, b0 + (k + 96) * 32, 64);
                _tile_dpbf16ps(3, 6, 7);
            }
            for (; k < K32; k += 32) {
                _tile_loadd(4, panel + k, K32 * 2);
                _tile_loadd(5, b0 + k * 32, 64);
                _tile_dpbf16ps(0, 4, 5);
            }
        } else if (nb == 2) {  /* two blocks, K split over 2 accumulators each */
            int64_t k = 0;
            for (; k + 64 <= K32; k += 64) {
                _tile_loadd(4, panel + k, K32 * 2);
                _tile_loadd(5, b0 + k * 32, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(7, b0 + stride_b + k * 32, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(6, panel + k + 32, K32 * 2);
                _tile_loadd(5, b0 + (k + 32) * 32, 64);
                _tile_dpbf16ps(2, 6, 5);
                _tile_loadd(7, b0 + stride_b + (k + 32) * 32, 64);
                _tile_dpbf16ps(3, 6, 7);
            }
            for (; k < K32; k += 32) {
                _tile_loadd(4, panel + k, K32 * 2);
                _tile_loadd(5, b0 + k * 32, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(7, b0 + stride_b + k * 32, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
        } else {
            for (int64_t k = 0; k < K32; k += 32) {
                const char *bk = b0 + k * 32;  /* k/2 pair rows of 64 bytes */
                _tile_loadd(4, panel + k, K32 * 2);
                _tile_loadd(5, bk, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, bk + stride_b, 64);
                _tile_dpbf16ps(1, 4, 6);
                if (nb > 2) {
                    _tile_loadd(5, bk + 2 * stride_b, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (nb > 3) {
                    _tile_loadd(6, bk + 3 * stride_b, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        if (nb == 1) {
            for (int i = 0; i < 256; i++) c[0][i] = ((c[0][i] + c[1][i]) + c[2][i]) + c[3][i];
        } else if (nb == 2) {
            for (int i = 0; i < 256; i++) {
                c[0][i] += c[2][i];
                c[1][i] += c[3][i];
            }
        }
        for (int64_t j = 0; j < nb; j++) store_block(c[j], n0, N, (mb + j) * 16, M, bias, y, ldy);
    }
}

/* y[:, n_begin:n_end] for one thread; n_begin a multiple of 16. panels: 2 * 16 * K32 bf16 of
   workspace (the next panel is dequantized while the tiles read the other one). */
int nvfp4_gemm_rows(const uint16_t *x_vnni, int64_t M, int64_t K, const uint8_t *data, const uint8_t *scale,
                    const uint16_t *tables, const int32_t *row_table, const uint16_t *bias, int64_t n_begin,
                    int64_t n_end, int64_t N, uint16_t *y, int64_t ldy, uint16_t *panels) {
    const int64_t K32 = (K + 31) / 32 * 32;
    if (K % 16 || n_begin % 16) return -1;
    configure_tiles();
    for (int64_t n0 = n_begin; n0 < n_end; n0 += 16) {
        dequantize_panel(data, scale, tables, row_table, n0, N, K, panels);
        panel_products(panels, x_vnni, M, K32, n0, N, bias, y, ldy);
    }
    _tile_release();
    return 0;
}

/* DQ(W) rows [n_begin, n_end) into out [N, K] bf16 (row stride K), the panels' arithmetic; out
   must have 16 spare elements after its end (a last odd block is followed by 16 zeros). */
void nvfp4_gemm_dequantize(const uint8_t *data, const uint8_t *scale, const uint16_t *tables,
                           const int32_t *row_table, int64_t n_begin, int64_t n_end, int64_t K, uint16_t *out) {
    for (int64_t n = n_begin; n < n_end; n++) dequantize_row(data, scale, tables, row_table, n, K, out + n * K);
}

/* The whole product on one thread: pack x, then every panel (one call from Python instead of two). */
int nvfp4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *data, const uint8_t *scale,
               const uint16_t *tables, const int32_t *row_table, const uint16_t *bias, int64_t N, uint16_t *y,
               uint16_t *x_vnni, uint16_t *panel) {
    nvfp4_gemm_pack_x(x, M, K, ldx, x_vnni);
    return nvfp4_gemm_rows(x_vnni, M, K, data, scale, tables, row_table, bias, 0, N, N, y, N, panel);
}
