"""Triton building blocks shared by the NVFP4 kernels: E2M1 unpacking and E4M3 scale decoding.

Unpacking turns a tile of packed bytes (element 2i in the low nibble) into two bfloat16 tiles,
``lo`` (even elements) and ``hi`` (odd elements), each already multiplied by its E4M3 block
scale. Both products are exact in bfloat16: an E2M1 value has 2 significant bits and an E4M3
scale 4, so e2m1 * scale has at most 6 significant bits and lies in [2^-10, 2688]. Callers
therefore work on exact (e2m1 * block_scale) operands and apply the FP32 global scale once to
the FP32 accumulator, which is how Blackwell's block-scaled MMA treats it too.

Two implementations of the unpack, chosen at compile time:
- ``USE_ASM``: 21 PTX instructions per 4 bytes (8 elements), the bytes looked up in two
  4-entry byte tables with ``prmt`` (the bfloat16 bit patterns of the 8 magnitudes), the sign
  bits spread with one more ``prmt``, then ``mul.rn.bf16x2`` by the scale. H100/H200 have
  no FP4 conversion instruction, so this lookup is the cheapest exact path.
- otherwise plain integer/float arithmetic, used by ``TRITON_INTERPRET=1`` on CPU (which
  cannot run PTX) and as a portable fallback.
"""

from __future__ import annotations

import functools
import os
import warnings

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The last compiled kernel of each family (registers, spills, SASS), for benchmarks and notes.
COMPILED: dict = {}
# Whether kernels use the PTX unpack; switched off (with a warning) if this GPU/toolchain rejects it.
ASM = {"on": not INTERPRET}


def with_asm_fallback(launch):
    """Run a launcher; if its PTX unpack fails to assemble here, retry once with arithmetic."""

    @functools.wraps(launch)
    def run(*args, **kwargs):
        try:
            return launch(*args, **kwargs)
        except Exception as exc:
            text = str(exc).lower()
            if not ASM["on"] or not ("ptx" in text or "asm" in text):
                raise
            warnings.warn(f"PTX E2M1 unpack failed ({str(exc)[:200]}); using the arithmetic unpack",
                          stacklevel=2)
            ASM["on"] = False
            return launch(*args, **kwargs)

    return run

# Four packed bytes (8 E2M1 codes: n0 = low nibble of byte 0, ...) and four per-byte bfloat16
# scales in; out: lo = (e2m1(n0), e2m1(n2), e2m1(n4), e2m1(n6)) * scale and hi the odd ones.
# Byte tables: low byte of bf16(e2m1(m)) for m = 0..7 is 00 00 80 C0 00 40 80 C0, the high
# byte 00 3F 3F 3F 40 40 40 40; the sign bit (nibble bit 3) becomes 0x80 in the high byte.
_UNPACK_ASM = tl.constexpr("""
{
.reg .b32 t<13>;
and.b32 t0, $4, 0x88888888;
shr.u32 t1, t0, 3;
shr.u32 t2, t0, 19;
and.b32 t3, $4, 0x77777777;
shr.u32 t4, t3, 16;
prmt.b32 t5, 0xC0800000, 0xC0804000, t3;
prmt.b32 t6, 0xC0800000, 0xC0804000, t4;
prmt.b32 t7, 0x3F3F3F00, 0x40404040, t3;
prmt.b32 t8, 0x3F3F3F00, 0x40404040, t4;
prmt.b32 t9, 0x8000, 0, t1;
prmt.b32 t10, 0x8000, 0, t2;
or.b32 t7, t7, t9;
or.b32 t8, t8, t10;
prmt.b32 t11, t5, t7, 0x6240;
prmt.b32 t12, t6, t8, 0x6240;
prmt.b32 t9, t5, t7, 0x7351;
prmt.b32 t10, t6, t8, 0x7351;
mul.rn.bf16x2 $0, t11, $5;
mul.rn.bf16x2 $1, t12, $6;
mul.rn.bf16x2 $2, t9, $5;
mul.rn.bf16x2 $3, t10, $6;
}
""")


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, 0..15) -> float32 value; code 8 is -0.0."""
    m = code & 7
    quarters = tl.where(m < 2, 2 * m, (2 + (m & 1)) << (m >> 1))  # value * 4: 0 2 4 6 8 12 16 24
    v = quarters.to(tl.float32) * 0.25
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def e4m3_to_f32(bits):
    """E4M3 bit patterns (uint8 tensor) -> float32 values (exact)."""
    return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def unpack_scaled(packed, scale, USE_ASM: tl.constexpr):
    """packed uint8 [R, C] and its block scale as bfloat16 [R, C] (one per byte) ->
    (lo, hi) bfloat16 [R, C]: e2m1 * scale of the low (even) and high (odd) nibbles, exact."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
    else:
        b = packed.to(tl.int32)
        s = scale.to(tl.float32)
        lo = (e2m1_value(b & 15) * s).to(tl.bfloat16)
        hi = (e2m1_value(b >> 4) * s).to(tl.bfloat16)
    return lo, hi


@triton.jit
def load_unpacked(data_ptr, scale_ptr, rows, row_mask, kb0, KH, stride_d, stride_s,
                  BR: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr):
    """Load and unpack rows [BR] x bytes [kb0, kb0 + BKH) of a packed NVFP4 matrix.

    data uint8 [R, KH] (KH = K/2), block scales uint8 (E4M3 bits) [R, K/16].
    Returns (lo, hi) bfloat16 [BR, BKH] = e2m1 * block_scale for even / odd elements;
    bytes past KH or rows outside row_mask read as 0.
    """
    cols = kb0 + tl.arange(0, BKH)  # [BKH] byte index
    m = row_mask[:, None] & (cols[None, :] < KH)
    packed = tl.load(data_ptr + rows[:, None] * stride_d + cols[None, :], mask=m, other=0)
    scols = kb0 // 8 + tl.arange(0, BKH // 8)  # one scale per 8 bytes
    sm = row_mask[:, None] & (scols[None, :] < (KH + 7) // 8)
    sbits = tl.load(scale_ptr + rows[:, None] * stride_s + scols[None, :], mask=sm, other=0)
    s = e4m3_to_f32(sbits).to(tl.bfloat16)  # [BR, BKH/8]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BR, BKH // 8, 8)), (BR, BKH))
    return unpack_scaled(packed, s, USE_ASM)


@triton.jit
def dot_acc(a, b, acc, INTERP: tl.constexpr):
    """acc += a @ b with bfloat16 operands (the CPU interpreter's bf16 dot is wrong: fp32 there)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)
