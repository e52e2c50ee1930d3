"""Scalar NVFP4 arithmetic shared by every quantize kernel (Triton and Gluon): E4M3 and E2M1
rounding, the division-free x / 1536, and the strictly ordered 16-element sum.

Each helper is elementwise (or, for ``_sum16_2d``, along the last axis only), so the same code
runs inside [R, NB, 16] tiles, [N, 16] one-block-per-thread tiles and Gluon's explicit layouts,
and the bytes are the reference's whatever kernel calls them:

- E4M3 rounding is done with integer arithmetic (round-half-even on the 3 mantissa bits, or on
  multiples of 2^-9 below 2^-6) so that the CPU interpreter and the GPU agree bit for bit.
- E2M1 rounding is round-half-to-even one binade at a time (``_round_e2m1``), or stochastic
  with caller-supplied uniforms; ``_round_e2m1_v`` also returns the signed E2M1 value, which the
  4/6 error needs, from the rounding itself.
- The 4/6 error of a block is a sum of 16 terms added strictly left to right, as the reference
  does (``_sum16_2d``): float addition is not associative, so a tree or ``tl.sum`` would change
  which scale wins on ties of rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4rl.kernels._common import e2m1_value

FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1/6), as TE folds it


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

