"""NVFP4 quantization in Triton, byte-identical to fp4rl.nvfp4.reference for deterministic modes.

The arithmetic is the reference's (TransformerEngine's), step for step in FP32, with IEEE
division (``div_rn``: never an approximate reciprocal) and without FMA contraction (the kernel
is compiled with ``enable_fp_fusion=False``, so a*b+c stays two roundings):

    amax  -> S_enc = min(M / amax, FLT_MAX) (1 if amax is 0 or S_enc is 0), S_dec = 1 / S_enc,
             g = amax / M                                 (M = 2688, or 1536 for 4/6)
    rule 6:   s = e4m3(block_amax * (S_enc * fp32(1/6)))
    rule 4/6: base = (block_amax / 6) * S_enc; s6 = e4m3(base), s4 = e4m3(base * 1.5)
    enc   = min(1 / (s * S_dec), FLT_MAX); code = e2m1_rne(x * enc)
    4/6 choice: per block, the summed squared (mse) or absolute (mae) error of
             ((e2m1 * s) * amax) / 1536 against x, added left to right over the 16 elements
             (and, for 16x16 tiles, the 16 row sums as a tree: rows i + i+8, i + i+4, ...);
             4 wins only when strictly lower.

E4M3 rounding is done with integer arithmetic (round-half-even on the 3 mantissa bits, or on
multiples of 2^-9 below 2^-6) so that the CPU interpreter and the GPU agree bit for bit.

Two launches for a per-tensor scale (an amax pass writing per-program partial maxima, then the
quantize pass, which reduces the partials itself), one for per-row scales (each program reads
its rows twice: once for the row amax, once to quantize; the second read hits L1/L2).
amax is taken as an integer max over |x|'s bit patterns, exact and order-free; the same pass
flags NaN/Inf (bit patterns >= 0x7F800000) so that the caller can refuse them.

Stochastic rounding draws one uniform per element from Philox (``tl.rand(seed, index)``),
shared by the two 4/6 candidates like the reference's draw; it is unbiased, not byte-equal to
torch's generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import COMPILED, INTERPRET, e2m1_value

try:  # Gluon (explicit layouts) for the GPU block kernels; the CPU interpreter runs the Triton ones
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None

FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1/6), as TE folds it
PMAX = 1024  # most amax partials the quantize pass reduces


@triton.jit
def _amax_kernel(x_ptr, part_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """part[0] = max |x| bits over finite x, part[1] = max raw |x| bits (NaN/Inf flag), by atomic max over
    programs (exact and order-free; part must start at 0)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    raw = tl.zeros((BLOCK,), tl.int32)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        raw = tl.maximum(raw, bits)
        acc = tl.maximum(acc, tl.where(bits >= 0x7F800000, 0, bits))
    tl.atomic_max(part_ptr, tl.max(acc, 0))
    tl.atomic_max(part_ptr + 1, tl.max(raw, 0))


@triton.jit
def _e4m3_round(v):
    """float32 v >= 0 -> the E4M3 value nearest to min(v, 448) (ties to even), as float32."""
    v = tl.minimum(v, 448.0)
    b = v.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((v * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # multiples of 2^-9
    return tl.where(v >= 0.015625, normal, sub)


@triton.jit
def _e4m3_bits(r):
    """An exact E4M3 value (float32) -> its bit pattern (int32 0..126)."""
    b = r.to(tl.int32, bitcast=True)
    normal = (((b >> 23) - 120) << 3) | ((b >> 20) & 7)
    return tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))


@triton.jit
def _round_e2m1(z, u, STOCH: tl.constexpr, NONFINITE: tl.constexpr):
    """Scaled float32 z -> E2M1 codes (int32): RNE saturating at 6, or stochastic with uniforms u."""
    a = tl.abs(z)
    if STOCH:
        a = tl.minimum(a, 6.0)
        idx = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
               + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
               + (a >= 6.0).to(tl.int32))
        step = tl.where(idx < 4, 0.5, tl.where(idx < 6, 1.0, tl.where(idx == 6, 2.0, 1.0)))
        up = (a - e2m1_value(idx)) / step  # exact: step is a power of two
        idx = idx + (u < up).to(tl.int32)
        idx = tl.where(z == z, idx, 0)  # NaN -> code 0
    else:
        # Round half to even on the E2M1 grid, one binade at a time: the grid step is 0.5 below
        # 2, 1 below 4 and 2 above, so rint(|z| / step) (RNE via + 2^23 - 2^23, exact here) is the
        # grid point, and the code is that integer plus the binade's offset. The same code as the
        # reference's thresholds (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
        # 5 -> 4), in a third of the instructions.
        a = tl.minimum(a, 6.0)
        lt2 = a < 2.0
        lt4 = a < 4.0
        t = a * tl.where(lt2, 2.0, tl.where(lt4, 1.0, 0.5))
        r = (t + 8388608.0).to(tl.int32, bitcast=True)  # 0x4B000000 + rint(t)
        idx = r + tl.where(lt2, -0x4B000000, tl.where(lt4, 2 - 0x4B000000, 4 - 0x4B000000))
        if NONFINITE:
            idx = tl.where(z == z, idx, 0)  # NaN -> code 0 (min() above would have made it 6)
    return idx | ((z < 0).to(tl.int32) << 3)


@triton.jit
def _encode(xb, s, s_dec, u, STOCH: tl.constexpr, NONFINITE: tl.constexpr):
    """Codes [R, NB, 16] of blocks xb under block scales s [R, NB] (E4M3 values as float32)."""
    enc = tl.minimum(tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s * s_dec), FLT_MAX)
    return _round_e2m1(xb * enc[:, :, None], u, STOCH, NONFINITE)


@triton.jit
def _halves(t, R: tl.constexpr, NB: tl.constexpr, W: tl.constexpr):
    """[R, NB, W] -> its even and odd positions along the last axis, [R, NB, W/2] each."""
    return tl.split(tl.reshape(t, (R, NB, W // 2, 2)))


@triton.jit
def _sum16(e, R: tl.constexpr, NB: tl.constexpr):
    """[R, NB, 16] -> [R, NB]: e[..., 0] + e[..., 1] + ... + e[..., 15], strictly left to right."""
    e0, e1 = _halves(e, R, NB, 16)  # 0 2 4 .. 14 | 1 3 .. 15
    e00, e01 = _halves(e0, R, NB, 8)  # 0 4 8 12 | 2 6 10 14
    e10, e11 = _halves(e1, R, NB, 8)  # 1 5 9 13 | 3 7 11 15
    a0, a4 = _halves(e00, R, NB, 4)  # 0 8 | 4 12
    a2, a6 = _halves(e01, R, NB, 4)  # 2 10 | 6 14
    a1, a5 = _halves(e10, R, NB, 4)  # 1 9 | 5 13
    a3, a7 = _halves(e11, R, NB, 4)  # 3 11 | 7 15
    c0, c8 = tl.split(a0)
    c4, c12 = tl.split(a4)
    c2, c10 = tl.split(a2)
    c6, c14 = tl.split(a6)
    c1, c9 = tl.split(a1)
    c5, c13 = tl.split(a5)
    c3, c11 = tl.split(a3)
    c7, c15 = tl.split(a7)
    t = c0 + c1
    t = t + c2
    t = t + c3
    t = t + c4
    t = t + c5
    t = t + c6
    t = t + c7
    t = t + c8
    t = t + c9
    t = t + c10
    t = t + c11
    t = t + c12
    t = t + c13
    t = t + c14
    t = t + c15
    return t


@triton.jit
def _tile_tree(t, R: tl.constexpr, NB: tl.constexpr):
    """Row sums [R, NB] of 16x16 tiles -> tile sums broadcast back to [R, NB]:
    rows i + i+8, then i + i+4, i + i+2, i + i+1 (TE's warp-reduction order)."""
    TR: tl.constexpr = R // 16
    v = tl.reshape(t, (TR, 2, 8, NB))
    a, b = tl.split(tl.permute(v, (0, 2, 3, 1)))  # [TR, 8, NB]: rows 0-7 | 8-15
    v = tl.reshape(a + b, (TR, 2, 4, NB))
    a, b = tl.split(tl.permute(v, (0, 2, 3, 1)))
    v = tl.reshape(a + b, (TR, 2, 2, NB))
    a, b = tl.split(tl.permute(v, (0, 2, 3, 1)))
    v = tl.reshape(a + b, (TR, 2, 1, NB))
    a, b = tl.split(tl.permute(v, (0, 2, 3, 1)))  # [TR, 1, NB]
    return tl.reshape(tl.broadcast_to(a + b, (TR, 16, NB)), (R, NB))


@triton.jit
def _block_error(codes, s, xb, g, err_amax, R: tl.constexpr, NB: tl.constexpr,
                 IMPOSED_G: tl.constexpr, MAE: tl.constexpr, TILE16: tl.constexpr):
    values = e2m1_value(codes) * s[:, :, None]
    if IMPOSED_G:
        decoded = values * g
    else:
        decoded = tl.math.div_rn(values * err_amax, tl.full(values.shape, 1536.0, tl.float32))
    diff = decoded - xb
    if MAE:
        e = tl.abs(diff)
    else:
        e = diff * diff
    total = _sum16(e, R, NB)
    if TILE16:
        total = _tile_tree(total, R, NB)
    return total


@triton.jit
def _quantize_kernel(
    x_ptr, d_ptr, s_ptr, g_ptr, given_ptr, flag_ptr, part_ptr, n_part,
    R, K, stride_x, stride_d, stride_s, seed,
    SCALE_SRC: tl.constexpr,  # 0: tensor amax from partials, 1: row amax here, 2: given amax, 3: given g
    PER_ROW: tl.constexpr, RULE46: tl.constexpr, MAE: tl.constexpr, STOCH: tl.constexpr,
    TILE16: tl.constexpr, ALLOW_NF: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, PMAX: tl.constexpr,
):
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)  # [BR]
    rmask = rows < R
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x

    # ---- global scale: S_enc, S_dec (for encoding), g (stored), amax (for the 4/6 error)
    if SCALE_SRC == 0:
        p = tl.arange(0, PMAX)
        amax = tl.max(tl.load(part_ptr + p, mask=p < n_part, other=0), 0).to(tl.float32, bitcast=True)
    elif SCALE_SRC == 1:
        acc = tl.zeros((BR, BC), tl.int32)
        raw = tl.zeros((BR, BC), tl.int32)
        for c0 in range(0, K, BC):
            cols = c0 + tl.arange(0, BC)
            v = tl.load(x_rows + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
            bits = v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            raw = tl.maximum(raw, bits)
            acc = tl.maximum(acc, tl.where(bits >= 0x7F800000, 0, bits))
        amax = tl.max(acc, 1).to(tl.float32, bitcast=True)  # [BR]
        tl.store(flag_ptr + rows, tl.max(raw, 1), mask=rmask)
    elif PER_ROW:
        amax = tl.load(given_ptr + rows, mask=rmask, other=1.0)
    else:
        amax = tl.load(given_ptr)
    if SCALE_SRC == 3:  # imposed decode-direction scale
        g = amax
        s_enc = tl.minimum(tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), g), FLT_MAX)
        s_dec = g
    else:
        if RULE46:
            m_const = tl.full(amax.shape, 1536.0, tl.float32)
        else:
            m_const = tl.full(amax.shape, 2688.0, tl.float32)
        s_enc = tl.minimum(tl.math.div_rn(m_const, amax), FLT_MAX)
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
        g = tl.math.div_rn(amax, m_const)
    if PER_ROW or SCALE_SRC == 1:
        if pid_c == 0:
            tl.store(g_ptr + rows, g, mask=rmask)
        s_enc_b = s_enc[:, None]  # [BR, 1]
        s_dec_b = s_dec[:, None]
        g_b = g[:, None, None]
        amax_b = amax[:, None, None]
    else:
        if (pid_c == 0) & (pid_r == 0):
            tl.store(g_ptr, g)
        s_enc_b = s_enc
        s_dec_b = s_dec
        g_b = g
        amax_b = amax

    if SCALE_SRC == 1:
        c_begin = 0
        c_end = K
    else:
        c_begin = pid_c * BC
        c_end = tl.minimum(K, c_begin + BC)
    for c0 in range(c_begin, c_end, BC):
        cols = c0 + tl.arange(0, BC)  # [BC]
        m2 = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_rows + cols[None, :], mask=m2, other=0.0).to(tl.float32)  # [BR, BC]
        xb = tl.reshape(x, (BR, NB, 16))
        a = tl.abs(xb)
        if ALLOW_NF:
            a = tl.where(a < float("inf"), a, 0.0)  # amax over the finite values only
        bamax = tl.max(a, 2)  # [BR, NB]
        if TILE16:
            t = tl.max(tl.reshape(bamax, (BR // 16, 16, NB)), 1)  # [BR/16, NB]
            bamax = tl.reshape(tl.broadcast_to(t[:, None, :], (BR // 16, 16, NB)), (BR, NB))
        u = xb  # unused unless stochastic
        if STOCH:
            idx = rows.to(tl.int64)[:, None] * K + cols[None, :]
            u = tl.reshape(tl.rand(seed, idx.to(tl.uint32)), (BR, NB, 16))
        if RULE46:
            base = tl.math.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32)) * s_enc_b
            s6 = _e4m3_round(base)
            s4 = _e4m3_round(base * 1.5)
            codes6 = _encode(xb, s6, s_dec_b, u, STOCH, ALLOW_NF)
            codes4 = _encode(xb, s4, s_dec_b, u, STOCH, ALLOW_NF)
            err6 = _block_error(codes6, s6, xb, g_b, amax_b, BR, NB, SCALE_SRC == 3, MAE, TILE16)
            err4 = _block_error(codes4, s4, xb, g_b, amax_b, BR, NB, SCALE_SRC == 3, MAE, TILE16)
            pick4 = err4 < err6
            codes = tl.where(pick4[:, :, None], codes4, codes6)
            s = tl.where(pick4, s4, s6)
        else:
            s = _e4m3_round(bamax * (s_enc_b * ONE_SIXTH))
            codes = _encode(xb, s, s_dec_b, u, STOCH, ALLOW_NF)
        lo, hi = tl.split(tl.reshape(codes, (BR, BC // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        bcols = c0 // 2 + tl.arange(0, BC // 2)
        tl.store(d_ptr + rows.to(tl.int64)[:, None] * stride_d + bcols[None, :], packed,
                 mask=rmask[:, None] & (bcols[None, :] < K // 2))
        scols = c0 // 16 + tl.arange(0, NB)
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_s + scols[None, :], _e4m3_bits(s).to(tl.uint8),
                 mask=rmask[:, None] & (scols[None, :] < K // 16))



# ----------------------------------------------------------------------------- one block per thread
# The kernels below hold each 16-element block in one thread ([N, 16] tiles, a blocked layout with 16
# elements per thread along the last dim), so the block max, the scale, the 4/6 errors and the nibble
# packing need no data exchange between threads, and all of a program's loads are issued before the
# first use (one pass; the measured bound of the [R, NB, 16] kernel above was latency, not issue).
# Same arithmetic, same order, so the same bytes as the reference.


@triton.jit
def _like(t, c):
    """A float32 tensor of t's shape (and layout, also under Gluon) filled with c."""
    return tl.where(t != t, c, c).to(tl.float32)


@triton.jit
def _div1536(v):
    """fp32(v / 1536), correctly rounded, without a division: q = v * c (c = fp32(1/1536)), then one
    FMA-corrected step q + (v - 1536 q) * c (Markstein); the FMAs are explicit (the kernels are compiled
    without contraction). Checked against IEEE division on every float32 mantissa (bench/quant9.py)."""
    c: tl.constexpr = 6.510416860692203e-04  # fp32(1/1536)
    q = v * c
    r = tl.math.fma(-q, 1536.0, v)
    return tl.math.fma(r, c, q)


@triton.jit
def _round_e2m1_v(z, NONFINITE: tl.constexpr):
    """_round_e2m1 (nearest) plus the signed E2M1 value of the code, from the rounding itself
    (rint(t) / step, exact) instead of decoding the code again."""
    a = tl.minimum(tl.abs(z), 6.0)
    lt2 = a < 2.0
    lt4 = a < 4.0
    mult = tl.where(lt2, 2.0, tl.where(lt4, 1.0, 0.5))
    tr = a * mult + 8388608.0  # a * mult is exact: the same value as two roundings
    r = tr.to(tl.int32, bitcast=True)
    idx = r + tl.where(lt2, -0x4B000000, tl.where(lt4, 2 - 0x4B000000, 4 - 0x4B000000))
    v = (tr - 8388608.0) * tl.where(lt2, 0.5, tl.where(lt4, 1.0, 2.0))
    neg = z < 0
    if NONFINITE:
        idx = tl.where(z == z, idx, 0)  # NaN -> code 0 (min() above would have made it 6)
        v = tl.where(z == z, v, 0.0)
    return idx | (neg.to(tl.int32) << 3), tl.where(neg, -v, v)


@triton.jit
def _sum16_2d(e, N: tl.constexpr):
    """[N, 16] -> [N]: e[:, 0] + e[:, 1] + ... + e[:, 15], strictly left to right."""
    e0, e1 = tl.split(tl.reshape(e, (N, 8, 2)))  # 0 2 .. 14 | 1 3 .. 15
    e00, e01 = tl.split(tl.reshape(e0, (N, 4, 2)))  # 0 4 8 12 | 2 6 10 14
    e10, e11 = tl.split(tl.reshape(e1, (N, 4, 2)))  # 1 5 9 13 | 3 7 11 15
    a0, a4 = tl.split(tl.reshape(e00, (N, 2, 2)))  # 0 8 | 4 12
    a2, a6 = tl.split(tl.reshape(e01, (N, 2, 2)))
    a1, a5 = tl.split(tl.reshape(e10, (N, 2, 2)))
    a3, a7 = tl.split(tl.reshape(e11, (N, 2, 2)))
    c0, c8 = tl.split(a0)
    c4, c12 = tl.split(a4)
    c2, c10 = tl.split(a2)
    c6, c14 = tl.split(a6)
    c1, c9 = tl.split(a1)
    c5, c13 = tl.split(a5)
    c3, c11 = tl.split(a3)
    c7, c15 = tl.split(a7)
    t = c0 + c1
    t = t + c2
    t = t + c3
    t = t + c4
    t = t + c5
    t = t + c6
    t = t + c7
    t = t + c8
    t = t + c9
    t = t + c10
    t = t + c11
    t = t + c12
    t = t + c13
    t = t + c14
    t = t + c15
    return t


@triton.jit
def _encode_2d(xb, s, s_dec, NONFINITE: tl.constexpr):
    enc = tl.minimum(tl.math.div_rn(_like(s, 1.0), s * s_dec), FLT_MAX)
    return _round_e2m1(xb * enc[:, None], xb, False, NONFINITE)


@triton.jit
def _encode_v_2d(xb, s, s_dec, NONFINITE: tl.constexpr):
    enc = tl.minimum(tl.math.div_rn(_like(s, 1.0), s * s_dec), FLT_MAX)
    return _round_e2m1_v(xb * enc[:, None], NONFINITE)


@triton.jit
def _error_2d(ev, s, xb, g, err_amax, N: tl.constexpr, IMPOSED_G: tl.constexpr, MAE: tl.constexpr, FAST_DIV):
    """Summed error of one candidate; ev: the signed E2M1 values of its codes."""
    values = ev * s[:, None]
    if IMPOSED_G:
        decoded = values * g[:, None]
    else:
        v = values * err_amax[:, None]
        if FAST_DIV:  # a runtime scalar: the program's amaxes allow the division-free x / 1536
            decoded = _div1536(v)
        else:
            decoded = tl.math.div_rn(v, _like(values, 1536.0))
    diff = decoded - xb
    if MAE:
        e = tl.abs(diff)
    else:
        e = diff * diff
    return _sum16_2d(e, N)


@triton.jit
def _quantize_blocks(xb, s_enc, s_dec, g, amax, N: tl.constexpr, IMPOSED_G: tl.constexpr,
                     RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr):
    """Blocks xb [N, 16] (float32) -> (codes [N, 16] int32, block scales [N] as float32 E4M3 values).
    s_enc, s_dec, g, amax: [N] (per block)."""
    a = tl.abs(xb)
    if ALLOW_NF:
        a = tl.where(a < float("inf"), a, 0.0)
    bamax = tl.max(a, 1)  # [N]
    if RULE46:
        base = tl.math.div_rn(bamax, _like(bamax, 6.0)) * s_enc
        s6 = _e4m3_round(base)
        s4 = _e4m3_round(base * 1.5)
        codes6, ev6 = _encode_v_2d(xb, s6, s_dec, ALLOW_NF)
        codes4, ev4 = _encode_v_2d(xb, s4, s_dec, ALLOW_NF)
        # the division-free x / 1536 is exact while no product underflows or overflows (checked on
        # every float32); outside 2^-70 <= amax <= 2^100 the program takes IEEE division
        fast = (tl.min(amax, 0) >= 8.470329472543003e-22) & (tl.max(amax, 0) <= 1.2676506002282294e30)
        err6 = _error_2d(ev6, s6, xb, g, amax, N, IMPOSED_G, MAE, fast)
        err4 = _error_2d(ev4, s4, xb, g, amax, N, IMPOSED_G, MAE, fast)
        pick4 = err4 < err6
        codes = tl.where(pick4[:, None], codes4, codes6)
        s = tl.where(pick4, s4, s6)
    else:
        s = _e4m3_round(bamax * (s_enc * ONE_SIXTH))
        codes = _encode_2d(xb, s, s_dec, ALLOW_NF)
    return codes, s


@triton.jit
def _global_from_amax(amax, RULE46: tl.constexpr, SCALE_SRC: tl.constexpr):
    """(s_enc, s_dec, g) from amax (or, SCALE_SRC 3, from an imposed decode-direction g)."""
    if SCALE_SRC == 3:
        g = amax
        s_enc = tl.minimum(tl.math.div_rn(_like(g, 1.0), g), FLT_MAX)
        s_dec = g
    else:
        if RULE46:
            m_const = _like(amax, 1536.0)
        else:
            m_const = _like(amax, 2688.0)
        s_enc = tl.minimum(tl.math.div_rn(m_const, amax), FLT_MAX)
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = tl.math.div_rn(_like(amax, 1.0), s_enc)
        g = tl.math.div_rn(amax, m_const)
    return s_enc, s_dec, g


@triton.jit
def _store_blocks(d_ptr, s_ptr, blk, bmask, codes, s, N: tl.constexpr):
    lo, hi = tl.split(tl.reshape(codes, (N, 8, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)  # [N, 8]
    tl.store(d_ptr + blk.to(tl.int64)[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=bmask[:, None])
    tl.store(s_ptr + blk, _e4m3_bits(s).to(tl.uint8), mask=bmask)


@triton.jit
def _quantize_flat_kernel(
    x_ptr, d_ptr, s_ptr, g_ptr, given_ptr, part_ptr, n_part, n_blocks, nb_row,
    SCALE_SRC: tl.constexpr,  # 0: tensor amax from partials, 2: given amax, 3: given g
    PER_ROW: tl.constexpr, RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr,
    N: tl.constexpr, PMAX: tl.constexpr,
):
    """Blocks [pid N, pid N + N) of the flat tensor (a block never straddles a row: K % 16 == 0)."""
    pid = tl.program_id(0)
    blk = pid * N + tl.arange(0, N)
    bmask = blk < n_blocks
    x = tl.load(x_ptr + blk.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :], mask=bmask[:, None],
                other=0.0).to(tl.float32)
    if SCALE_SRC == 0:
        p = tl.arange(0, PMAX)
        amax = tl.max(tl.load(part_ptr + p, mask=p < n_part, other=0), 0).to(tl.float32, bitcast=True)
    elif PER_ROW:
        amax = tl.load(given_ptr + blk // nb_row, mask=bmask, other=1.0)
    else:
        amax = tl.load(given_ptr)
    s_enc, s_dec, g = _global_from_amax(amax, RULE46, SCALE_SRC)  # once (tensor) or per block (rows)
    amax = tl.broadcast_to(amax, (N,))
    codes, s = _quantize_blocks(x, tl.broadcast_to(s_enc, (N,)), tl.broadcast_to(s_dec, (N,)),
                                tl.broadcast_to(g, (N,)), amax, N, SCALE_SRC == 3, RULE46, MAE, ALLOW_NF)
    _store_blocks(d_ptr, s_ptr, blk, bmask, codes, s, N)
    if PER_ROW:
        tl.store(g_ptr + blk // nb_row, g, mask=bmask & (blk % nb_row == 0))
    else:
        if pid == 0:
            tl.store(g_ptr, g)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, d_ptr, s_ptr, g_ptr, flag_ptr, R, nb_row,
    RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr, BR: tl.constexpr, NBP: tl.constexpr,
):
    """Per-row scales in one pass: BR whole rows (nb_row <= NBP blocks each) held in registers; the row
    amax (an integer max over |x|'s bit patterns, exact) and the NaN/Inf flag, then the blocks."""
    N: tl.constexpr = BR * NBP
    pid = tl.program_id(0)
    i = tl.arange(0, N)
    row = pid * BR + i // NBP
    col = i % NBP
    bmask = (col < nb_row) & (row < R)
    blk = row * nb_row + col
    x = tl.load(x_ptr + blk.to(tl.int64)[:, None] * 16 + tl.arange(0, 16)[None, :], mask=bmask[:, None],
                other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    raw = tl.max(tl.reshape(tl.max(bits, 1), (BR, NBP)), 1)  # [BR]
    fin = tl.max(tl.reshape(tl.max(tl.where(bits >= 0x7F800000, 0, bits), 1), (BR, NBP)), 1)
    rows_r = pid * BR + tl.arange(0, BR)
    tl.store(flag_ptr + rows_r, raw, mask=rows_r < R)
    amax_r = fin.to(tl.float32, bitcast=True)
    s_enc_r, s_dec_r, g_r = _global_from_amax(amax_r, RULE46, 1)
    tl.store(g_ptr + rows_r, g_r, mask=rows_r < R)
    amax = tl.reshape(tl.broadcast_to(amax_r[:, None], (BR, NBP)), (N,))
    s_enc = tl.reshape(tl.broadcast_to(s_enc_r[:, None], (BR, NBP)), (N,))
    s_dec = tl.reshape(tl.broadcast_to(s_dec_r[:, None], (BR, NBP)), (N,))
    g = tl.reshape(tl.broadcast_to(g_r[:, None], (BR, NBP)), (N,))
    codes, s = _quantize_blocks(x, s_enc, s_dec, g, amax, N, False, RULE46, MAE, ALLOW_NF)
    _store_blocks(d_ptr, s_ptr, blk, bmask, codes, s, N)


def _configs(k: int, tile16: bool, rule46: bool, row_pass: bool):
    """(BR, BC, num_warps) for the quantize pass: 16-32 elements per thread, no register spills
    when compiled for sm_90 (checked with ptxas; the 16x16 4/6 pass spilled at BC=256, 4 warps)."""
    if INTERPRET:  # few, large programs: the interpreter's cost is per program and per op
        return 16, min(64, triton.next_power_of_2(max(k, 16))), 4
    if tile16:
        return 16, min(128 if rule46 else 256, triton.next_power_of_2(max(k, 16))), 8
    bc = min(256 if rule46 else 512, triton.next_power_of_2(max(k, 16)))
    br = max(1, (1024 if rule46 else 4096) // bc)
    return br, bc, 4



if gluon is not None:
    # The same two kernels in Gluon with the layout written out: 16 elements (one block, two 16-byte
    # loads) per thread, so the block max, the 4/6 sums and the nibble packing stay in the thread (Triton's
    # own layout puts a block on two threads). Same arithmetic helpers, so the same bytes.

    @gluon.jit
    def _g_store(d_ptr, s_ptr, blk, bmask, codes, s, N: gl.constexpr):
        lo, hi = gl.split(gl.reshape(codes, [N, 8, 2]))
        packed = (lo | (hi << 4)).to(gl.uint8)  # [N, 8]
        LP: gl.constexpr = packed.type.layout
        b2 = gl.convert_layout(blk, gl.SliceLayout(1, LP))
        m2 = gl.convert_layout(bmask, gl.SliceLayout(1, LP))
        j = gl.arange(0, 8, layout=gl.SliceLayout(0, LP))
        gl.store(d_ptr + gl.expand_dims(b2.to(gl.int64), 1) * 8 + gl.expand_dims(j, 0), packed,
                 mask=gl.expand_dims(m2, 1))
        gl.store(s_ptr + blk, _e4m3_bits(s).to(gl.uint8), mask=bmask)

    @gluon.jit
    def _g_load(x_ptr, blk, bmask, L: gl.constexpr):
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, L))
        return gl.load(x_ptr + gl.expand_dims(blk.to(gl.int64), 1) * 16 + gl.expand_dims(cols, 0),
                       mask=gl.expand_dims(bmask, 1), other=0.0).to(gl.float32)

    @gluon.jit
    def _quantize_flat_gluon(
        x_ptr, d_ptr, s_ptr, g_ptr, given_ptr, part_ptr, n_blocks, nb_row,
        SCALE_SRC: gl.constexpr, PER_ROW: gl.constexpr, RULE46: gl.constexpr, MAE: gl.constexpr,
        ALLOW_NF: gl.constexpr, N: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        L: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NW, 1], [1, 0])
        LB: gl.constexpr = gl.SliceLayout(1, L)
        pid = gl.program_id(0)
        blk = pid * N + gl.arange(0, N, layout=LB)
        bmask = blk < n_blocks
        x = _g_load(x_ptr, blk, bmask, L)
        zero = gl.zeros([N], gl.float32, LB)
        if SCALE_SRC == 0:  # amax from the atomic-max pass (one value)
            amax = zero + gl.load(part_ptr).to(gl.float32, bitcast=True)
        elif PER_ROW:
            amax = gl.load(given_ptr + blk // nb_row, mask=bmask, other=1.0)
        else:
            amax = zero + gl.load(given_ptr)
        s_enc, s_dec, g = _global_from_amax(amax, RULE46, SCALE_SRC)
        codes, s = _quantize_blocks(x, s_enc, s_dec, g, amax, N, SCALE_SRC == 3, RULE46, MAE, ALLOW_NF)
        _g_store(d_ptr, s_ptr, blk, bmask, codes, s, N)
        if PER_ROW:
            gl.store(g_ptr + blk // nb_row, g, mask=bmask & (blk % nb_row == 0))
        else:
            gl.store(g_ptr + blk * 0, g, mask=blk == 0)

    @gluon.jit
    def _quantize_rows_gluon(
        x_ptr, d_ptr, s_ptr, g_ptr, flag_ptr, nb_row,
        RULE46: gl.constexpr, MAE: gl.constexpr, ALLOW_NF: gl.constexpr, NBP: gl.constexpr,
    ):
        """One row per program, its NBP >= nb_row blocks one per thread."""
        NW: gl.constexpr = gl.num_warps()
        L: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NW, 1], [1, 0])
        LB: gl.constexpr = gl.SliceLayout(1, L)
        row = gl.program_id(0)
        col = gl.arange(0, NBP, layout=LB)
        bmask = col < nb_row
        blk = row * nb_row + col
        x = _g_load(x_ptr, blk, bmask, L)
        bits = x.to(gl.int32, bitcast=True) & 0x7FFFFFFF
        raw = gl.max(gl.max(bits, 1), 0)
        fin = gl.max(gl.max(gl.where(bits >= 0x7F800000, 0, bits), 1), 0)
        gl.store(flag_ptr + row, raw)
        amax = gl.zeros([NBP], gl.float32, LB) + fin.to(gl.float32, bitcast=True)
        s_enc, s_dec, g = _global_from_amax(amax, RULE46, 1)
        codes, s = _quantize_blocks(x, s_enc, s_dec, g, amax, NBP, False, RULE46, MAE, ALLOW_NF)
        _g_store(d_ptr, s_ptr, blk, bmask, codes, s, NBP)
        gl.store(g_ptr + row + col * 0, g, mask=col == 0)


# The one-block-per-thread kernels (the default); BLOCKS["on"] = False selects the older [R, NB, 16] tiles
# (still used for 16x16 tiles, stochastic rounding and per-row scales of rows longer than
# ROWS_MAX_BLOCKS blocks).
BLOCKS = {"on": True}
GLUON_BLOCKS = {"on": True, "error": None}  # Gluon versions of the rule-6 block kernels on CUDA
ROWS_MAX_BLOCKS = 512


def _launch_blocks(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, mae, allow_nf,
                   scale_rule, err):
    r, k = x.shape
    nb_row = k // 16
    name = f"quantize blocks src{src} {scale_rule} {err}"
    if GLUON_BLOCKS["on"] and gluon is not None and x.is_cuda and not INTERPRET and not rule46:
        try:
            if src == 1:
                nbp = max(32, triton.next_power_of_2(nb_row))
                COMPILED[name + " gluon"] = _quantize_rows_gluon[(r,)](
                    x, data, scale, g, flag, nb_row, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, NBP=nbp,
                    num_warps=min(8, nbp // 32), enable_fp_fusion=False)
            else:
                n_blocks = r * nb_row
                nblk = 128 if rule46 else 256
                COMPILED[name + " gluon"] = _quantize_flat_gluon[(triton.cdiv(n_blocks, nblk),)](
                    x, data, scale, g, given, parts if parts is not None else g, n_blocks, nb_row,
                    SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, N=nblk,
                    num_warps=nblk // 32, enable_fp_fusion=False)
            return
        except Exception as exc:  # noqa: BLE001  (Gluon failed to compile or launch here)
            import warnings

            GLUON_BLOCKS["on"], GLUON_BLOCKS["error"] = False, repr(exc)[:300]
            warnings.warn(f"Gluon quantize disabled ({GLUON_BLOCKS['error']}); using the Triton kernels",
                          stacklevel=3)
    if src == 1:
        nbp = triton.next_power_of_2(nb_row)
        br = max(1, (128 if rule46 else 256) // nbp)
        warps = max(1, min(8, br * nbp // (32 if rule46 else 64)))
        COMPILED[name] = _quantize_rows_kernel[(triton.cdiv(r, br),)](
            x, data, scale, g, flag, r, nb_row, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, BR=br, NBP=nbp,
            num_warps=warps, enable_fp_fusion=False)
    else:
        n_blocks = r * nb_row
        nblk = 128 if rule46 else 256
        COMPILED[name] = _quantize_flat_kernel[(triton.cdiv(n_blocks, nblk),)](
            x, data, scale, g, given, parts if parts is not None else g, n_part, n_blocks, nb_row,
            SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, N=nblk,
            PMAX=PMAX,
            num_warps=nblk // (32 if rule46 else 64), enable_fp_fusion=False)


def _launch_tiles(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, err, allow_nf,
                  tile16, stochastic, seed, scale_rule):
    r, k = x.shape
    br, bc, warps = _configs(k, tile16, rule46, src == 1)
    grid = (triton.cdiv(r, br), 1 if src == 1 else triton.cdiv(k, bc))
    name = f"quantize src{src} {scale_rule} {err}{' 16x16' if tile16 else ''}{' sr' if stochastic else ''}"
    COMPILED[name] = _quantize_kernel[grid](
        x, data, scale, g, given, flag if flag is not None else g, parts if parts is not None else g,
        n_part, r, k, x.stride(0), data.stride(0), scale.stride(0), seed,
        SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=err == "mae",
        STOCH=stochastic, TILE16=tile16, ALLOW_NF=allow_nf, BR=br, BC=bc, PMAX=PMAX,
        num_warps=warps, enable_fp_fusion=False,
    )


def amax_partials(x: torch.Tensor):
    """max |x| bit patterns: (parts int32 [2, 1], 1). parts[0] is over the finite values, parts[1] over
    all (>= 0x7F800000 means NaN or Inf). Many small programs (loads in flight), one atomic max each."""
    flat = x.reshape(-1)
    numel = flat.numel()
    block, iters = (256, 4) if INTERPRET else (4096, 4)
    n_prog = max(1, triton.cdiv(numel, block * iters))
    parts = torch.zeros(2, 1, dtype=torch.int32, device=x.device)
    _amax_kernel[(n_prog,)](flat, parts, numel, BLOCK=block, ITERS=iters, num_warps=8)
    return parts, 1


def quantize_2d(
    x: torch.Tensor,
    *,
    tile16: bool = False,
    scale_rule: str = "6",
    err: str = "mse",
    stochastic: bool = False,
    per_row: bool = False,
    amax: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    allow_nonfinite: bool = False,
    check_finite: bool = True,
    seed: int = 0,
):
    """Quantize a 2-D tensor x [R, K] (K a multiple of 16; float32/bfloat16/float16) to NVFP4.

    Returns (data uint8 [R, K/2], block_scale float8_e4m3fn [R, K/16], global_scale float32:
    [] per tensor or [R] per row). per_row: one global scale per row (the activation recipe).
    amax / global_scale: imposed ([] or [R] float32 on x's device), as in the reference.
    check_finite: raise on NaN/Inf (a device sync; pass False inside CUDA graphs), unless
    allow_nonfinite, which quantizes them as the reference does (amaxes over the finite values,
    NaN -> code 0, Inf -> +-6).
    """
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"quantize_2d needs x [R, K] with K a multiple of 16, got {tuple(x.shape)}")
    if tile16 and (per_row or x.shape[0] % 16):
        raise ValueError("16x16 tiles need a per-tensor scale and a row count that is a multiple of 16")
    x = x.contiguous()
    r, k = x.shape
    dev = x.device
    data = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(r, k // 16, dtype=torch.uint8, device=dev)
    rows_scaled = per_row and global_scale is None and amax is None
    imposed = global_scale if global_scale is not None else amax
    per_row_given = imposed is not None and imposed.numel() > 1
    g = torch.empty(r if (rows_scaled or per_row_given or per_row) else 1, dtype=torch.float32, device=dev)
    flag = parts = None
    n_part = 0
    if global_scale is not None:
        src = 3
    elif amax is not None:
        src = 2
    elif rows_scaled:
        src = 1
        flag = torch.empty(r, dtype=torch.int32, device=dev)
    else:
        src = 0
        parts, n_part = amax_partials(x)
    given = imposed.float().reshape(-1).contiguous() if imposed is not None else g
    rule46 = scale_rule == "4/6"
    if BLOCKS["on"] and not tile16 and not stochastic and (src != 1 or k // 16 <= ROWS_MAX_BLOCKS):
        _launch_blocks(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46,
                       err == "mae", allow_nonfinite, scale_rule, err)
    else:
        _launch_tiles(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, err,
                      allow_nonfinite, tile16, stochastic, seed, scale_rule)
    if check_finite and not allow_nonfinite:
        if src in (0, 1):
            raw = (parts[1] if src == 0 else flag).max()
        else:
            raw = (x.float().abs().view(torch.int32)).max()
        if int(raw) >= 0x7F800000:
            raise ValueError(
                "x contains NaN or Inf; fix the producer, or pass allow_nonfinite=True "
                "(NaN -> code 0 and ignored by amax, +-Inf -> +-6)"
            )
    out_g = g if g.numel() > 1 or per_row else g.reshape(())
    return data, scale.view(torch.float8_e4m3fn), out_g

