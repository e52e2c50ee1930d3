"""The one-block-per-thread Triton kernels (the default): [N, 16] tiles, one 16-element block
per thread.

A blocked layout with 16 elements per thread along the last dim holds each block in one thread,
so the block max, the scale, the 4/6 errors and the nibble packing need no data exchange between
threads, and all of a program's loads are issued before the first use (one pass; the measured
bound of the [R, NB, 16] tile kernel was latency, not issue). Same arithmetic, same order, so
the same bytes as the reference. ``_quantize_flat_kernel`` takes a per-tensor or imposed scale
(blocks of the flat tensor); ``_quantize_rows_kernel`` holds whole rows to compute per-row
scales in one pass; ``_quantize_tile16_kernel`` takes 16x16 tiles (one scale per tile: the tiles'
max and 4/6 error reduced over per-block values). ``_quantize_blocks``, ``_global_from_amax`` are
shared with the Gluon versions (fp4rl.kernels.quantize.gluon_blocks).

4/6 error: the division x / 1536 is replaced by the FMA-corrected reciprocal ``_div1536``
(exact for every float32) while the program's amaxes keep every product in range, IEEE
division otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4rl.kernels.quantize.arith import (
    FLT_MAX,
    ONE_SIXTH,
    _div1536,
    _e4m3_bits,
    _e4m3_round,
    _like,
    _round_e2m1,
    _round_e2m1_v,
    _sum16_2d,
)


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
def _tile_max(v, N: tl.constexpr, NBC: tl.constexpr):
    """[N] per-block values of 16x16 tiles (block i = (tile row t, row r, column c), i = (16 t + r) NBC + c)
    -> each tile's max over its 16 rows, broadcast back to [N] (max is exact in any order)."""
    BT: tl.constexpr = N // (16 * NBC)
    t = tl.max(tl.reshape(v, (BT, 16, NBC)), 1)
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BT, 16, NBC)), (N,))



@triton.jit
def _tile_sum(v, N: tl.constexpr, NBC: tl.constexpr):
    """[N] row errors of 16x16 tiles (laid out as in _tile_max) -> each tile's sum, broadcast back to [N], in
    TransformerEngine's warp-reduction order: rows r + r+8, then r + r+4, r + r+2, r + r+1. Each level is a
    sum over an axis of two: one rounded addition, the same bits whichever operand comes first."""
    BT: tl.constexpr = N // (16 * NBC)
    t = tl.sum(tl.reshape(v, (BT, 2, 8, NBC)), 1)  # [BT, 8, NBC]: row j + row j+8
    t = tl.sum(tl.reshape(t, (BT, 2, 4, NBC)), 1)
    t = tl.sum(tl.reshape(t, (BT, 2, 2, NBC)), 1)
    t = tl.sum(tl.reshape(t, (BT, 2, NBC)), 1)  # [BT, NBC]
    return tl.reshape(tl.broadcast_to(t[:, None, :], (BT, 16, NBC)), (N,))



@triton.jit
def _quantize_blocks(xb, s_enc, s_dec, g, amax, N: tl.constexpr, IMPOSED_G: tl.constexpr,
                     RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr):
    """Blocks xb [N, 16] (float32) -> (codes [N, 16] int32, block scales [N] as float32 E4M3 values).
    s_enc, s_dec, g, amax: [N] (per block)."""
    return _quantize_blocks_tiled(xb, s_enc, s_dec, g, amax, N, IMPOSED_G, RULE46, MAE, ALLOW_NF, 0)



@triton.jit
def _quantize_blocks_tiled(xb, s_enc, s_dec, g, amax, N: tl.constexpr, IMPOSED_G: tl.constexpr,
                           RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr,
                           NBC: tl.constexpr):
    """_quantize_blocks; NBC > 0: the blocks are 16x16 tiles' rows, NBC tiles wide (laid out as _tile_max
    says), one scale per tile from its max and (4/6) its summed error."""
    a = tl.abs(xb)
    if ALLOW_NF:
        a = tl.where(a < float("inf"), a, 0.0)
    bamax = tl.max(a, 1)  # [N]
    if NBC > 0:
        bamax = _tile_max(bamax, N, NBC)
    if RULE46:
        base = tl.math.div_rn(bamax, _like(bamax, 6.0)) * s_enc
        s6 = _e4m3_round(base)
        s4 = _e4m3_round(base * 1.5)
        # the division-free x / 1536 is exact while no product underflows or overflows (checked on
        # every float32); outside 2^-70 <= amax <= 2^100 the program takes IEEE division
        fast = (tl.min(amax, 0) >= 8.470329472543003e-22) & (tl.max(amax, 0) <= 1.2676506002282294e30)
        # One candidate at a time (registers: only xb and a few per-block floats stay live): the error
        # of 6, then of 4, then the codes of the chosen scale once more; the same encode factor and
        # rounding as each candidate's, so the same codes.
        enc6 = tl.minimum(tl.math.div_rn(_like(s6, 1.0), s6 * s_dec), FLT_MAX)
        err6 = _error_2d(_round_e2m1_v(xb * enc6[:, None], ALLOW_NF)[1], s6, xb, g, amax, N, IMPOSED_G, MAE,
                         fast)
        enc4 = tl.minimum(tl.math.div_rn(_like(s4, 1.0), s4 * s_dec), FLT_MAX)
        err4 = _error_2d(_round_e2m1_v(xb * enc4[:, None], ALLOW_NF)[1], s4, xb, g, amax, N, IMPOSED_G, MAE,
                         fast)
        if NBC > 0:
            err6 = _tile_sum(err6, N, NBC)
            err4 = _tile_sum(err4, N, NBC)
        pick4 = err4 < err6
        s = tl.where(pick4, s4, s6)
        codes = _round_e2m1(xb * tl.where(pick4, enc4, enc6)[:, None], xb, False, ALLOW_NF)
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




@triton.jit
def _quantize_tile16_kernel(
    x_ptr, d_ptr, s_ptr, g_ptr, given_ptr, part_ptr, n_part, R, nb_row,
    SCALE_SRC: tl.constexpr,  # 0: tensor amax from partials, 2: given amax, 3: given g
    RULE46: tl.constexpr, MAE: tl.constexpr, ALLOW_NF: tl.constexpr,
    BT: tl.constexpr, NBC: tl.constexpr, PMAX: tl.constexpr,
):
    """16x16 tiles (one scale per tile; per-tensor or imposed global scale), one 16-element block per thread:
    BT tile rows (16 BT rows of x) by NBC tile columns per program; the tiles' max and 4/6 error are reduced
    over [N] per-block values only (_tile_max, _tile_sum), so no thread redoes another's elements."""
    N: tl.constexpr = BT * 16 * NBC
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    i = tl.arange(0, N)
    row = pid_r * (16 * BT) + i // NBC
    col = pid_c * NBC + i % NBC
    bmask = (row < R) & (col < nb_row)
    blk = row.to(tl.int64) * nb_row + col  # (int64: past 2^31 blocks)
    x = tl.load(x_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :], mask=bmask[:, None],
                other=0.0).to(tl.float32)
    if SCALE_SRC == 0:
        p = tl.arange(0, PMAX)
        amax = tl.max(tl.load(part_ptr + p, mask=p < n_part, other=0), 0).to(tl.float32, bitcast=True)
    else:
        amax = tl.load(given_ptr)
    s_enc, s_dec, g = _global_from_amax(amax, RULE46, SCALE_SRC)
    amax = tl.broadcast_to(amax, (N,))
    codes, s = _quantize_blocks_tiled(x, tl.broadcast_to(s_enc, (N,)), tl.broadcast_to(s_dec, (N,)),
                                      tl.broadcast_to(g, (N,)), amax, N, SCALE_SRC == 3, RULE46, MAE,
                                      ALLOW_NF, NBC)
    _store_blocks(d_ptr, s_ptr, blk, bmask, codes, s, N)
    if (pid_r == 0) & (pid_c == 0):
        tl.store(g_ptr, g)
