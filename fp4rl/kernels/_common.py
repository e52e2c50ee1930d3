"""Triton building blocks shared by the NVFP4 kernels: E2M1 unpacking and E4M3 scale decoding.

Unpacking turns a tile of packed bytes (element 2i in the low nibble) into two bfloat16 tiles,
``lo`` (even elements) and ``hi`` (odd elements), each already multiplied by its E4M3 block
scale. Both products are exact in bfloat16: an E2M1 value has 2 significant bits and an E4M3
scale 4, so e2m1 * scale has at most 6 significant bits and lies in [2^-10, 2688]. Callers
therefore work on exact (e2m1 * block_scale) operands and apply the FP32 global scale once to
the FP32 accumulator, which is how Blackwell's block-scaled MMA treats it too.

Two implementations of the unpack, chosen at compile time:
- ``USE_ASM``: 21 PTX instructions per 4 bytes (8 elements), the codes looked up in two
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


def with_asm_fallback(launch=None, *, when=None):
    """Run a launcher; if its PTX unpack fails to assemble here, retry once with arithmetic (ASM["on"] goes
    off for every later launch). when(*args, **kwargs): whether this call uses the PTX unpack at all (a
    call that does not, e.g. decode attention over a BF16 cache, re-raises and leaves ASM alone)."""
    if launch is None:
        return functools.partial(with_asm_fallback, when=when)

    @functools.wraps(launch)
    def run(*args, **kwargs):
        try:
            return launch(*args, **kwargs)
        except Exception as exc:
            text = str(exc).lower()
            if (not ASM["on"] or not ("ptx" in text or "asm" in text)
                    or (when is not None and not when(*args, **kwargs))):
                raise
            warnings.warn(f"PTX E2M1 unpack failed ({str(exc)[:200]}); using the arithmetic unpack",
                          stacklevel=2)
            ASM["on"] = False
            return launch(*args, **kwargs)

    return run

# Eight packed bytes in two registers ($8, $9: 16 E2M1 codes, n0 = low nibble of byte 0, ...) and
# eight per-byte bfloat16 scales ($10..$13) in; out lo ($0..$3) = e2m1 of the even codes times
# the scale, hi ($4..$7) the odd ones. Byte tables (prmt looks up 4 bytes at once, 3-bit index):
# low byte of bf16(e2m1(m)) for m = 0..7 is 00 00 80 C0 00 40 80 C0, the high byte
# 00 3F 3F 3F 40 40 40 40; the sign bit (nibble bit 3) becomes 0x80 in the high byte.
# The four table words and the sign word are set once per 16 codes.
_UNPACK_WORD = """
and.b32 s0, {w}, 0x88888888;
shr.u32 s1, s0, 3;
shr.u32 s2, s0, 19;
and.b32 s3, {w}, 0x77777777;
shr.u32 s4, s3, 16;
prmt.b32 s5, lb0, lb1, s3;
prmt.b32 s6, lb0, lb1, s4;
prmt.b32 s7, hb0, hb1, s3;
prmt.b32 s8, hb0, hb1, s4;
prmt.b32 s9, sg, 0, s1;
prmt.b32 s10, sg, 0, s2;
or.b32 s7, s7, s9;
or.b32 s8, s8, s10;
prmt.b32 s11, s5, s7, 0x6240;
prmt.b32 s12, s6, s8, 0x6240;
prmt.b32 s9, s5, s7, 0x7351;
prmt.b32 s10, s6, s8, 0x7351;
mul.rn.bf16x2 {lo0}, s11, {s0};
mul.rn.bf16x2 {lo1}, s12, {s1};
mul.rn.bf16x2 {hi0}, s9, {s0};
mul.rn.bf16x2 {hi1}, s10, {s1};
"""
_UNPACK_ASM = tl.constexpr(
    "{\n.reg .b32 s<13>, lb0, lb1, hb0, hb1, sg;\n"
    "mov.b32 lb0, 0xC0800000;\nmov.b32 lb1, 0xC0804000;\nmov.b32 hb0, 0x3F3F3F00;\n"
    "mov.b32 hb1, 0x40404040;\nmov.b32 sg, 0x8000;\n"
    + _UNPACK_WORD.format(w="$8", lo0="$0", lo1="$1", hi0="$4", hi1="$5", s0="$10", s1="$11")
    + _UNPACK_WORD.format(w="$9", lo0="$2", lo1="$3", hi0="$6", hi1="$7", s0="$12", s1="$13")
    + "}\n"
)


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
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r", [packed, scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=False, pack=8,
        )
    else:
        b = packed.to(tl.int32)
        s = scale.to(tl.float32)
        lo = (e2m1_value(b & 15) * s).to(tl.bfloat16)
        hi = (e2m1_value(b >> 4) * s).to(tl.bfloat16)
    return lo, hi


@triton.jit
def load_unpacked(data_ptr, scale_ptr, rows, row_mask, kb0, KH, stride_d, stride_s,
                  BR: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr, EVEN: tl.constexpr = False):
    """Load and unpack rows [BR] x bytes [kb0, kb0 + BKH) of a packed NVFP4 matrix.

    data uint8 [R, KH] (KH = K/2), block scales uint8 (E4M3 bits) [R, K/16].
    Returns (lo, hi) bfloat16 [BR, BKH] = e2m1 * block_scale for even / odd elements;
    bytes past KH or rows outside row_mask read as 0. EVEN: every row and byte is in range
    (no masks: fewer instructions in the hot loop).
    """
    cols = kb0 + tl.arange(0, BKH)  # [BKH] byte index
    scols = kb0 // 8 + tl.arange(0, BKH // 8)  # one scale per 8 bytes
    if EVEN:
        packed = tl.load(data_ptr + rows[:, None] * stride_d + cols[None, :])
        sbits = tl.load(scale_ptr + rows[:, None] * stride_s + scols[None, :])
    else:
        m = row_mask[:, None] & (cols[None, :] < KH)
        packed = tl.load(data_ptr + rows[:, None] * stride_d + cols[None, :], mask=m, other=0)
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
