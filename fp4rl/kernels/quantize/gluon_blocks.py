"""Gluon versions of the one-block-per-thread kernels, rule 6 (the CUDA default).

The same two kernels as fp4rl.kernels.quantize.blocks with the layout written out: 16 elements
(one block, two 16-byte loads) per thread, so the block max and the nibble packing stay in the
thread (Triton's own layout puts a block on two threads). They call the same @triton.jit
arithmetic helpers, so the same bytes. Gluon is Triton's experimental explicit-layout dialect:
its API moves between releases, these are written for Triton 3.6, and the dispatcher falls back to
the Triton kernels (with a warning) if they fail to compile; the CPU interpreter never runs them.
The 4/6 rule does not compile in Gluon (Triton 3.6, checked offline) and is never launched there.
"""

from __future__ import annotations

from fp4rl.kernels.quantize.arith import _e4m3_bits
from fp4rl.kernels.quantize.blocks import _global_from_amax, _quantize_blocks

try:  # Gluon (explicit layouts) for the GPU block kernels; the CPU interpreter runs the Triton ones
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None


if gluon is not None:

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

