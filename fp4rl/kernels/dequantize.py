"""Packed NVFP4 -> dense in one Triton kernel: `dequantize` (the reference's arithmetic, bit for bit), or the
exact e2m1 * block_scale without the global scale (the W4A4 operands of fp4rl.kernels.gemm's paths that take
bfloat16 activations, and its dequantize-then-cuBLAS fallback)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import ASM, INTERPRET, load_unpacked


@triton.jit
def _dequantize_kernel(d_ptr, s_ptr, g_ptr, out_ptr, R, KH, stride_d, stride_s, stride_o, rows_per_g,
                       APPLY_G: tl.constexpr, BR: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr):
    """out[r, k] = (e2m1 * block_scale) * g (float32 math, then out's dtype), reference order.
    g is per tensor (rows_per_g = R) or per row group (g index = r // rows_per_g)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < R
    kb0 = tl.program_id(1) * BKH
    lo, hi = load_unpacked(d_ptr, s_ptr, rows, rmask, kb0, KH, stride_d, stride_s, BR, BKH, USE_ASM)
    v = tl.reshape(tl.join(lo, hi), (BR, 2 * BKH))  # exact e2m1 * s, natural order
    if APPLY_G:
        g = tl.load(g_ptr + rows // rows_per_g, mask=rmask, other=0.0)
        v = v.to(tl.float32) * g[:, None]
    k = 2 * kb0 + tl.arange(0, 2 * BKH)
    tl.store(out_ptr + rows[:, None] * stride_o + k[None, :], v.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (k[None, :] < 2 * KH))


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def dequantize(data, block_scale, global_scale, dtype=torch.bfloat16, apply_global: bool = True):
    """Packed NVFP4 [..., K/2] -> dtype [..., K]: (e2m1 * block_scale) * global_scale in float32
    (the reference order; bit-identical to fp4rl.nvfp4.dequantize), or e2m1 * block_scale
    (exact in bfloat16) when apply_global=False. global_scale: one value, or one per row, or one
    per leading index (e.g. per expert of [E, N, K/2])."""
    lead, kh = data.shape[:-1], data.shape[-1]
    d2 = data.reshape(-1, kh).contiguous()
    s2 = _u8(block_scale).reshape(-1, kh // 8).contiguous()
    r = d2.shape[0]
    g = global_scale.float().reshape(-1).contiguous()
    if r % g.numel():
        raise ValueError(f"global_scale has {g.numel()} values, which do not divide the {r} rows")
    out = torch.empty(r, 2 * kh, dtype=dtype, device=data.device)
    br, bkh = (16, 64) if INTERPRET else (32, 128)
    grid = (triton.cdiv(r, br), triton.cdiv(kh, bkh))
    _dequantize_kernel[grid](d2, s2, g, out, r, kh, d2.stride(0), s2.stride(0), out.stride(0),
                             r // g.numel(), APPLY_G=apply_global, BR=br, BKH=bkh, USE_ASM=ASM["on"],
                             num_warps=4)
    return out.reshape(*lead, 2 * kh)
