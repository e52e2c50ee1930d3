"""NVFP4 quantize / dequantize on the GPU (Triton), byte-identical to fp4rl.nvfp4.reference.

Same signatures as the reference, so ``fp4rl.nvfp4`` can route CUDA tensors here. What runs
where:
- CUDA tensors (or any tensor under ``TRITON_INTERPRET=1``): the kernels of
  fp4rl.kernels.quantize (1x16 and 16x16 tiles, per-tensor and per-row scales, imposed
  amax / global_scale, rules 6 and 4/6 with MSE or MAE, nearest and stochastic rounding)
  and fp4rl.kernels.gemm.dequantize.
- everything else, and the random Hadamard transform (``hadamard_seed``), goes to the
  reference unchanged.
Stochastic rounding uses Philox seeded from ``generator`` (or torch's default generator): it
is unbiased and reproducible for a given generator state, not the reference's exact draws.
NaN/Inf are refused with one device sync, as the reference does; kernel-level callers that
must not sync (CUDA graphs) use fp4rl.kernels.quantize.quantize_2d(check_finite=False).
"""

from __future__ import annotations

import torch

from fp4rl.kernels._common import INTERPRET
from fp4rl.kernels.gemm import dequantize as _dequantize_packed
from fp4rl.kernels.quantize import quantize_2d
from fp4rl.nvfp4 import reference
from fp4rl.nvfp4.format import BLOCK, NVFP4Tensor


def _on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or INTERPRET


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
    """fp4rl.nvfp4.reference.quantize, computed by the Triton kernels (see the module docstring)."""
    kwargs = dict(tile=tile, scale_rule=scale_rule, err=err, rounding=rounding, scale_scope=scale_scope,
                  generator=generator, global_scale=global_scale, amax=amax,
                  allow_nonfinite=allow_nonfinite, pad=pad, hadamard_seed=hadamard_seed)
    if not isinstance(x, torch.Tensor) or not _on_kernels(x) or hadamard_seed is not None:
        return reference.quantize(x, **kwargs)
    tile_rows, _ = reference._validate_options(tile, scale_rule, err, rounding, scale_scope)
    if x.dtype not in reference.SUPPORTED_DTYPES or x.ndim == 0 or x.numel() == 0:
        return reference.quantize(x, **kwargs)  # raises the reference's error
    if global_scale is not None and amax is not None:
        raise ValueError("pass at most one of global_scale= and amax= (they impose the same thing)")
    if generator is not None and rounding != "stochastic":
        raise ValueError("generator= is only used with rounding='stochastic'")
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
    scale_shape = torch.Size(()) if scale_scope == "tensor" else torch.Size((*x.shape[:-1], 1))
    if global_scale is not None:
        global_scale = reference._validate_scale(global_scale, "global_scale", scale_shape, x, positive=True)
    if amax is not None:
        amax = reference._validate_scale(amax, "amax", scale_shape, x, positive=False)
    seed = 0
    if rounding == "stochastic":
        gen_device = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, 2**31 - 1, (), generator=generator, device=gen_device))

    xf = x if not k % BLOCK else torch.nn.functional.pad(x, (0, (-k) % BLOCK))
    x2 = xf.reshape(-1, xf.shape[-1])
    data, block_scale, g = quantize_2d(
        x2, tile16=tile_rows > 1, scale_rule=scale_rule, err=err, stochastic=rounding == "stochastic",
        per_row=scale_scope == "row", amax=amax, global_scale=global_scale,
        allow_nonfinite=allow_nonfinite, seed=seed,
    )
    lead = xf.shape[:-1]
    return NVFP4Tensor(
        data=data.reshape(*lead, -1),
        block_scale=block_scale.reshape(*lead, -1),
        global_scale=g.reshape(scale_shape),
        shape=x.shape,
        dtype=x.dtype,
        tile=tile,
        scale_rule=scale_rule,
        hadamard_seed=None,
    )


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp4rl.nvfp4.reference.dequantize: (e2m1 * block_scale) * global_scale in float32, then dtype."""
    if not isinstance(q, NVFP4Tensor) or not _on_kernels(q.data) or q.hadamard_seed is not None \
            or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # (the reference refuses)
        return reference.dequantize(q, dtype)
    x = _dequantize_packed(q.data, q.block_scale, q.global_scale, dtype=torch.float32)
    k = q.shape[-1]
    if x.shape[-1] != k:
        x = x[..., :k]
    return x.to(dtype)


def fake_quantize(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """dequantize(quantize(x, **kwargs)) in x's dtype and shape."""
    return dequantize(quantize(x, **kwargs), dtype=x.dtype)
