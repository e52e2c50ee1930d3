"""Fast NVFP4 quantize / dequantize for CPU tensors, byte-identical to fp4rl.nvfp4.reference.

Same signatures as the reference, so ``fp4rl.nvfp4`` routes CPU tensors here (see its
``_implementation``; ``FP4RL_NVFP4_CPU=reference`` forces the reference). What runs where:

- the deterministic modes (``rounding="nearest"``; tiles 1x16 and 16x16; per-tensor and
  per-row global scales; rule 6 and 4/6 with MSE or MAE; imposed ``amax`` / ``global_scale``;
  float32, bfloat16 and float16 input; ``pad=True`` when K is already a multiple of 16) run in
  a small C kernel, one block at a time while its 16 values sit in registers: block amax,
  E4M3 block scale, encode factor, E2M1 rounding, both 4/6 candidates with their errors and
  the choice, packing. Per-row scales are computed in the same pass (row amax, then its
  blocks, while the row is in cache); a per-tensor amax takes one more read-only pass first.
  The global scales are reference.global_scales_from_amax / _from_decode written out in C
  (three IEEE divisions and a clamp per row or tensor).
- everything else (stochastic rounding, the Hadamard transform, ``allow_nonfinite``, K not a
  multiple of 16, NaN/Inf input, invalid arguments) goes to the reference unchanged, which
  computes it or raises its own error.
- dequantize: one pass, ``(e2m1[code] * e4m3[byte]) * g`` in float32 (the 16 values of a
  block computed once in that order, then looked up), written as float32 or bfloat16 (round
  to nearest even, as torch's cast); float16 is cast by torch from the float32 result. A NaN
  block-scale byte or a non-finite g (no quantizer writes them) goes to the reference: torch's
  own casts disagree on NaN bits.

Why it is exact. The kernel is C compiled by gcc with ``-ffp-contract=off`` (no a*b+c
contracted into an FMA) and without ``-ffast-math`` (no reassociation, no reciprocal
multiplies: ``x / 6.0f`` and ``1.0f / d`` are IEEE divisions), in float32 on SSE/AVX (no
excess precision), in the reference's operation order (see reference.py's docstring). The
two casts where torch's conversion code could differ from a compiler's are done with integer
arithmetic that is exact by construction: E4M3 round-to-nearest-even with satfinite (bit
rounding of the float32 mantissa to 3 bits; subnormals by the 2^23 magic-number rounding of
v * 2^9), and E2M1 rounding by the reference's threshold comparisons. Amaxes are integer
maxima of the |x| bit patterns (for non-negative floats the integer order is the float order;
a pattern >= +inf is NaN or Inf, which sends the call to the reference). 4/6 errors are summed
left to right over a block and, for 16x16 tiles, as the reference's tree over the 16 rows.
tests/test_nvfp4_cpu.py checks codes, block scales, global scales and dequantized bytes
against the reference on the reference tests' tensor families.

Why not torch.compile: tried (inductor, CPU, dynamic shapes; exact with the same integer
casts), but one graph took 56-94 s to compile cold and ~15 s from the on-disk cache, the
default job needs several, and the compiled code was slower than the reference on 2 cores.
The C file here compiles in about a second, once per machine (cached under
``$XDG_CACHE_HOME/fp4rl`` or ``~/.cache/fp4rl``, keyed by source, flags, compiler and CPU),
and is loaded with ctypes (no torch headers). Work is split over ``torch.get_num_threads()``
Python threads by rows (ctypes releases the GIL); small tensors run on one thread.

If no C compiler is found or the build fails, ``available()`` is False, one warning is
issued, and every call goes to the reference: never different bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fp4rl.nvfp4 import reference
from fp4rl.nvfp4.format import BLOCK, NVFP4Tensor

# ---- the C kernel ----------------------------------------------------------------------------
_SOURCE = r"""

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
"""

_CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-fast-math",
           "-fexcess-precision=standard", "-std=gnu11", "-fPIC", "-shared")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MIN_ELEMENTS_PER_THREAD = 1 << 16  # below this, splitting over threads costs more than it saves

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_e4m3_table: torch.Tensor | None = None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "fp4rl"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"fp4rl-{os.getuid() if hasattr(os, 'getuid') else 0}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on another CPU is never reused."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def build() -> Path:
    """Compile the kernel (or find it in the cache); returns the shared library's path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc, or $CC) found")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE, " ".join(_CFLAGS), version, _cpu_signature()]).encode())
    target = _cache_dir() / f"nvfp4_cpu-{key.hexdigest()[:20]}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "nvfp4_cpu.c", Path(tmp) / "nvfp4_cpu.so"
        src.write_text(_SOURCE)
        result = subprocess.run([cc, *_CFLAGS, "-o", str(out), str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[:2000]}")
        os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return target


def _load() -> ctypes.CDLL:
    path = build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:  # a damaged cache entry: build it again once
        path.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(build()))
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.nvfp4_row_amax.argtypes = [ptr, i32, i64, i64, i64, ptr]
    lib.nvfp4_row_amax.restype = i32
    lib.nvfp4_quantize_rows.argtypes = [ptr, i32, i64, i64, i64, i32, i32, i32, i32, ptr, i64, f32, f32,
                                        ptr, ptr, ptr]
    lib.nvfp4_quantize_rows.restype = i32
    lib.nvfp4_dequantize_rows.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i32, ptr]
    lib.nvfp4_dequantize_rows.restype = i32
    for name in ("nvfp4_cast_e4m3", "nvfp4_round_e2m1"):
        getattr(lib, name).argtypes = [ptr, i64, ptr, ptr]
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    """Whether the fast path can run (builds and loads the kernel on the first call). On
    failure, warns once; the caller then uses the reference."""
    global _lib, _failed
    if _lib is not None:
        return True
    if _failed is not None:
        return False
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _load()
            except Exception as e:  # noqa: BLE001 - any build/load problem means: use the reference
                _failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"fp4rl.nvfp4: the fast CPU quantizer is unavailable ({_failed}); "
                              "CPU tensors use the reference quantizer (same bytes, slower)",
                              RuntimeWarning, stacklevel=3)
    return _lib is not None


def _parallel_rows(fn, rows: int, elements_per_row: int, align: int) -> None:
    """fn(r0, r1) over [0, rows) split into up to torch.get_num_threads() aligned chunks, run
    on Python threads (the C calls release the GIL)."""
    global _pool, _pool_pid
    n = min(torch.get_num_threads(), max(1, rows * elements_per_row // _MIN_ELEMENTS_PER_THREAD))
    n = min(n, rows // align) if rows >= align else 1
    if n <= 1:
        fn(0, rows)
        return
    step = -(-rows // n // align) * align
    bounds = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    with _lock:  # a pool inherited through fork has no threads: make a new one
        if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < len(bounds) - 1:
            _pool = ThreadPoolExecutor(max_workers=len(bounds) - 1, thread_name_prefix="fp4rl-nvfp4")
            _pool_pid = os.getpid()
        pool = _pool
    futures = [pool.submit(fn, r0, r1) for r0, r1 in bounds[1:]]
    fn(*bounds[0])
    for f in futures:
        f.result()


def _roundings(fn_name: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Test hook: the kernel's E4M3 cast ("nvfp4_cast_e4m3", v >= 0) or E2M1 rounding
    ("nvfp4_round_e2m1") of a float32 tensor -> (bytes or codes uint8, float32 values)."""
    if not available():
        raise RuntimeError(f"the fast CPU quantizer is unavailable: {_failed}")
    flat = v.detach().float().contiguous().reshape(-1)
    n = flat.numel()
    flat = torch.nn.functional.pad(flat, (0, (-n) % BLOCK))
    out, value = torch.empty(flat.numel(), dtype=torch.uint8), torch.empty(flat.numel(), dtype=torch.float32)
    getattr(_lib, fn_name)(flat.data_ptr(), flat.numel(), out.data_ptr(), value.data_ptr())
    return out[:n].reshape(v.shape), value[:n].reshape(v.shape)


# ---- quantize --------------------------------------------------------------------------------------
def _fast_quantize_supported(x, tile, scale_rule, err, rounding, scale_scope, generator, allow_nonfinite,
                             pad, hadamard_seed, global_scale, amax) -> bool:
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype not in _DTYPE_CODES:
        return False
    if x.layout != torch.strided:
        return False
    if rounding != "nearest" or generator is not None or allow_nonfinite or hadamard_seed is not None:
        return False
    if tile not in reference.TILES or scale_rule not in reference.SCALE_RULES or err not in ("mse", "mae"):
        return False
    if scale_scope not in ("tensor", "row") or (global_scale is not None and amax is not None):
        return False
    if x.ndim == 0 or x.numel() == 0 or x.shape[-1] % BLOCK:
        return False
    return tile != (16, 16) or (scale_scope == "tensor" and x.ndim >= 2 and x.shape[-2] % 16 == 0)


def quantize(
    x: torch.Tensor,
    *,
    tile: int | tuple[int, int] = 16,
    scale_rule: str = "6",
    err: str = "mse",
    rounding: str = "nearest",
    scale_scope: str = "tensor",
    generator: torch.Generator | None = None,
    global_scale: torch.Tensor | float | None = None,
    amax: torch.Tensor | float | None = None,
    allow_nonfinite: bool = False,
    pad: bool = False,
    hadamard_seed: int | None = None,
) -> NVFP4Tensor:
    """fp4rl.nvfp4.reference.quantize, computed by the C kernel (see the module docstring)."""
    kwargs = dict(tile=tile, scale_rule=scale_rule, err=err, rounding=rounding, scale_scope=scale_scope,
                  generator=generator, global_scale=global_scale, amax=amax,
                  allow_nonfinite=allow_nonfinite, pad=pad, hadamard_seed=hadamard_seed)
    if not _fast_quantize_supported(x, **kwargs) or not available():
        return reference.quantize(x, **kwargs)
    shape, k = x.shape, x.shape[-1]
    x2 = x.detach().contiguous().reshape(-1, k)  # [R, K]
    rows = x2.shape[0]
    dtype_code = _DTYPE_CODES[x.dtype]
    row_scope = scale_scope == "row"
    scale_shape = torch.Size((*shape[:-1], 1)) if row_scope else torch.Size(())
    lib = _lib
    bad = []

    # Where the global scales come from (the C kernel's `mode`, see its comment).
    if global_scale is not None or amax is not None:
        try:
            if global_scale is not None:
                src = reference._validate_scale(global_scale, "global_scale", scale_shape, x, positive=True)
            else:
                src = reference._validate_scale(amax, "amax", scale_shape, x, positive=False)
        except (TypeError, ValueError):
            return reference.quantize(x, **kwargs)  # raises the reference's error
        mode, src = (2 if global_scale is not None else 1), src.contiguous()
    elif row_scope:
        mode, src = 0, None
    else:  # pass 1: the tensor's amax (and the finite check)
        row_amax = torch.empty(rows, dtype=torch.float32)

        def amax_rows(r0, r1):
            if lib.nvfp4_row_amax(x2.data_ptr(), dtype_code, r0, r1, k, row_amax.data_ptr()):
                bad.append(True)

        _parallel_rows(amax_rows, rows, k, 1)
        if bad:
            return reference.quantize(x, **kwargs)  # raises on NaN/Inf
        mode, src = 1, row_amax.amax()

    data = torch.empty(rows, k // 2, dtype=torch.uint8)
    scale = torch.empty(rows, k // BLOCK, dtype=torch.uint8)
    g = torch.empty(rows if row_scope else 1, dtype=torch.float32)
    tile16 = tile == (16, 16)
    m = reference.GLOBAL_SCALE_MAX[scale_rule]

    def quantize_rows(r0, r1):
        if lib.nvfp4_quantize_rows(x2.data_ptr(), dtype_code, r0, r1, k, tile16, scale_rule == "4/6",
                                   err == "mae", mode, 0 if src is None else src.data_ptr(), int(row_scope),
                                   m, reference._FP32_ONE_SIXTH, data.data_ptr(), scale.data_ptr(),
                                   g.data_ptr()):
            bad.append(True)

    _parallel_rows(quantize_rows, rows, k, 16 if tile16 else 1)
    if bad:
        return reference.quantize(x, **kwargs)  # raises on NaN/Inf
    return NVFP4Tensor(
        data=data.reshape(*shape[:-1], k // 2),
        block_scale=scale.view(torch.float8_e4m3fn).reshape(*shape[:-1], k // BLOCK),
        global_scale=(src if mode == 2 else g).reshape(scale_shape),
        shape=shape,
        dtype=x.dtype,
        tile=tile,
        scale_rule=scale_rule,
        hadamard_seed=None,
    )


# ---- dequantize ------------------------------------------------------------------------------------
def _e4m3_values() -> torch.Tensor:
    """float32 value of each of the 256 E4M3 bytes, from torch's own cast (NaN bytes included)."""
    global _e4m3_table
    if _e4m3_table is None:
        _e4m3_table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return _e4m3_table


def _fast_dequantize_supported(q, dtype) -> bool:
    if not isinstance(q, NVFP4Tensor) or dtype not in _DTYPE_CODES or q.hadamard_seed is not None:
        return False
    data, scale, g = q.data, q.block_scale, q.global_scale
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
               for t in (data, scale, g)):
        return False
    if data.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or g.dtype != torch.float32:
        return False
    if data.ndim == 0 or data.shape[-1] * 2 != q.shape[-1] or q.shape[-1] % BLOCK:
        return False
    if tuple(data.shape[:-1]) != tuple(q.shape[:-1]):
        return False
    if tuple(scale.shape) != (*data.shape[:-1], q.shape[-1] // BLOCK):
        return False
    return g.ndim == 0 or tuple(g.shape) == (*data.shape[:-1], 1)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp4rl.nvfp4.reference.dequantize, computed by the C kernel: (e2m1 * block_scale) * global_scale."""
    if not _fast_dequantize_supported(q, dtype) or not available():
        return reference.dequantize(q, dtype)
    k = q.shape[-1]
    data = q.data.contiguous().reshape(-1, k // 2)
    rows = data.shape[0]
    scale = q.block_scale.contiguous().view(torch.uint8).reshape(rows, k // BLOCK)
    g = q.global_scale.contiguous()
    table = _e4m3_values()
    out_code = 1 if dtype == torch.bfloat16 else 0
    out = torch.empty(rows, k, dtype=torch.bfloat16 if out_code else torch.float32)
    lib = _lib
    bad = []

    def dequantize_rows(r0, r1):
        if lib.nvfp4_dequantize_rows(data.data_ptr(), scale.data_ptr(), g.data_ptr(), int(g.ndim > 0),
                                     table.data_ptr(), r0, r1, k, out_code, out.data_ptr()):
            bad.append(True)

    _parallel_rows(dequantize_rows, rows, k, 1)
    if bad:
        return reference.dequantize(q, dtype)
    out = out.reshape(q.shape)
    return out.to(dtype) if out.dtype != dtype else out


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x, **kwargs)) in x's dtype and shape."""
    return dequantize(quantize(x, **kwargs), dtype=x.dtype)
