"""The [R, NB, 16] tile kernel: NVFP4 quantization of a BR x BC tile, 16-element blocks along
the last axis.

The older of the two kernel families, still the one for stochastic rounding (one Philox uniform per
element from ``tl.rand(seed, index)``, shared by the two 4/6 candidates like the reference's draw), with
16x16 tiles too (one block scale per 16x16 tile: the block amax and the 4/6 error reduced over 16 rows, in
TE's warp-reduction order; without stochastic rounding 16x16 tiles go to blocks.py's
``_quantize_tile16_kernel``), and for per-row scales of rows longer than ``ROWS_MAX_BLOCKS`` blocks.
Per-row scales are computed in the kernel (each program reads its rows twice: once for the row amax, once
to quantize; the second read hits L1/L2); a
per-tensor amax comes from fp4rl.kernels.quantize.amax as partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4rl.kernels._common import e2m1_value
from fp4rl.kernels.quantize.arith import FLT_MAX, ONE_SIXTH, _e4m3_bits, _e4m3_round, _round_e2m1, _sum16_2d


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
    """[R, NB, 16] -> [R, NB]: e[..., 0] + e[..., 1] + ... + e[..., 15], strictly left to right.
    The blocks' [N, 16] sum on the flattened tile: the same 15 FP32 adds in the same order, so the
    same bits (the reshapes move data, no arithmetic)."""
    return tl.reshape(_sum16_2d(tl.reshape(e, (R * NB, 16)), R * NB), (R, NB))


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

