"""W4A16 decode GEMV for 1-2 rows of x, written in Gluon (Triton's explicit-layout dialect).

What bounds a W4A16 GEMV on Hopper is not the memory but the integer pipe: there is no FP4
conversion instruction, and turning 8 E2M1 codes into bfloat16 costs 17 integer instructions
with byte tables (fp4rl.kernels._common), ~2.1 per weight, against 64 integer lanes per clock
per SM: ~7.4 us for a 4096 x 14336 weight, about its byte floor (7.7 us at 4.27 TB/s), before
any FMA, conversion or address arithmetic. Measured on the H200 (bench/gpu_kernels.md): the
plain-Triton kernels and a first Gluon version without any layout conversion or barrier in the
loop all ran at 26-28 us for that weight, whatever their tiling: the instruction mix, not the
structure, was the limit. This kernel removes most of the non-unpack instructions:

- tensor cores per warp: one mma.sync.m16n8k16 per 32-bit weight word (8 codes) and lane
  replaces eight FP32 FMAs and the bfloat16 -> FP32 widening (see the comment at _MMA);
- the weights are loaded as 32-bit words (16-byte loads), never split into bytes;
- x goes into the MMA's B operand as the bf16 pairs it is stored as (no conversion);
- every operand is laid out by hand (Gluon): no shared memory and no barrier in the loop; the
  next one or two tiles are loaded into registers before the current one is computed;
- optional "gemv32" code layout (swizzle()): the bits of each 32-bit word are permuted once
  (e.g. per weight sync on the sampler) so that a bfloat16 pair comes out of 8 codes with shifts
  and masks (8 integer-pipe instructions per 8 codes instead of 17).

Arithmetic: bf16 operands e2m1 * block_scale (exact) times x, FP32 accumulation in the tensor
core, the FP32 global scale once on the sum (as fp4rl.kernels.gemm); split-K partials are added
in split order by the last program of each tile, so results do not depend on scheduling.

Only compiled on CUDA (Gluon has no CPU interpreter); ``available()`` says whether it imports
here, and fp4rl.kernels.gemm falls back to its Triton kernels if it fails to compile or run.
"""

from __future__ import annotations

import torch

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001
    gluon = gl = None
    _IMPORT_ERROR = exc

import triton
import triton.language as tl

from fp4rl.kernels._common import COMPILED, INTERPRET

STATE = {"ok": _IMPORT_ERROR is None, "error": repr(_IMPORT_ERROR) if _IMPORT_ERROR else None}


def available() -> bool:
    return STATE["ok"]


def disable(exc: Exception) -> None:
    """Stop using the Gluon GEMV in this process (it failed to compile or run here)."""
    import warnings

    STATE["ok"], STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"Gluon W4A16 GEMV disabled ({STATE['error']}); using the Triton decode kernel",
                  stacklevel=3)


# ----------------------------------------------------------------------------- code layouts
# The weights are loaded as 32-bit words (8 codes each); loading bytes made Triton split every
# byte into its own register and re-pack it for the asm (~2 extra integer instructions per
# weight, on the integer pipe that bounds these kernels). Two code layouts:
# - LAYOUT 0: the NVFP4 bytes as stored (table unpack of fp4rl.kernels._common);
# - LAYOUT 1: "gemv32", the same codes with the bits of each 32-bit word permuted (swizzle())
#   so that every bfloat16 pair (element 2j in the low half, 2j+1 in the high half) comes out
#   with shifts and masks: sign -> bit 15, the 3 magnitude bits -> bits 8..6, which is the
#   bfloat16 pattern of e2m1 * 2^-126 (subnormal for 0.5: exact); the block scale then enters
#   as bf16(s * 2^118) and the result is e2m1 * s * 2^-8 (exact), the 2^8 going to the global
#   scale. 8 integer-pipe instructions per 8 codes instead of 21.
# Bit map of a gemv32 word for the pair j (lo half element 2j, hi half element 2j+1), per half:
# pair 0: s 15, e1 8, e0 7, m 6 (mask only); pair 1: the same minus 3 (shift left 3);
# pair 2: minus 6 (shift left 6); pair 3: s 14, e1 13, e0 11, m 10.
_SWZ_DST = {0: (15, 8, 7, 6), 1: (12, 5, 4, 3), 2: (9, 2, 1, 0), 3: (14, 13, 11, 10)}  # (s, e1, e0, m)


def _bit_moves():
    """(src, dst) bit moves from a standard NVFP4 word to a gemv32 word."""
    moves = []
    for j in range(4):  # pair j = byte j: low nibble -> low half, high nibble -> high half
        for half in range(2):
            nib = 8 * j + 4 * half  # code bits: m nib+0, e0 nib+1, e1 nib+2, s nib+3
            s, e1, e0, m = (d + 16 * half for d in _SWZ_DST[j])
            moves += [(nib + 3, s), (nib + 2, e1), (nib + 1, e0), (nib + 0, m)]
    return moves


_MOVES = _bit_moves()


def _permute_words(data: torch.Tensor, moves) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.shape[-1] % 4:
        raise ValueError(f"packed NVFP4 data must be uint8 with K/2 a multiple of 4, got {data.dtype} "
                         f"{tuple(data.shape)}")
    w = data.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for src, dst in moves:
        out |= ((w >> src) & 1) << dst
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).reshape(data.shape)


def _moves_asm(moves) -> str:
    """PTX for one word: the bit moves grouped by distance (one and/shift/or per distance)."""
    groups: dict[int, int] = {}
    for src, dst in moves:
        groups[dst - src] = groups.get(dst - src, 0) | (1 << src)
    lines = ["{\n.reg .b32 t, o;\nmov.b32 o, 0;\n"]
    for d, mask in sorted(groups.items()):
        lines.append(f"and.b32 t, $1, {mask:#010x};\n")
        if d:
            lines.append(f"{'shl' if d > 0 else 'shr'}.b32 t, t, {abs(d)};\n")
        lines.append("or.b32 o, o, t;\n")
    return "".join(lines) + "mov.b32 $0, o;\n}\n"


_SWZ_ASM = _moves_asm(_MOVES)


@triton.jit
def _swizzle_kernel(src_ptr, dst_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(src_ptr + offs, mask=m, other=0)
    o = tl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(dst_ptr + offs, o, mask=m)


def swizzle(data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Standard packed NVFP4 bytes [..., K/2] -> the gemv32 layout (same shape and size); on CUDA one
    memory-bound kernel (into `out` if given), elsewhere torch integer ops."""
    if not (data.is_cuda and not INTERPRET):
        return _permute_words(data, _MOVES)
    if data.dtype != torch.uint8 or data.shape[-1] % 4:
        raise ValueError(f"packed NVFP4 data must be uint8 with K/2 a multiple of 4, got {data.dtype} "
                         f"{tuple(data.shape)}")
    src = data.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(data) if out is None else out
    dst = out.view(torch.int32).reshape(-1)
    _swizzle_kernel[(triton.cdiv(src.numel(), 4096),)](src, dst, src.numel(), ASM=_SWZ_ASM, BLOCK=4096)
    return out


def unswizzle(data: torch.Tensor) -> torch.Tensor:
    """gemv32 -> standard packed NVFP4 bytes."""
    return _permute_words(data, [(d, s) for s, d in _MOVES])


# ----------------------------------------------------------------------------- tensor cores per warp
# One mma.sync.m16n8k16 (bf16 in, FP32 accumulate) per 32-bit weight word and thread replaces the
# eight FP32 FMAs and the bf16 -> FP32 widening. In a warp, lane t = 4q + c holds words of weight
# row q (of 8) at word offset c (of 4): its word's codes e0..e7 become the A fragment
# a_j = (e_2j, e_2j+1) (rows q, q+8 of the 16x16 A tile, k = 2c, 2c+1, 2c+8, 2c+9). The eight B
# columns carry x: column 0 = x codes (0, 1 | 4, 5) of each lane's word, column 1 = (2, 3 | 6, 7),
# columns 2-3 the same for the second row of x, 4-7 zero; so D[q][0] + D[q+8][1] is the dot
# product of weight row q with x row 0 over the 32 codes (D[q][2] + D[q+8][3]: x row 1). B is
# made of x's bf16 pairs as they are in memory (no conversion), and is shared by the lane's rows.
_FRAG_STD = (  # table unpack, pairs (e_2j, e_2j+1): interleave selectors 0x5140 / 0x7362
    "and.b32 s0, {w}, 0x88888888;\nshr.u32 s1, s0, 3;\nshr.u32 s2, s0, 19;\n"
    "and.b32 s3, {w}, 0x77777777;\nshr.u32 s4, s3, 16;\n"
    "prmt.b32 s5, lb0, lb1, s3;\nprmt.b32 s6, lb0, lb1, s4;\n"
    "prmt.b32 s7, hb0, hb1, s3;\nprmt.b32 s8, hb0, hb1, s4;\n"
    "prmt.b32 s9, sg, 0, s1;\nprmt.b32 s10, sg, 0, s2;\nor.b32 s7, s7, s9;\nor.b32 s8, s8, s10;\n"
    "prmt.b32 a0, s5, s7, 0x5140;\nprmt.b32 a1, s5, s7, 0x7362;\n"
    "prmt.b32 a2, s6, s8, 0x5140;\nprmt.b32 a3, s6, s8, 0x7362;\n"
)
_FRAG_SWZ = (
    "and.b32 a0, {w}, 0x81C081C0;\n"
    "shl.b32 a1, {w}, 3;\nand.b32 a1, a1, 0x81C081C0;\n"
    "shl.b32 a2, {w}, 6;\nand.b32 a2, a2, 0x81C081C0;\n"
    "shr.u32 s1, {w}, 4;\nand.b32 s1, s1, 0x00C000C0;\n"
    "shl.b32 s2, {w}, 1;\nand.b32 s2, s2, 0x80008000;\nor.b32 s1, s1, s2;\n"
    "shr.u32 s3, {w}, 5;\nand.b32 s3, s3, 0x01000100;\nor.b32 a3, s1, s3;\n"
)
_MMA = (
    "mul.rn.bf16x2 a0, a0, {s};\nmul.rn.bf16x2 a1, a1, {s};\n"
    "mul.rn.bf16x2 a2, a2, {s};\nmul.rn.bf16x2 a3, a3, {s};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{d0, d1, d2, d3}}, {{a0, a1, a2, a3}}, "
    "{{{b0}, {b1}}}, {{d0, d1, d2, d3}};\n"
)


_FRAG_NONE = "mov.b32 a0, {w};\nmov.b32 a1, {w};\nmov.b32 a2, {w};\nmov.b32 a3, {w};\n"  # timing only


def _mma_asm(layout: int, groups: int = 1) -> str:
    """One asm block per 4 weight words (pack=4): unpack each word once, then one MMA per group of
    4 rows of x. Operands: $0.. the groups' accumulators out (4 each); then words (4), scale pairs
    (4), per group b0 (4) and b1 (4), then the groups' accumulators in (4 each)."""
    frag = (_FRAG_STD, _FRAG_SWZ, _FRAG_NONE)[layout]
    base = 4 * groups
    head = ("{\n.reg .b32 s<11>, lb0, lb1, hb0, hb1, sg, a0, a1, a2, a3;\n"
            f".reg .f32 d<{4 * groups}>;\n"
            "mov.b32 lb0, 0xC0800000;\nmov.b32 lb1, 0xC0804000;\nmov.b32 hb0, 0x3F3F3F00;\n"
            "mov.b32 hb1, 0x40404040;\nmov.b32 sg, 0x8000;\n")
    head += "".join(f"mov.f32 d{i}, ${base + 8 + 8 * groups + i};\n" for i in range(4 * groups))
    body = ""
    for v in range(4):
        s_ = f"${base + 4 + v}"
        body += frag.format(w=f"${base + v}")
        body += "".join(f"mul.rn.bf16x2 a{i}, a{i}, {s_};\n" for i in range(4))
        for j in range(groups):
            d = ", ".join(f"d{4 * j + i}" for i in range(4))
            body += (f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d}}}, {{a0, a1, a2, a3}}, "
                     f"{{${base + 8 + 8 * j + v}, ${base + 12 + 8 * j + v}}}, {{{d}}};\n")
    tail = "".join(f"mov.f32 ${i}, d{i};\n" for i in range(4 * groups))
    return head + body + tail + "}\n"


# layout 2: no unpack, wrong results (timing only)
_ASM3 = {(lay, g): _mma_asm(lay, g) for lay in (0, 1, 2) for g in (1, 2, 4)}


if gluon is not None:

    @gluon.jit
    def _w_tile(w_ptr, ws_ptr, woff, soff, wk3, rmask, k0, kw_hi, EVEN: gl.constexpr):
        """Weight words and scale bytes [RT, R, BKW] at word k0."""
        if EVEN:
            wv = gl.load(w_ptr + woff + k0, mask=k0 < kw_hi)
            sb = gl.load(ws_ptr + soff + k0 // 2, mask=k0 < kw_hi)
        else:
            km3 = wk3 + k0 < kw_hi
            wv = gl.load(w_ptr + woff + k0, mask=rmask & km3, other=0)
            sb = gl.load(ws_ptr + soff + k0 // 2, mask=rmask & km3, other=0)
        return wv, sb

    @gluon.jit
    def _x_tile(xbase, xq, xmask, wk2, k0, kw_hi, EVEN: gl.constexpr):
        """The two B words of one group of 4 x rows at word k0, [RT, 1, BKW] in the MMA operands' layout.
        xq [RT, BKW, 4]: the 4 x words of each weight word (one lane: 16 consecutive words, four
        16-byte loads); the lane keeps words 0 and 2 (even quads) or 1 and 3 (odd quads)."""
        if EVEN:
            m = xmask & (k0 < kw_hi)
        else:
            m = xmask & (gl.expand_dims(wk2, 2) + k0 < kw_hi)
        x4 = gl.load(xbase + xq + k0 * 4, mask=m, other=0)  # [RT, BKW, 4]
        ev, od = gl.split(gl.reshape(x4, [x4.shape[0], x4.shape[1], 2, 2]))  # words {0, 2} and {1, 3}
        w0, w2 = gl.split(ev)
        w1, w3 = gl.split(od)
        return w0, w1, w2, w3

    @gluon.jit
    def _xb(odd, LB: gl.constexpr, xbase, xq, xmask, wk2, k0, kw_hi, EVEN: gl.constexpr):
        w0, w1, w2, w3 = _x_tile(xbase, xq, xmask, wk2, k0, kw_hi, EVEN)
        b0 = gl.where(odd, gl.convert_layout(w1, LB), gl.convert_layout(w0, LB))
        b1 = gl.where(odd, gl.convert_layout(w3, LB), gl.convert_layout(w2, LB))
        return gl.expand_dims(b0, 1), gl.expand_dims(b1, 1)

    @gluon.jit
    def _scale_pairs(sb, LAYOUT: gl.constexpr):
        s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32)
        if LAYOUT == 1:
            s = s * 3.3230699894622794e35  # 2^118 (exact)
        s16 = s.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 65535
        return s16 | (s16 << 16)

    @gluon.jit
    def _row_out(acc, wk3, rr: gl.constexpr):
        """x row (4j + rr) of group j's accumulators: lane c = rr holds D[q][2rr] (word slot 0) and
        D[q+8][2rr+1] (slot 3)."""
        v3 = wk3 % 4
        sel = (wk3 // 4 == rr) & ((v3 == 0) | (v3 == 3))
        return gl.sum(gl.where(sel, acc, 0.0), 2)  # [RT, R]

    @gluon.jit
    def _gemv_mma_kernel(
        x_ptr, w_ptr, ws_ptr, wg_ptr, y_ptr, part_ptr, lock_ptr,
        M, N, KW, stride_xm, stride_wn, stride_wsn, stride_ym,
        WG_ROW: gl.constexpr, SPLIT_K: gl.constexpr, BM: gl.constexpr, R: gl.constexpr,
        EVEN: gl.constexpr, LAYOUT: gl.constexpr, ASM: gl.constexpr,
    ):
        """x_ptr: int32 [M, K/2] (bf16 pairs); w_ptr: int32 [N, K/8] words; ws_ptr: uint8 [N, K/16].
        Tiles are [RT, R, BKW]: RT = 8 lanes x warps "row threads" (lane // 4), R rows each, 16
        words along K (4 lanes x 4 words); weight row = rt * R + r. BM = 4 J rows of x in J groups
        (one MMA each per word). Two tiles are in flight: the loop body is unrolled twice, so no
        register copy waits on an outstanding load."""
        NW: gl.constexpr = gl.num_warps()
        RT: gl.constexpr = 8 * NW
        BN: gl.constexpr = R * RT
        BKW: gl.constexpr = 16
        J: gl.constexpr = (BM + 3) // 4
        L3: gl.constexpr = gl.BlockedLayout([1, R, 4], [8, 1, 4], [NW, 1, 1], [2, 1, 0])
        L2: gl.constexpr = gl.SliceLayout(1, L3)  # [RT, BKW]: x words, shared by the R rows
        LP: gl.constexpr = gl.SliceLayout(2, L3)  # [RT, R]: per-row results

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        rt_p = gl.arange(0, RT, layout=gl.SliceLayout(1, LP))
        r_p = gl.arange(0, R, layout=gl.SliceLayout(0, LP))
        loc = gl.expand_dims(rt_p, 1) * R + gl.expand_dims(r_p, 0)  # [RT, R] row within the tile
        rows = pid_n * BN + loc
        rows3 = gl.expand_dims(rows, 2)  # [RT, R, 1]
        wk2 = gl.expand_dims(gl.arange(0, BKW, layout=gl.SliceLayout(0, L2)), 0)  # [1, BKW]
        wk3 = gl.expand_dims(wk2, 1)  # [1, 1, BKW]
        woff = rows3 * stride_wn + wk3
        soff = rows3 * stride_wsn + wk3 // 2
        rmask = rows3 < N
        q = gl.expand_dims(gl.arange(0, RT, layout=gl.SliceLayout(1, L2)) % 8, 1)  # [RT, 1]: lane // 4
        odd = (q % 2) == 1  # [RT, 1]: B columns 2r+1 take x pairs (2,3 | 6,7)
        L4: gl.constexpr = gl.BlockedLayout([1, 4, 4], [8, 4, 1], [NW, 1, 1], [2, 1, 0])  # [RT, BKW, 4]
        q4 = gl.arange(0, RT, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4))) % 8
        xr0 = gl.expand_dims(gl.expand_dims(q4 // 2, 1), 2)  # [RT, 1, 1]: x row of the lane's B column
        wk4 = gl.arange(0, BKW, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))
        i4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L4)))
        xq = gl.expand_dims(gl.expand_dims(wk4, 0), 2) * 4 + gl.expand_dims(gl.expand_dims(i4, 0), 1)
        wk2 = gl.expand_dims(wk4, 0)  # [1, BKW] for the K mask of x
        xb0 = x_ptr + xr0 * stride_xm
        xb1 = x_ptr + (xr0 + 4) * stride_xm
        xb2 = x_ptr + (xr0 + 8) * stride_xm
        xb3 = x_ptr + (xr0 + 12) * stride_xm

        kw_per = gl.cdiv(gl.cdiv(KW, SPLIT_K), 2 * BKW) * (2 * BKW)
        kw_lo = pid_k * kw_per
        kw_hi = gl.minimum(KW, kw_lo + kw_per)

        LB: gl.constexpr = gl.SliceLayout(1, L3)
        acc0 = gl.zeros([RT, R, BKW], gl.float32, L3)
        acc1 = gl.zeros([RT, R, BKW], gl.float32, L3)
        acc2 = gl.zeros([RT, R, BKW], gl.float32, L3)
        acc3 = gl.zeros([RT, R, BKW], gl.float32, L3)
        wa, sa = _w_tile(w_ptr, ws_ptr, woff, soff, wk3, rmask, kw_lo, kw_hi, EVEN)
        wb, sb = _w_tile(w_ptr, ws_ptr, woff, soff, wk3, rmask, kw_lo + BKW, kw_hi, EVEN)
        a00, a01 = _xb(odd, LB, xb0, xq, xr0 < M, wk2, kw_lo, kw_hi, EVEN)
        b00, b01 = _xb(odd, LB, xb0, xq, xr0 < M, wk2, kw_lo + BKW, kw_hi, EVEN)
        if J >= 2:
            a10, a11 = _xb(odd, LB, xb1, xq, xr0 + 4 < M, wk2, kw_lo, kw_hi, EVEN)
            b10, b11 = _xb(odd, LB, xb1, xq, xr0 + 4 < M, wk2, kw_lo + BKW, kw_hi, EVEN)
        if J >= 4:
            a20, a21 = _xb(odd, LB, xb2, xq, xr0 + 8 < M, wk2, kw_lo, kw_hi, EVEN)
            b20, b21 = _xb(odd, LB, xb2, xq, xr0 + 8 < M, wk2, kw_lo + BKW, kw_hi, EVEN)
            a30, a31 = _xb(odd, LB, xb3, xq, xr0 + 12 < M, wk2, kw_lo, kw_hi, EVEN)
            b30, b31 = _xb(odd, LB, xb3, xq, xr0 + 12 < M, wk2, kw_lo + BKW, kw_hi, EVEN)
        CON: gl.constexpr = "=f" + ",=f" * (4 * J - 1) + ",r" * (4 * (2 + 2 * J)) + ",f" * (4 * J)
        for kw0 in range(kw_lo, kw_hi, 2 * BKW):
            for half in gl.static_range(2):
                if half == 0:
                    wv = wa
                    sc = _scale_pairs(sa, LAYOUT)
                    x00, x01 = a00, a01
                    if J >= 2:
                        x10, x11 = a10, a11
                    if J >= 4:
                        x20, x21, x30, x31 = a20, a21, a30, a31
                else:
                    wv = wb
                    sc = _scale_pairs(sb, LAYOUT)
                    x00, x01 = b00, b01
                    if J >= 2:
                        x10, x11 = b10, b11
                    if J >= 4:
                        x20, x21, x30, x31 = b20, b21, b30, b31
                if J == 1:
                    acc0 = gl.inline_asm_elementwise(ASM, CON, [wv, sc, x00, x01, acc0],
                                                     dtype=gl.float32, is_pure=False, pack=4)
                elif J == 2:
                    acc0, acc1 = gl.inline_asm_elementwise(
                        ASM, CON, [wv, sc, x00, x01, x10, x11, acc0, acc1],
                        dtype=(gl.float32, gl.float32), is_pure=False, pack=4)
                else:
                    acc0, acc1, acc2, acc3 = gl.inline_asm_elementwise(
                        ASM, CON,
                        [wv, sc, x00, x01, x10, x11, x20, x21, x30, x31, acc0, acc1, acc2, acc3],
                        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=False, pack=4)
                nk = kw0 + (2 + half) * BKW  # refill the buffer just consumed
                if half == 0:
                    wa, sa = _w_tile(w_ptr, ws_ptr, woff, soff, wk3, rmask, nk, kw_hi, EVEN)
                    a00, a01 = _xb(odd, LB, xb0, xq, xr0 < M, wk2, nk, kw_hi, EVEN)
                    if J >= 2:
                        a10, a11 = _xb(odd, LB, xb1, xq, xr0 + 4 < M, wk2, nk, kw_hi, EVEN)
                    if J >= 4:
                        a20, a21 = _xb(odd, LB, xb2, xq, xr0 + 8 < M, wk2, nk, kw_hi, EVEN)
                        a30, a31 = _xb(odd, LB, xb3, xq, xr0 + 12 < M, wk2, nk, kw_hi, EVEN)
                else:
                    wb, sb = _w_tile(w_ptr, ws_ptr, woff, soff, wk3, rmask, nk, kw_hi, EVEN)
                    b00, b01 = _xb(odd, LB, xb0, xq, xr0 < M, wk2, nk, kw_hi, EVEN)
                    if J >= 2:
                        b10, b11 = _xb(odd, LB, xb1, xq, xr0 + 4 < M, wk2, nk, kw_hi, EVEN)
                    if J >= 4:
                        b20, b21 = _xb(odd, LB, xb2, xq, xr0 + 8 < M, wk2, nk, kw_hi, EVEN)
                        b30, b31 = _xb(odd, LB, xb3, xq, xr0 + 12 < M, wk2, nk, kw_hi, EVEN)

        nmask = rows < N
        if WG_ROW:
            g = gl.load(wg_ptr + rows, mask=nmask, other=0.0)
        else:
            g = gl.load(wg_ptr)
        if LAYOUT == 1:
            g = g * 256.0
        base = part_ptr + pid_n * (SPLIT_K * BM * BN)
        for m in gl.static_range(BM):
            if m // 4 == 0:
                p = _row_out(acc0, wk3, m % 4)
            elif m // 4 == 1:
                p = _row_out(acc1, wk3, m % 4)
            elif m // 4 == 2:
                p = _row_out(acc2, wk3, m % 4)
            else:
                p = _row_out(acc3, wk3, m % 4)
            if SPLIT_K > 1:
                gl.store(base + pid_k * (BM * BN) + m * BN + loc, p, cache_modifier=".cg")
            else:
                gl.store(y_ptr + m * stride_ym + rows, (p * g).to(gl.bfloat16), mask=nmask & (m < M))
        if SPLIT_K > 1:  # deterministic split-K: the last program of the tile adds partials in order
            gl.thread_barrier()
            done = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                for m in gl.static_range(BM):
                    p = gl.load(base + m * BN + loc, cache_modifier=".cg")
                    for sk in range(1, SPLIT_K):
                        p += gl.load(base + sk * (BM * BN) + m * BN + loc, cache_modifier=".cg")
                    gl.store(y_ptr + m * stride_ym + rows, (p * g).to(gl.bfloat16), mask=nmask & (m < M))
                gl.atomic_xchg(lock_ptr + pid_n, 0)


def configs_mma(n: int, kh: int, sms: int, m: int = 1) -> list[dict]:
    """Candidate (R, num_warps, SPLIT_K) for the tensor-core GEMV; first is the default."""
    out = []
    kw = kh // 4
    shapes = ((2, 8), (1, 4), (2, 4), (1, 8)) if m <= 4 else ((1, 4), (1, 8), (2, 4), (2, 8))
    for r, nw in shapes:
        bn = r * 8 * nw
        tiles = -(-n // bn)
        split = 1  # measured (H200): best at the largest split with <= 2 programs per SM
        while tiles * split * 2 <= 2 * sms and kw // (2 * split) >= 2 * 32:
            split *= 2
        for sk in dict.fromkeys((split, 2 * split, max(1, split // 2))):
            if sk == 1 or kw // sk >= 32:  # a split of fewer than 32 words is masked loads only
                out.append(dict(R=r, num_warps=nw, SPLIT_K=sk))
    return out


# Rows of x the dispatcher sends here. The kernel computes up to 16 (one MMA per word for each 4
# rows); on the H200 (bench/data/gemv_sweep8_h200.json) it also beat the Triton kernels' first
# candidate at 8 rows (4096 x 14336: 31.4-34.9 vs 37.9 us; their best, split 4: 31.7) and lost at 16
# (50-57 vs 36-37 us). 5-8 rows stay on the Triton kernels until the full GPU test has run there.
MAX_ROWS = 4


def launch_mma(x2, wd, ws, wg, y, cfg, workspace, layout: int = 0):
    """y [M, N] (M <= 16; the dispatcher uses it up to MAX_ROWS) with the tensor-core GEMV; wd uint8
    [N, K/2] (layout 0 standard,
    1 gemv32 from swizzle()), K/2 a multiple of 4."""
    n, kh = wd.shape
    m = x2.shape[0]
    if m > 16 or kh % 4:
        raise ValueError(f"the Gluon GEMV takes 1-16 rows and K a multiple of 8, got {m} rows, K={2 * kh}")
    bm = 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8 if m <= 8 else 16
    bn = cfg["R"] * 8 * cfg["num_warps"]
    kw = kh // 4
    split = cfg["SPLIT_K"]
    tiles = -(-n // bn)
    part, lock = workspace.get(y.device, tiles * split * bm * bn if split > 1 else 0, tiles)
    xw = x2.view(torch.int32)
    ww = wd.view(torch.int32)
    COMPILED[f"w4_gemv mma gluon layout{layout}"] = _gemv_mma_kernel[(tiles, split)](
        xw, ww, ws, wg, y, part, lock, m, n, kw, xw.stride(0), ww.stride(0), ws.stride(0), y.stride(0),
        WG_ROW=wg.numel() > 1, SPLIT_K=split, BM=bm, R=cfg["R"], EVEN=n % bn == 0 and kw % 32 == 0,
        LAYOUT=layout, ASM=_ASM3[(layout, (bm + 3) // 4)], num_warps=cfg["num_warps"],
    )
    return y
