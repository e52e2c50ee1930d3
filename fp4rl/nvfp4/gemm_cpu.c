/* GEMMs for x86 CPUs with AMX-BF16 on weights kept in a tiled layout: y = x @ W.T (+ b).

   W is either packed NVFP4 (1x16 blocks: E2M1 codes, E4M3 block scales, float32 global scales)
   or BF16. Both are stored by fp4rl/nvfp4/cpu_gemm.py in groups of 64 rows of W (N padded to a
   multiple of 64, K to a multiple of 32 with zeros), chunk by chunk of 32 columns, so that a whole
   weight is one sequential stream:

     NVFP4 codes   uint8  [N64/64][K32/32][64][16]   per row and chunk, the 32 codes in the order
                                                      of cpu_gemm.swizzle (for vpmultishiftqb)
     NVFP4 scales  uint8  [N64/64][K32/32][64][2]    the chunk's two E4M3 block-scale bytes
     row_table     int32  [N64]                      which global scale (table) a row uses
     BF16          uint16 [N64/64][K32/32][64][32]

   x      bfloat16 [M, K] (row stride ldx elements), K a multiple of 16
   y      bfloat16 [M, N] (row stride ldy elements)

   NVFP4 values come from tables of the 16 values a block with scale byte s can take,
   bf16((e2m1[c] * e4m3[s]) * g) (made by torch: bit for bit what
   fp4rl.nvfp4.dequantize(q, torch.bfloat16) returns): one vpermt2w gives 32 weights.

   The product runs on AMX tiles with W as the row-major A operand (16 rows of W x 32 columns
   = one 1 KiB tile of the layout above) and x as B, in VNNI pairs ("x_vnni", made once per call
   by nvfp4_gemm_pack_x: [ceil(M/16)][K32/2][16][2] bf16, zero-padded):
       C[n, m] += sum_k A[n, k] * B[k, m]
   Every C tile accumulates its chunks in increasing k (hardware order inside a tile) in float32,
   the bias is added in float32 and the sum rounded once to bfloat16 (round to nearest even),
   whatever M: a row of y does not depend on the other rows of the batch.

   Per group of 64 rows of W:
   - M <= 16 (decode): chunk by chunk, the 64 x 32 weights are unpacked (NVFP4) into a 4 KiB
     buffer that stays in L1 and multiplied at once by four tile products into four C tiles
     (independent accumulators); BF16 tiles are loaded straight from the weight stream.
   - M > 16: the group's 64 x K32 weights are unpacked once into a buffer (L2) and multiplied
     by every 16-row block of x, four blocks at a time.
   Results go through a 16 x 16 transpose of each C tile (AVX-512) to y.

   Threads: callers split the groups [0, N64/64) over threads (nvfp4_gemm_rows / bf16_gemm_rows),
   each with its own workspace; the AMX tile configuration is per thread and loaded on every call. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define GROUP 64          /* rows of W per group */
#define CHUNK_CODES 1024  /* bytes of codes per group and chunk (64 rows x 16) */
#define CHUNK_SCALES 128  /* bytes of block scales per group and chunk (64 rows x 2) */
#define CHUNK_BF16 2048   /* bf16 elements per group and chunk (64 rows x 32) */
#define TABLE 4096        /* bf16 elements per table: 256 scale bytes x 16 codes */
#ifndef PREFETCH_CODES
#define PREFETCH_CODES 4096  /* bytes ahead in the code stream */
#endif
#ifndef PREFETCH_BF16
#define PREFETCH_BF16 16384  /* bytes ahead in a BF16 weight stream */
#endif

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
    for (int t = 0; t < 8; t++) {  /* 0-3: C (16 x 16 fp32), 4-6: A, 5-7: B; all 16 rows x 64 bytes */
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
        const uint32_t *row = (const uint32_t *)(x + m * ldx);  /* bf16 pairs */
        uint32_t *block = (uint32_t *)(x_vnni + (m / 16) * K32 * 16) + (m % 16);
        for (int64_t p = 0; p < K / 2; p++) block[p * 16] = row[p];
    }
}

/* vpmultishiftqb controls: destination byte 2i of each qword j takes the 8 bits at offset 4 p of
   source qword j, p = the slot of weight w = 4 j + i in its qword (see cpu_gemm.swizzle); odd bytes
   are don't-cares (vpermt2w reads the low 6 bits of each index word). */
static const uint8_t MULTISHIFT[64] __attribute__((aligned(64))) = {
    0, 0, 4, 0, 8, 0, 12, 0, 0, 0, 4, 0, 8, 0, 12, 0, 16, 0, 20, 0, 24, 0, 28, 0, 16, 0, 20, 0, 24, 0, 28, 0,
    32, 0, 36, 0, 40, 0, 44, 0, 32, 0, 36, 0, 40, 0, 44, 0, 48, 0, 52, 0, 56, 0, 60, 0, 48, 0, 52, 0, 56, 0, 60, 0};

/* 32 weights of one row and chunk: codes (16 bytes in the swizzled order), its two scale bytes, the
   row's table. The 16 bytes are broadcast to the 4 lanes, one vpmultishiftqb moves each weight's
   nibble into the low bits of its own 16-bit word, a mask keeps 4 bits and sets bit 5 for the upper
   16 weights (which read the second block's table), and one vpermt2w looks the 32 values up. */
static inline __m512i unpack32(const uint8_t *codes, const uint8_t *scales, const uint16_t *table) {
    const __m512i ctrl = _mm512_load_si512((const void *)MULTISHIFT);
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const __m512i upper = _mm512_set_epi16(32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    /* 64 bytes from entry s: the 16 values of scale s (and of s + 1, unused; tables end with a
       padding row) */
    const __m512i lut0 = _mm512_loadu_si512((const void *)(table + (size_t)scales[0] * 16));
    const __m512i lut1 = _mm512_loadu_si512((const void *)(table + (size_t)scales[1] * 16));
    __m512i idx = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)codes));
    idx = _mm512_multishift_epi64_epi8(ctrl, idx);
    idx = _mm512_ternarylogic_epi32(idx, low4, upper, 0xEA);  /* (a & b) | c */
    return _mm512_permutex2var_epi16(lut0, idx, lut1);
}

/* Rows [0, rows) of one group's chunk -> out [rows][32] bf16. */
static inline void unpack_chunk(const uint8_t *codes, const uint8_t *scales, const uint16_t *tables,
                                const int32_t *row_table, int rows, uint16_t *out) {
    for (int r = 0; r < rows; r++) {
        if ((r & 3) == 0) _mm_prefetch((const char *)(codes + r * 16 + PREFETCH_CODES), _MM_HINT_T0);
        _mm512_storeu_si512((void *)(out + r * 32),
                            unpack32(codes + r * 16, scales + r * 2, tables + (int64_t)row_table[r] * TABLE));
    }
    _mm_prefetch((const char *)(scales + PREFETCH_CODES / 8), _MM_HINT_T0);
    _mm_prefetch((const char *)(scales + PREFETCH_CODES / 8 + 64), _MM_HINT_T0);
}

/* float32 -> bfloat16, round to nearest even, NaN kept quiet (as torch's cast). */
static inline __m256i to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* In-register transpose of 16 x 16 float32: r[i][j] -> r[j][i]. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m512 u[16];  /* u[4q + j]: rows 4q..4q+3 of columns j, j+4, j+8, j+12 (one per 128-bit lane) */
    for (int q = 0; q < 4; q++) {
        __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
        __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
        u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {
        __m512 s0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        __m512 s1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        __m512 s2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        __m512 s3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        r[j + 4] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
        r[j + 8] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        r[j + 12] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
    }
}

/* c[n][m] (16 x 16 float32, a stored C tile) -> y[m0 + m, n0 + n] for m0 + m < M, n0 + n < N. */
static void store_block(const float *c, int64_t n0, int64_t N, int64_t m0, int64_t M, const uint16_t *bias,
                        uint16_t *y, int64_t ldy) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    const __mmask16 cols = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + n0)), 16));
    if (rows <= 2) {  /* decode of one or two rows: read the columns directly */
        for (int64_t m = 0; m < rows; m++) {
            __m512 v = _mm512_i32gather_ps(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                                                5, 4, 3, 2, 1, 0),
                                                              _mm512_set1_epi32(16)),
                                           c + m, 4);
            if (bias) v = _mm512_add_ps(v, b);
            _mm256_mask_storeu_epi16(y + (m0 + m) * ldy + n0, cols, to_bf16x16(v));
        }
        return;
    }
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(c + i * 16);
    transpose16(r);  /* r[m][n] */
    for (int64_t m = 0; m < rows; m++) {
        __m512 v = bias ? _mm512_add_ps(r[m], b) : r[m];
        _mm256_mask_storeu_epi16(y + (m0 + m) * ldy + n0, cols, to_bf16x16(v));
    }
}

/* Store C tiles 0 .. count-1 (one tile register per call: tile ids are immediates). */
#define STORE_TILE(T, n0_, m0_)                                                 \
    do {                                                                        \
        _tile_stored(T, cbuf, 64);                                              \
        store_block(cbuf, (n0_), N, (m0_), M, bias, y, ldy);                    \
    } while (0)

/* One chunk of a group (nt A tiles of 16 rows x 32 columns in ak, rows 64 bytes apart) times one block
   of x (the B tile at bk) into C tiles 0 .. nt-1: the decode step's four independent accumulators. */
static inline void chunk_products(const uint16_t *ak, const char *bk, int nt) {
    _tile_loadd(7, bk, 64);
    _tile_loadd(4, ak, 64);
    _tile_dpbf16ps(0, 4, 7);
    if (nt > 1) {
        _tile_loadd(5, ak + 16 * 32, 64);
        _tile_dpbf16ps(1, 5, 7);
    }
    if (nt > 2) {
        _tile_loadd(6, ak + 32 * 32, 64);
        _tile_dpbf16ps(2, 6, 7);
    }
    if (nt > 3) {
        _tile_loadd(4, ak + 48 * 32, 64);
        _tile_dpbf16ps(3, 4, 7);
    }
}

/* C tiles 0 .. nt-1 of a decode (one block of x, M <= 16) -> rows n0 .. n0 + 16 nt of y. */
static void store_decode_tiles(float *cbuf, int nt, int64_t n0, int64_t N, int64_t M, const uint16_t *bias,
                               uint16_t *y, int64_t ldy) {
    STORE_TILE(0, n0, 0);
    if (nt > 1) STORE_TILE(1, n0 + 16, 0);
    if (nt > 2) STORE_TILE(2, n0 + 32, 0);
    if (nt > 3) STORE_TILE(3, n0 + 48, 0);
}

/* One group (nt tiles of 16 rows, A tiles in `a`: [K32/32][64][32] bf16 with chunk stride
   `chunk_stride` elements) times every block of x; used for BF16 weights and for unpacked NVFP4
   groups (M > 16). */
static void group_products(const uint16_t *a, int64_t chunk_stride, int nt, const uint16_t *x_vnni, int64_t M,
                           int64_t K32, int64_t n0, int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy,
                           int prefetch) {
    const int64_t C = K32 / 32, M16 = (M + 15) / 16, stride_b = K32 * 16 * 2;
    float cbuf[256] __attribute__((aligned(64)));
    if (M16 == 1) {  /* four W tiles, one x block: four independent accumulators */
        const char *b0 = (const char *)x_vnni;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < C; kc++) {
            const uint16_t *ak = a + kc * chunk_stride;
            if (prefetch)
                for (int p = 0; p < CHUNK_BF16 * 2; p += 64) _mm_prefetch((const char *)ak + PREFETCH_BF16 + p, _MM_HINT_T0);
            chunk_products(ak, b0 + kc * 1024, nt);
        }
        store_decode_tiles(cbuf, nt, n0, N, M, bias, y, ldy);
        return;
    }
    /* two W tiles x two blocks of x: four C tiles, two A and two B loads per four tile products */
    for (int tp = 0; tp < nt; tp += 2) {
        const int two_t = nt - tp > 1;
        const uint16_t *a0 = a + tp * 16 * 32, *a1 = a0 + 16 * 32;
        for (int64_t mp = 0; mp < M16; mp += 2) {
            const int two_m = M16 - mp > 1;
            const char *b0 = (const char *)(x_vnni + mp * K32 * 16), *b1 = b0 + stride_b;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kc = 0; kc < C; kc++) {
                if (prefetch && tp == 0 && mp == 0) /* the first pass streams the group's chunks (all tiles) */
                    for (int p = 0; p < CHUNK_BF16 * 2; p += 64)
                        _mm_prefetch((const char *)(a + kc * chunk_stride) + PREFETCH_BF16 / 4 + p, _MM_HINT_T1);
                _tile_loadd(4, a0 + kc * chunk_stride, 64);
                _tile_loadd(6, b0 + kc * 1024, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_m) {
                    _tile_loadd(7, b1 + kc * 1024, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_t) {
                    _tile_loadd(5, a1 + kc * chunk_stride, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_m) _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int64_t n0a = n0 + 16 * tp;
            STORE_TILE(0, n0a, mp * 16);
            if (two_m) STORE_TILE(1, n0a, (mp + 1) * 16);
            if (two_t) STORE_TILE(2, n0a + 16, mp * 16);
            if (two_t && two_m) STORE_TILE(3, n0a + 16, (mp + 1) * 16);
        }
    }
}

static inline int tiles_in_group(int64_t n0, int64_t N) {
    const int64_t left = (N - n0 + 15) / 16;
    return left < 4 ? (int)left : 4;
}

/* NVFP4: groups [g_begin, g_end) for one thread. work: 64 * K32 bf16 (M > 16) or 2 * 64 * 32. */
int nvfp4_gemm_rows(const uint16_t *x_vnni, int64_t M, int64_t K, const uint8_t *codes, const uint8_t *scales,
                    const uint16_t *tables, const int32_t *row_table, const uint16_t *bias, int64_t g_begin,
                    int64_t g_end, int64_t N, uint16_t *y, int64_t ldy, uint16_t *work) {
    const int64_t K32 = (K + 31) / 32 * 32, C = K32 / 32;
    if (K % 16) return -1;
    configure_tiles();
    float cbuf[256] __attribute__((aligned(64)));
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n0 = g * GROUP;
        const int nt = tiles_in_group(n0, N);
        const uint8_t *cg = codes + g * C * CHUNK_CODES, *sg = scales + g * C * CHUNK_SCALES;
        const int32_t *rt = row_table + n0;
        if (M > 16) {  /* unpack the group once, multiply it by every block of x */
            for (int64_t kc = 0; kc < C; kc++)
                unpack_chunk(cg + kc * CHUNK_CODES, sg + kc * CHUNK_SCALES, tables, rt, nt * 16,
                             work + kc * CHUNK_BF16);
            group_products(work, CHUNK_BF16, nt, x_vnni, M, K32, n0, N, bias, y, ldy, 0);
            continue;
        }
        const char *b0 = (const char *)x_vnni;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < C; kc++) {  /* unpack a chunk (L1), multiply it at once */
            uint16_t *ak = work + (kc & 1) * CHUNK_BF16;
            unpack_chunk(cg + kc * CHUNK_CODES, sg + kc * CHUNK_SCALES, tables, rt, nt * 16, ak);
            chunk_products(ak, b0 + kc * 1024, nt);
        }
        store_decode_tiles(cbuf, nt, n0, N, M, bias, y, ldy);
    }
    _tile_release();
    return 0;
}

/* BF16: groups [g_begin, g_end) for one thread. */
int bf16_gemm_rows(const uint16_t *x_vnni, int64_t M, int64_t K, const uint16_t *w, const uint16_t *bias,
                   int64_t g_begin, int64_t g_end, int64_t N, uint16_t *y, int64_t ldy) {
    const int64_t K32 = (K + 31) / 32 * 32, C = K32 / 32;
    if (K % 16) return -1;
    configure_tiles();
    for (int64_t g = g_begin; g < g_end; g++) {
        const int64_t n0 = g * GROUP;
        group_products(w + g * C * CHUNK_BF16, CHUNK_BF16, tiles_in_group(n0, N), x_vnni, M, K32, n0, N, bias,
                       y, ldy, 1);
    }
    _tile_release();
    return 0;
}

/* DQ(W) rows [n_begin, n_end) into out [N, K] bf16 (row stride K), the kernel's arithmetic. */
void nvfp4_gemm_dequantize(const uint8_t *codes, const uint8_t *scales, const uint16_t *tables,
                           const int32_t *row_table, int64_t n_begin, int64_t n_end, int64_t K, uint16_t *out) {
    const int64_t C = (K + 31) / 32;
    for (int64_t n = n_begin; n < n_end; n++) {
        const int64_t g = n / GROUP, r = n % GROUP;
        const uint16_t *table = tables + (int64_t)row_table[n] * TABLE;
        for (int64_t kc = 0; kc < C; kc++) {
            const int64_t at = (g * C + kc) * GROUP + r;
            __m512i v = unpack32(codes + at * 16, scales + at * 2, table);
            const int64_t left = K - kc * 32;
            _mm512_mask_storeu_epi16(out + n * K + kc * 32, left >= 32 ? 0xFFFFFFFFu : 0xFFFFu, v);
        }
    }
}

/* The whole product on one thread: pack x, then every group (one call from Python instead of two). */
int nvfp4_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes, const uint8_t *scales,
               const uint16_t *tables, const int32_t *row_table, const uint16_t *bias, int64_t N, uint16_t *y,
               uint16_t *x_vnni, uint16_t *work) {
    nvfp4_gemm_pack_x(x, M, K, ldx, x_vnni);
    return nvfp4_gemm_rows(x_vnni, M, K, codes, scales, tables, row_table, bias, 0, (N + GROUP - 1) / GROUP, N,
                           y, N, work);
}

int bf16_gemm(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, const uint16_t *bias,
              int64_t N, uint16_t *y, uint16_t *x_vnni) {
    nvfp4_gemm_pack_x(x, M, K, ldx, x_vnni);
    return bf16_gemm_rows(x_vnni, M, K, w, bias, 0, (N + GROUP - 1) / GROUP, N, y, N);
}
