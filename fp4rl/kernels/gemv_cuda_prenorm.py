"""The .cu's PRENORM builds of the dense mma16 GEMM (fp4rl.kernels.gemv_cuda): the decode step's residual add
+ RMSNorm inside the GEMM's x staging (fp4rl.kernels.prenorm's arithmetic), one launch instead of
fused.add_rmsnorm's and the GEMM's where x is staged whole (one row; a few rows where the in-CTA split fits:
``prenorm_plan``). PRENORM 2 adds the previous MoE layer's routed experts' combine instead of a layer output.

Used by the decode step's FP4RL_DENSE_NORM (gpu_linear.prenorm_gemm), off by default: on an H100 the norm
cost more inside each consumer CTA than the add_rmsnorm launch it removed (bench/RESULTS.md, thirty-eighth
session). Each kind has its own failure switch (``PN_STATE``: ok / moe_ok); the step then runs add_rmsnorm +
``launch``.
"""

from __future__ import annotations

import functools
import warnings

import torch

from fp4rl.kernels import gemv_cuda, pdl, prenorm
from fp4rl.kernels.gemv_cuda import (
    SMEM_LIMIT,
    WARPS,
    Mma16Weight,
    _kernel,
    _operands,
    _pdl_kind,
    _row_scale_key,
    _set_smem,
    block_rows,
    choose,
    smem_bytes,
    supports,
)

# the PRENORM builds (launch_prenorm): ok False once the residual add's failed here, moe_ok False once the MoE
# combine's did (the step then runs add_rmsnorm + launch for that kind)
PN_STATE = {"ok": None, "moe_ok": None, "error": None}


def prenorm_available(device=None, moe: bool = False) -> bool:
    """`available`, and the PRENORM build (moe: the MoE combine's, PRENORM 2) has not failed here before."""
    return PN_STATE["moe_ok" if moe else "ok"] is not False and gemv_cuda.available(device)


def disable_prenorm(exc: Exception, moe: bool = False) -> None:
    """A PRENORM build failed here (moe: the MoE combine's): that kind off for good (fused.add_rmsnorm +
    `launch` instead); the rest stays."""
    PN_STATE["moe_ok" if moe else "ok"], PN_STATE["error"] = False, repr(exc)[:300]
    warnings.warn("CUDA residual add + RMSNorm inside the mma16 GEMM's launch disabled "
                  f"({PN_STATE['error']}); using fused.add_rmsnorm before the GEMM", stacklevel=3)


PRENORM_MAX_ROWS = 8  # prenorm_plan: rows up to one MMA group


def prenorm_plan(n: int, k: int, m: int, sms: int, ktop: int = 0, w_f32: bool = False) -> dict | None:
    """The PRENORM build for an N x K weight and m rows, or None where it does not apply: ``choose``'s
    configuration with the whole K staged in each CTA (its cluster split moved inside the CTA, as
    ``in_cta_split``: the same bits), at most PRENORM_MAX_ROWS rows, and two CTAs per SM with hr's rows and
    the norm weight in shared memory too. ktop > 0: the MoE combine's build (PRENORM 2: x' = x + the combine
    of ktop expert rows a row, their weights fp32 (w_f32) or bf16), which stages those rows instead of hr's.
    None also where the in-CTA split is turned off (set_in_cta_split)."""
    if not supports(n, k) or not 1 <= m <= PRENORM_MAX_ROWS or not 0 <= ktop <= 16:
        return None
    try:
        cfg = choose(n, k, m, sms)
    except ValueError:
        return None
    if cfg.get("XSTREAM") or cfg.get("WGMMA"):
        return None
    if cfg["SPLIT"] > 1:
        if not gemv_cuda.IN_CTA_SPLIT:
            return None
        cfg = dict(cfg, SPLIT=1, KW=cfg["SPLIT"])
    cfg = dict(cfg, PRENORM=1) if not ktop else dict(cfg, PRENORM=2, KTOP=ktop, MW_F32=int(w_f32))
    return cfg if smem_bytes(cfg, k, m) <= SMEM_LIMIT else None


def prenorm_static_bytes(cfg: dict) -> int:
    """The PRENORM build's static shared memory: the rows' sums of squares per warp (PRENORM 2: and the rows'
    expert positions and weights)."""
    rows = 8 * cfg["MG"]
    return 4 * rows * WARPS + (8 * rows * cfg["KTOP"] if cfg.get("PRENORM") == 2 else 0)


@functools.cache
def _plan_prenorm(n: int, k: int, m: int, device_index: int, ktop: int, w_f32: bool) -> dict | None:
    return prenorm_plan(n, k, m, torch.cuda.get_device_properties(device_index).multi_processor_count, ktop,
                        w_f32)


def launch_prenorm(x2: torch.Tensor, h: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   wc: Mma16Weight, global_scale: torch.Tensor, y: torch.Tensor,
                   moe: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode step's residual add + RMSNorm, then ``launch`` on its output, in one launch (the PRENORM
    build): x' = bf16(x2 + h), y = bf16(norm_weight * bf16(x' * rstd)) with rstd = 1 / sqrt(sum(x'^2) / K +
    eps) (fp4rl.kernels.prenorm.reference's bits), y [M, N] = y @ DQ(W).T into `y`. x2 (the residual) and h
    (the layer output to add) bfloat16 [M, K]; norm_weight the RMSNorm's bfloat16 [K] (read before the PDL
    wait, as the GEMM's weights: nothing writes a norm weight inside pdl.step(), and a step's first kernel
    has no PDL, so a weight sync before the step has landed). moe = (d, pos, w) with h None: what is added is
    moe_route.combine(d, pos, w) (the previous MoE layer's routed experts: fused.add_rmsnorm(moe=)'s job; the
    PRENORM 2 build). Returns (x', y), x' a new contiguous [M, K], or None where ``prenorm_plan`` has no
    build for these rows (the caller runs add_rmsnorm and ``launch``)."""
    what = "gemv_cuda_prenorm.launch_prenorm"
    m, k = x2.shape
    if k != wc.k:
        raise ValueError(f"{what}: x has K={k}, the weight {wc.k}")
    if x2.dtype != torch.bfloat16 or y.dtype != torch.bfloat16:
        raise TypeError(f"{what}: takes bfloat16 x and y")
    if tuple(y.shape) != (m, wc.n) or y.stride(1) != 1 or y.device != x2.device:
        raise ValueError(f"{what}: y must be [{m}, {wc.n}] with unit column stride on x's device, got "
                         f"{tuple(y.shape)} stride {y.stride()} on {y.device}")
    if (h is None) == (moe is None):
        raise ValueError(f"{what}: pass h (the layer output to add) or moe = (d, pos, w) (the MoE combine to "
                         "add), one of the two")
    if moe is None:
        prenorm.check(x2, h, norm_weight, what)
        hr, mpos, mw, ktop, w_f32 = h, None, None, 0, False
    else:
        hr, mpos, mw = prenorm.check_moe(x2, moe, norm_weight, what)
        ktop, w_f32 = mw.shape[1], mw.dtype == torch.float32
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    cfg = _plan_prenorm(wc.n, wc.k, m, dev, ktop, w_f32)
    if cfg is None:
        return None
    x2, g, _ = _operands(x2, global_scale, None, (1, wc.n), f"1 or N={wc.n}")
    if hr.stride(1) != 1 or hr.stride(0) % 8 or hr.data_ptr() % 16:  # 16-byte rows for cp.async, as x2's
        hr = hr.clone(memory_format=torch.contiguous_format)
    key = _row_scale_key(cfg, g.numel() > 1)
    kern = _kernel(tuple(sorted(key.items())) + (g.numel() > 1, False, False), dev)
    xo = torch.empty(m, k, dtype=torch.bfloat16, device=x2.device)
    smem = smem_bytes(cfg, k, m)
    nb = -(-wc.n // block_rows(cfg))
    with torch.cuda.device(dev):
        _set_smem(kern, smem + prenorm_static_bytes(cfg))  # (the static arrays count too)
        pdl.launch(kern, (nb, 1, 1), (WARPS * 32, 1, 1),
                   [x2, wc.wt, wc.st, g, g, y, m, wc.n, k, x2.stride(0), y.stride(0), g, 0, g,
                    hr, norm_weight, xo, hr.stride(0), prenorm.f32_bits(1.0 / k), prenorm.f32_bits(eps),
                    mpos if mpos is not None else g, mw if mw is not None else g,
                    mw.stride(0) if mw is not None else 0],
                   smem, torch.cuda.current_stream(dev), pdl.gemm_flag(dev, _pdl_kind(cfg, m)))
    PN_STATE["moe_ok" if moe is not None else "ok"] = True
    return xo, y
