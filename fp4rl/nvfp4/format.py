"""The NVFP4 storage format: E2M1 codes, their packing, E4M3 block scales, and the tensor type.

E2M1 is a 4-bit float: 1 sign bit, 2 exponent bits, 1 mantissa bit, no infinities or NaN.
Its eight magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; a code is ``sign << 3 | index`` into
that list, so code 0x8 is -0. Two codes share a byte, element 2i in the LOW nibble.

Rounding a scaled value z to a code (``round_to_e2m1``) is the one place where the format's
grid meets arithmetic, so it is spelled out here exactly as TransformerEngine's reference
does it:
- nearest: round half to even on the E2M1 grid, saturating at +-6 (a tie keeps the code
  whose mantissa bit is 0): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
  5 -> 4. The sign bit is set only for z < 0, so -0.0 gives code 0x0 while -0.1 gives 0x8;
  NaN (reachable only with ``allow_nonfinite``) gives 0x0, +-inf gives +-6.
- stochastic: |z| (clipped to 6) between grid neighbours lo <= |z| <= hi rounds up with
  probability (|z| - lo) / (hi - lo), so E[value] = z for |z| <= 6. The probability is exact
  (lo and the step are powers of two), the uniform draw comes from a ``torch.Generator``.

Block scales are E4M3 (float8_e4m3fn): round-to-nearest-even, saturating at 448 (torch's
own cast turns values above 464 into NaN, so the clamp comes first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
BLOCK = 16

# Magnitudes of E2M1 indices 0..7; code = sign << 3 | index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# All 16 codes as float32 values, code 8 is -0.0.
E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)

# Round-half-to-even thresholds between neighbouring magnitudes: |z| above the threshold
# rounds up; at the threshold itself it rounds up only when the upper neighbour is even
# (mantissa bit 0), i.e. for 0.75 (-> 1), 1.75 (-> 2) and 3.5 (-> 4).
_RNE_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))  # (midpoint, tie rounds up)
_STEP = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 1.0)  # distance from index i to i+1 (7: unused)

_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


class NonFiniteError(ValueError):
    """A tensor to quantize holds NaN or Inf (and the caller did not pass allow_nonfinite=True). A ValueError,
    so that callers can name the tensor in their own message (qat.NVFP4Linear names the linear)."""


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _tables:
        values = {"e2m1": E2M1_TABLE, "step": torch.tensor(_STEP, dtype=torch.float32)}[name]
        _tables[key] = values.to(device)
    return _tables[key]


def e2m1_codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> their float32 values (code 0x8 -> -0.0)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8 E2M1 codes, got {codes.dtype}")
    # an int32 index is twice as fast as a long one here
    flat = torch.index_select(_table("e2m1", codes.device), 0, codes.reshape(-1).int())
    return flat.reshape(codes.shape)


def round_to_e2m1(
    z: torch.Tensor,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    *,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round a scaled float32 tensor z to E2M1 codes (uint8, same shape), saturating at +-6.

    ``rounding="nearest"`` is round-half-to-even; ``"stochastic"`` is unbiased on [-6, 6] (for the
    given scale: a 4/6 choice made after the draws biases the block)
    and rounds up when a uniform draw u < (|z| - lo) / (hi - lo); u comes from ``uniform``
    (float32, z's shape) when given, else one draw per element from ``generator`` (or
    torch's default generator for z's device when None).
    """
    if z.dtype != torch.float32:
        raise TypeError(f"z must be float32 (the scaled values), got {z.dtype}")
    a = z.abs()
    if rounding == "nearest":
        index = (a > _RNE_THRESHOLDS[0][0]).to(torch.uint8)
        for midpoint, tie_up in _RNE_THRESHOLDS[1:]:
            index += (a >= midpoint) if tie_up else (a > midpoint)
    elif rounding == "stochastic":
        a = a.clamp(max=E2M1_MAX)  # NaN stays NaN and lands on index 0 below
        index = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
        for value in E2M1_VALUES[1:]:
            index += a >= value  # index of the grid point at or below |z|
        lower = _table("e2m1", z.device)[index.long()]
        up_prob = (a - lower) / _table("step", z.device)[index.long()]  # exact: step is 2^k
        if uniform is None:
            uniform = torch.rand(z.shape, generator=generator, device=z.device, dtype=torch.float32)
        index += uniform < up_prob
    else:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    return index | ((z < 0).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [..., K] (K even) -> packed bytes [..., K/2], element 2i in the low nibble."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes last dim must be even to pack two per byte, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """Packed bytes uint8 [..., K/2] -> E2M1 codes uint8 [..., K]."""
    if data.dtype != torch.uint8:
        raise TypeError(f"data must be uint8 packed E2M1, got {data.dtype}")
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def cast_to_e4m3(scale: torch.Tensor) -> torch.Tensor:
    """float32 scale -> float8_e4m3fn, round-to-nearest-even, saturating at 448 (satfinite)."""
    return scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def true_div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b in float32, correctly rounded on every device.

    torch evaluates ``number / tensor`` as ``reciprocal(tensor) * number`` (two roundings),
    and CUDA evaluates ``tensor / number`` as ``tensor * (1 / number)``; both change last
    bits. Dividing two tensors on the same device is a true IEEE division.
    """
    device = a.device if isinstance(a, torch.Tensor) else b.device
    a = torch.as_tensor(a, dtype=torch.float32, device=device)
    b = torch.as_tensor(b, dtype=torch.float32, device=device)
    return torch.div(a, b)


def block_encode_scale(block_scale: torch.Tensor, decode_scale: torch.Tensor) -> torch.Tensor:
    """The factor that maps x to the E2M1 range: min(1 / (fp32(block_scale) * decode_scale), FLT_MAX).

    ``decode_scale`` is the decode-direction global scale (broadcast against block_scale).
    A block scale of 0 gives FLT_MAX, as in TransformerEngine: nonzero values of such a
    block saturate to +-6 and still decode to 0.
    """
    return true_div(1.0, block_scale.float() * decode_scale).clamp(max=FP32_MAX)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A quantized tensor: packed E2M1 codes, E4M3 block scales and a decode-direction global scale.

    Decode: x = (e2m1(data) * block_scale) * global_scale, in float32, in that order.
    """

    data: torch.Tensor  # uint8 [..., Kp/2]; element 2i in the low nibble
    block_scale: torch.Tensor  # float8_e4m3fn [..., Kp/16]; rows of a 16x16 tile share values
    global_scale: torch.Tensor  # float32, decode direction; [] ("tensor") or [..., 1] ("row")
    shape: torch.Size  # the original shape (K before padding)
    dtype: torch.dtype  # the original dtype
    tile: int | tuple[int, int] = 16
    scale_rule: str = "6"
    hadamard_seed: int | None = None  # random Hadamard transform applied before quantizing

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (codes, block scales, global scale)."""
        return self.data.nbytes + self.block_scale.nbytes + self.global_scale.nbytes

    @property
    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes uint8 [..., Kp] (Kp = K padded to a multiple of 16)."""
        return unpack_fp4(self.data)

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """The same tensor on `device` (a device only: the packed bytes and scales keep their dtypes; use
        dequantize(q, dtype) for values in another dtype)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"NVFP4Tensor.to({device}): takes a device; the codes and scales keep their "
                            "formats (dequantize(q, dtype) gives the values in a dtype)")
        device = torch.device(device)
        return replace(
            self,
            data=self.data.to(device),
            block_scale=self.block_scale.to(device),
            global_scale=self.global_scale.to(device),
        )

    def __repr__(self) -> str:
        return (
            f"NVFP4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, tile={self.tile}, "
            f"scale_rule={self.scale_rule!r}, global_scale={tuple(self.global_scale.shape)}, "
            f"device={self.device}, nbytes={self.nbytes})"
        )
