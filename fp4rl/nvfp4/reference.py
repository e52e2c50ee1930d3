"""Plain-torch NVFP4 quantizer: the specification every faster implementation must match byte for byte.

Runs on CPU and CUDA (same bytes on both), vectorised, no Python loop over blocks. The
arithmetic is TransformerEngine's, in fp32, in this order (load-bearing: reordering changes
last bits), every division a true IEEE division (format.true_div: torch's scalar shortcuts
multiply by a reciprocal):

    amax   = max |x| over the tensor (scale_scope="tensor") or over each row ("row")
    S_enc  = fp32(M / amax), M = 6*448 = 2688 (rule "6") or 6*256 = 1536 (rule "4/6");
             min(S_enc, FLT_MAX); amax == 0 or S_enc == 0 (amax inf) -> S_enc = 1
    S_dec  = fp32(1 / S_enc)                                   (used for encoding only)
    rule "6":   s_blk = e4m3_rn_satfinite(block_amax * (S_enc * fp32(1/6)))
    rule "4/6": base = (block_amax / 6) * S_enc; s6 = e4m3(base); s4 = e4m3(base * 1.5)
    enc    = min(1 / (fp32(s_blk) * S_dec), FLT_MAX)            (s_blk == 0 -> FLT_MAX)
    code   = e2m1_rne_satfinite(x * enc)                       (see format.round_to_e2m1)
    stored global_scale g = fp32(amax / M)                     (decode direction)
    decode: x' = (e2m1(code) * fp32(s_blk)) * g

The two block-scale formulas are the ones TE (and the FourOverSix reference) use for each
rule. The stored g is amax/M rather than S_dec because that is what ModelOpt checkpoints,
torchao and TE's own dequantize kernel use; fp32(1/fp32(M/amax)) differs from fp32(amax/M)
in the last bit for about a quarter of amax values, and encoding must use TE's S_dec.

4/6 (FourOverSix): every block is encoded with s6 and with s4 (block max mapped to 4, a
1.5x larger scale, finer steps near the max); each candidate is decoded as
((e2m1 * s) * amax) / 1536 and compared with x by the summed squared ("mse") or absolute
("mae") error; the lower error wins, a tie keeps 6. Errors are summed left to right over
the 16 elements of a block; for 16x16 tiles, the 16 row sums are then added as a tree
(rows 0-7 + 8-15, then 0-3 + 4-7, 0-1 + 2-3, 0 + 1), TE's warp-reduction order. A device
kernel must reproduce this order and must not contract a*b+c into an FMA.

16x16 tiles: one amax (so one block scale) per 16x16 tile of the last two dims, stored per
row as [..., K/16] (the 16 rows of a tile hold the same value), so the quantized transpose
holds the same codes and scales as the transposed quantization.

A caller may impose the scale instead of taking it from x: ``amax=`` reproduces exactly
what TE does with that amax (a fused q/k/v group quantized with its group amax gives the
same bytes as quantizing the concatenation); ``global_scale=g`` takes a decode-direction
scale (e.g. the sampler's) and encodes with S_dec = g, S_enc = fp32(1/g), the 4/6 errors
then decode with (e2m1 * s) * g. Values beyond the imposed range saturate.

NaN/Inf raise unless ``allow_nonfinite``; then every amax is taken over the finite values
(TE would take amax = inf and fall back to S_enc = 1), NaN gets code 0 and +-Inf +-6.

How torchao, ModelOpt and fouroversix differ from this, and where: tests/test_nvfp4_oracles.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.nvfp4.format import (
    BLOCK,
    E2M1_MAX,
    FP32_MAX,
    NonFiniteError,
    NVFP4Tensor,
    block_encode_scale,
    cast_to_e4m3,
    e2m1_codes_to_values,
    pack_fp4,
    round_to_e2m1,
    true_div,
    unpack_fp4,
)
from fp4rl.nvfp4.hadamard import inverse_random_hadamard, random_hadamard

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_RULES = ("6", "4/6")
TILES = (16, (16, 16))
# M in S_enc = M / amax: E2M1 max times the E4M3 max the global scale leaves room for.
GLOBAL_SCALE_MAX = {"6": E2M1_MAX * 448.0, "4/6": E2M1_MAX * 256.0}
_FP32_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6), as TE folds it
_CHUNK_ELEMENTS = 1 << 18  # rows are quantized in groups of about this many elements


@dataclass
class GlobalScales:
    """The per-tensor (or per-row) scalars of one quantization, all float32, broadcastable."""

    encode: torch.Tensor  # S_enc: maps block amax to the E4M3 range
    decode_for_encoding: torch.Tensor  # S_dec used in enc = 1 / (s_blk * S_dec)
    global_scale: torch.Tensor  # the stored decode-direction scale g
    error_amax: torch.Tensor | None  # amax in the 4/6 error decode ((q*s)*amax)/M; None: use g

    def rows(self, r0: int, r1: int) -> GlobalScales:
        """These scales for rows r0:r1 (per-row scales are [R, 1]; a per-tensor one is shared)."""
        if self.encode.ndim == 0:
            return self
        cut = lambda t: None if t is None else t[r0:r1]  # noqa: E731
        return GlobalScales(cut(self.encode), cut(self.decode_for_encoding), cut(self.global_scale),
                            cut(self.error_amax))


def global_scales_from_amax(amax: torch.Tensor, scale_rule: str = "6") -> GlobalScales:
    """TE's global scales for a given amax (float32 tensor, any shape)."""
    m = GLOBAL_SCALE_MAX[scale_rule]
    amax = amax.float()
    encode = true_div(m, amax).clamp(max=FP32_MAX)
    encode = torch.where((amax == 0) | (encode == 0), torch.ones_like(encode), encode)
    return GlobalScales(encode, true_div(1.0, encode), true_div(amax, m), amax)


def global_scales_from_decode(global_scale: torch.Tensor) -> GlobalScales:
    """Global scales from an imposed decode-direction scale g: S_dec = g, S_enc = fp32(1/g)."""
    g = global_scale.float()
    return GlobalScales(true_div(1.0, g).clamp(max=FP32_MAX), g, g, None)


def _validate_options(tile, scale_rule, err, rounding, scale_scope) -> tuple[int, int]:
    if tile not in TILES:
        raise ValueError(f"tile must be 16 or (16, 16), got {tile!r}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be '6' or '4/6', got {scale_rule!r}")
    if err not in ("mse", "mae"):
        raise ValueError(f"err must be 'mse' or 'mae' (the 4/6 selection error), got {err!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if scale_scope not in ("tensor", "row"):
        raise ValueError(f"scale_scope must be 'tensor' or 'row', got {scale_scope!r}")
    tile_rows = 16 if tile == (16, 16) else 1
    if tile_rows == 16 and scale_scope == "row":
        raise ValueError(
            "tile=(16, 16) shares one block scale across 16 rows, so it needs scale_scope='tensor' "
            "(per-row global scales would differ inside a tile); use tile=16 for per-row scales"
        )
    return tile_rows, BLOCK


def _validate_input(x, tile_rows: int, pad: bool, allow_nonfinite: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"x has dtype {x.dtype}; quantize accepts float32, bfloat16 or float16: convert with x.float()"
        )
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"x is empty (shape {tuple(x.shape)}); there is nothing to quantize")
    k = x.shape[-1]
    if k % BLOCK and not pad:
        raise ValueError(
            f"x last dim K={k} is not a multiple of 16 (one E4M3 scale per 16 values); pass pad=True "
            f"to zero-pad K to {k + (-k) % BLOCK} (dequantize returns the original shape)"
        )
    if tile_rows > 1 and (x.ndim < 2 or x.shape[-2] % tile_rows):
        raise ValueError(
            f"tile=(16, 16) needs x.shape[-2] to be a multiple of 16, got shape {tuple(x.shape)}; "
            "use tile=16 or pad the rows"
        )
    if not allow_nonfinite and not bool(torch.isfinite(x).all()):
        raise NonFiniteError(
            "x contains NaN or Inf; fix the producer, or pass allow_nonfinite=True "
            "(scales then come from the finite values; NaN -> code 0, +-Inf -> +-6)"
        )


def _validate_scale(value, name: str, expected: torch.Size, x: torch.Tensor, positive: bool) -> torch.Tensor:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = torch.tensor(float(value), dtype=torch.float32)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        got = getattr(value, "dtype", value)
        raise TypeError(f"{name} must be a float32 tensor (or a Python float), got {got!r}")
    if value.shape != expected:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}, expected {tuple(expected)} for this scale_scope "
            "([] for 'tensor', x.shape[:-1] + (1,) for 'row')"
        )
    ok = torch.isfinite(value) & ((value > 0) if positive else (value >= 0))
    if not bool(ok.all()):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    # a copy: the quantized tensor must not follow later in-place changes of the caller's scale
    return value.detach().to(x.device, copy=True)


def _block_amax(a: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """a: |x| float32 [R, K/16, 16] -> block amax [R, K/16, 1] (tile-wide for 16x16)."""
    bamax = a.amax(dim=-1, keepdim=True)  # [..., R, K/16, 1]
    if tile_rows == 1:
        return bamax
    *lead, r, nb, _ = bamax.shape
    tiles = bamax.view(*lead, r // tile_rows, tile_rows, nb, 1).amax(dim=-3, keepdim=True)
    return tiles.expand(*lead, r // tile_rows, tile_rows, nb, 1).reshape(bamax.shape)


def _encode(xb: torch.Tensor, block_scale: torch.Tensor, gs: GlobalScales, rounding, uniform):
    """Codes uint8 [..., K/16, 16] of x blocks under given E4M3 block scales [..., K/16, 1]."""
    enc = block_encode_scale(block_scale, gs.decode_for_encoding.unsqueeze(-1))
    return round_to_e2m1(xb * enc, rounding, uniform=uniform)


def _block_error(codes, block_scale, xb, gs: GlobalScales, err: str, tile_rows: int) -> torch.Tensor:
    """Summed decode error of each block [..., K/16, 1] (tile-wide for 16x16), fixed order."""
    values = e2m1_codes_to_values(codes) * block_scale.float()  # [..., K/16, 16]
    if gs.error_amax is None:
        decoded = values * gs.global_scale.unsqueeze(-1)
    else:
        decoded = true_div(values * gs.error_amax.unsqueeze(-1), GLOBAL_SCALE_MAX["4/6"])
    diff = decoded - xb
    e = diff * diff if err == "mse" else diff.abs()
    total = e[..., 0]
    for i in range(1, BLOCK):  # left to right, as a sequential kernel loop adds them
        total = total + e[..., i]
    if tile_rows > 1:  # tree over the 16 rows of each tile
        *lead, r, nb = total.shape
        rows = total.view(*lead, r // tile_rows, tile_rows, nb)
        while rows.shape[-2] > 1:
            h = rows.shape[-2] // 2
            rows = rows[..., :h, :] + rows[..., h:, :]
        total = rows.expand(*lead, r // tile_rows, tile_rows, nb).reshape(*lead, r, nb)
    return total.unsqueeze(-1)


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
    """Quantize x [..., K] (float32, bfloat16 or float16) to NVFP4.

    tile: 16 (1x16 blocks along K) or (16, 16) (one scale per 16x16 tile of the last two dims).
    scale_rule: "6" (standard) or "4/6" (per block, the better of block max -> 6 and -> 4).
    err: 4/6 selection error, "mse" or "mae". rounding: "nearest" (RNE) or "stochastic"
        (unbiased per element on [-6, 6] for a given block scale; with "4/6" the block's choice
        between the two candidates looks at the drawn codes, so the result is no longer unbiased).
    scale_scope: one global scale per "tensor" ([]) or per "row" (x.shape[:-1] + (1,)).
    generator: torch.Generator on x's device for stochastic rounding (reproducible draws).
    global_scale / amax: impose the decode-direction global scale, or the amax it comes
        from (shape [] or x.shape[:-1] + (1,)); at most one of them.
    allow_nonfinite: accept NaN/Inf: every amax is taken over the finite values, NaN
        becomes code 0, +-Inf saturates to +-6 (a 4/6 block holding one keeps rule 6).
    pad: zero-pad K to a multiple of 16; the original shape is kept for dequantize.
    hadamard_seed: apply the 16-point random Hadamard transform with this seed first;
        dequantize undoes it.
    """
    tile_rows, _ = _validate_options(tile, scale_rule, err, rounding, scale_scope)
    _validate_input(x, tile_rows, pad, allow_nonfinite)
    if global_scale is not None and amax is not None:
        raise ValueError("pass at most one of global_scale= and amax= (they impose the same thing)")
    if generator is not None and rounding != "stochastic":
        raise ValueError("generator= is only used with rounding='stochastic'")
    if generator is not None and generator.device.type != x.device.type:
        raise ValueError(f"generator is on {generator.device}, x on {x.device}: create it on x's device")

    shape, dtype = x.shape, x.dtype
    xf = x.detach().float()  # codes and scales carry no graph (the CPU and Triton paths detach too)
    k = shape[-1]
    if k % BLOCK:
        xf = torch.nn.functional.pad(xf, (0, (-k) % BLOCK))
    if hadamard_seed is not None:
        xf = random_hadamard(xf, hadamard_seed)
        if not allow_nonfinite and not bool(torch.isfinite(xf).all()):
            raise ValueError("x's random Hadamard transform overflows float32 (|x| within about 16x of "
                             "3.4e38 in a block): scale x down, or quantize without hadamard_seed")
    x2 = xf.reshape(-1, xf.shape[-1])  # [R, Kp]; 16x16 tiles never straddle two matrices

    scale_shape = torch.Size(()) if scale_scope == "tensor" else torch.Size((*shape[:-1], 1))
    if global_scale is not None:
        g = _validate_scale(global_scale, "global_scale", scale_shape, x, positive=True)
        gs = global_scales_from_decode(g.reshape(-1, 1) if scale_scope == "row" else g)
    else:
        if amax is not None:
            tensor_amax = _validate_scale(amax, "amax", scale_shape, x, positive=False)
            tensor_amax = tensor_amax.reshape(-1, 1) if scale_scope == "row" else tensor_amax
        else:
            a = _finite_abs(x2) if allow_nonfinite else x2.abs()
            tensor_amax = a.amax() if scale_scope == "tensor" else a.amax(dim=-1, keepdim=True)  # [R, 1]
        gs = global_scales_from_amax(tensor_amax, scale_rule)

    # One uniform draw per element, in row-major order (shared by both 4/6 candidates).
    uniform = None
    if rounding == "stochastic":
        uniform = torch.rand(x2.shape, generator=generator, device=x.device, dtype=torch.float32)

    # Blocks are independent once the global scales are known. On one CPU thread, work
    # through cache-sized groups of rows (about 1.8x faster than whole-tensor passes); with
    # several threads each op is a parallel region, and on a busy machine the many small
    # regions of row groups wait on each other, so whole-tensor passes are faster there.
    rows, kp = x2.shape
    step = rows
    if x.device.type == "cpu" and torch.get_num_threads() == 1:
        step = max(tile_rows, _CHUNK_ELEMENTS // kp // tile_rows * tile_rows)
    data = torch.empty(rows, kp // 2, dtype=torch.uint8, device=x.device)
    block_scale = torch.empty(rows, kp // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        data[r0:r1], block_scale[r0:r1] = _quantize_rows(
            x2[r0:r1], gs.rows(r0, r1), tile_rows, scale_rule, err, rounding,
            None if uniform is None else uniform[r0:r1], allow_nonfinite,
        )
    return NVFP4Tensor(
        data=data.reshape(*xf.shape[:-1], kp // 2),
        block_scale=block_scale.reshape(*xf.shape[:-1], kp // BLOCK),
        global_scale=gs.global_scale.reshape(scale_shape),
        shape=shape,
        dtype=dtype,
        tile=tile,
        scale_rule=scale_rule,
        hadamard_seed=hadamard_seed,
    )


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf read as 0: with allow_nonfinite, scales come from finite values."""
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _quantize_rows(x2, gs: GlobalScales, tile_rows, scale_rule, err, rounding, uniform, allow_nonfinite):
    """Rows x2 float32 [r, Kp] -> (packed codes uint8 [r, Kp/2], block scales e4m3 [r, Kp/16])."""
    xb = x2.reshape(x2.shape[0], -1, BLOCK)  # [r, Kp/16, 16]
    if uniform is not None:
        uniform = uniform.reshape(xb.shape)
    a = _finite_abs(xb) if allow_nonfinite else xb.abs()
    bamax = _block_amax(a, tile_rows)  # [r, Kp/16, 1]
    enc = gs.encode.unsqueeze(-1)  # [] -> [1], or [r, 1] -> [r, 1, 1]
    if scale_rule == "6":
        block_scale = cast_to_e4m3(bamax * (enc * _FP32_ONE_SIXTH))
        codes = _encode(xb, block_scale, gs, rounding, uniform)
    else:
        base = true_div(bamax, E2M1_MAX) * enc
        scale6, scale4 = cast_to_e4m3(base), cast_to_e4m3(base * 1.5)
        codes6 = _encode(xb, scale6, gs, rounding, uniform)
        codes4 = _encode(xb, scale4, gs, rounding, uniform)
        # A block holding NaN or Inf has error NaN or inf for both candidates and keeps 6.
        pick4 = _block_error(codes4, scale4, xb, gs, err, tile_rows) < _block_error(
            codes6, scale6, xb, gs, err, tile_rows
        )
        codes = torch.where(pick4, codes4, codes6)
        block_scale = torch.where(pick4, scale4, scale6)
    return pack_fp4(codes.reshape(x2.shape)), block_scale.squeeze(-1)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e2m1 * block_scale) * global_scale in float32, then cast to dtype; original shape."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"q must be an NVFP4Tensor (from quantize), got {type(q).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantize: dtype must be a floating torch dtype (e.g. torch.bfloat16), got "
                        f"{dtype!r}")
    codes = unpack_fp4(q.data)  # [..., Kp]
    values = e2m1_codes_to_values(codes).reshape(*codes.shape[:-1], -1, BLOCK)  # [..., Kp/16, 16]
    g = q.global_scale.reshape(*q.global_scale.shape, 1) if q.global_scale.ndim else q.global_scale
    x = ((values * q.block_scale.float().unsqueeze(-1)) * g).reshape(codes.shape)
    if q.hadamard_seed is not None:
        x = inverse_random_hadamard(x, q.hadamard_seed)
    k = q.shape[-1]
    if x.shape[-1] != k:
        x = x[..., :k]
    return x.to(dtype)


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x, **kwargs)) in x's dtype and shape."""
    return dequantize(quantize(x, **kwargs), dtype=x.dtype)
