"""The decode step's residual add + RMSNorm folded into the launch of the kernel that consumes its output:
x' = bf16(x + h), y = bf16(w * bf16(x' * rstd)), rstd = 1 / sqrt(sum(x'^2) / H + eps) (IEEE sqrt and
division), the sum of squares in one fixed order (below). Two CUDA builds take it in (each compiled with
`HEADER`, the per-chunk arithmetic they share): the MoE router + route (`moe_route_cuda.norm_router_route`,
the router's PRENORM build) and the dense mma16 GEMM (`gemv_cuda_prenorm.launch_prenorm`, its PRENORM
build). Either one launch replaces fused.add_rmsnorm's and its own.

`reference` is that arithmetic in torch ops (any device); on a GPU each kernel equals it bit for bit (GPU
tests), on a CPU it is held to fp4rl.model's RMSNorm (within a bf16 ulp) and to a scalar emulation of the
sum's order (tests/test_prenorm.py). The order, for 8 warps of 32 lanes: lane l of warp w adds its 16-byte
chunks c = l + 32 i (columns 8c .. 8c + 7), i = w, w + 8, ... ascending, the 8 exact squares of a chunk in
element order; the warp's xor butterfly (16, 8, 4, 2, 1) adds the lanes; the 8 warps' sums are added in warp
order.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

HEADER = Path(__file__).with_name("prenorm.cuh")
WARPS = 8  # the warps of a CTA that share a row's sum (both builds run 8 warps)


def header() -> str:
    """The CUDA helpers both PRENORM builds are compiled with (prepended to their sources)."""
    return HEADER.read_text()


def f32_bits(v: float) -> int:
    """v rounded to float32 (RNE, as torch's conversion) as its bit pattern, a signed 32-bit int (how the
    kernels take their float parameters through pdl.launch, which passes ints)."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def butterfly(v: torch.Tensor, op) -> torch.Tensor:
    """A warp's xor butterfly over the last dim (32 lanes): v[l] = op(v[l], v[l ^ m]) for m = 16 .. 1."""
    lanes = torch.arange(32, device=v.device)
    for m in (16, 8, 4, 2, 1):
        v = op(v, v[..., lanes ^ m])
    return v


def sumsq(xs: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of each row of xs [T, H] (bf16 values) in the builds' order (module doc). (A
    bf16 square is exact in fp32 down to |x'| ~ 2^-66; below, the kernels' fmaf and this rounded product can
    part.)"""
    t, hd = xs.shape
    nch = -(-hd // 256)
    pad = torch.zeros(t, 256 * nch, device=xs.device)
    pad[:, :hd] = xs.float()
    sq = (pad * pad).view(t, nch, 32, 8)  # exact squares, [t, i, lane, element]
    total = None
    for w in range(WARPS):
        acc = torch.zeros(t, 32, device=xs.device)
        for i in range(w, nch, WARPS):
            for el in range(8):
                acc = acc + sq[:, i, :, el]
        part = butterfly(acc, torch.add)[:, 0]
        total = part if total is None else total + part
    return total


def combine(d: torch.Tensor, pos: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """moe_route.combine's bits in torch ops: r[t] = bf16(sum_j w[t, j] * d[pos[t k + j]]), each product
    rounded to fp32, added in j order from +0."""
    t, k = w.shape
    rows = d[pos.long().reshape(t, k)].float()  # [t, k, H]
    acc = torch.zeros(t, d.shape[1], device=d.device)
    for j in range(k):
        acc = acc + w[:, j:j + 1].float() * rows[:, j]
    return acc.bfloat16()


def reference(x: torch.Tensor, h: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              moe: tuple | None = None):
    """The PRENORM builds' x' and y [T, H] in torch ops (each op one IEEE rounding; any device): x' = bf16(x +
    h) (moe = (d, pos, w) with h None: bf16(x + combine(d, pos, w)), the GEMM's PRENORM 2), rstd = 1 /
    sqrt(sumsq(x') * float32(1 / H) + float32(eps)) (IEEE sqrt and division), y = bf16(w * bf16(x' *
    rstd))."""
    hd = x.shape[1]
    add = combine(*moe) if moe is not None else h
    xs = (x.float() + add.float()).bfloat16()  # [t, H]
    inv_h = torch.tensor(1.0 / hd, dtype=torch.float32, device=x.device)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    rstd = 1.0 / torch.sqrt(sumsq(xs) * inv_h + eps32)  # [t]
    y = (norm_weight.float() * (xs.float() * rstd[:, None]).bfloat16().float()).bfloat16()
    return xs, y


def check(x: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, what: str) -> None:
    """The operands a PRENORM build takes: h as x (bfloat16 [T, H] on one device), the norm's weight a
    contiguous, 16-byte aligned bfloat16 [H] (its 16-byte chunks are copied as they are)."""
    t, hd = x.shape
    if h.shape != x.shape or h.dtype != torch.bfloat16 or h.device != x.device:
        raise ValueError(f"{what}: h must be bfloat16 {tuple(x.shape)} on {x.device} (x's), got {h.dtype} "
                         f"{tuple(h.shape)} on {h.device}")
    if norm_weight.numel() != hd or norm_weight.dtype != torch.bfloat16 or norm_weight.device != x.device \
            or not norm_weight.is_contiguous() or norm_weight.data_ptr() % 16:
        raise ValueError(f"{what}: norm_weight must be the RMSNorm's contiguous, 16-byte aligned bfloat16 "
                         f"[{hd}] weight on {x.device}, got {norm_weight.dtype} {tuple(norm_weight.shape)}")


def check_moe(x: torch.Tensor, moe, norm_weight: torch.Tensor, what: str):
    """The MoE combine's operands a PRENORM 2 build takes -> (d, pos, w): d [T k, H] bfloat16 with unit column
    stride, pos [T k] int32, w [T, k] bfloat16 or float32 with unit column stride, on x's device (x [T, H]);
    the norm weight as `check` wants it."""
    if not isinstance(moe, (tuple, list)) or len(moe) != 3 \
            or not all(isinstance(v, torch.Tensor) for v in moe):
        raise ValueError(f"{what}: moe must be the tensors (d, pos, w) of moe_route.combine")
    check(x, x, norm_weight, what)
    d, pos, w = moe
    t, hd = x.shape
    if w.ndim != 2 or w.shape[0] != t or not 1 <= w.shape[1] <= 16 or w.stride(1) != 1 \
            or w.dtype not in (torch.bfloat16, torch.float32) or w.device != x.device:
        raise ValueError(f"{what}: moe w must be bfloat16 / float32 [T={t}, k <= 16] with unit column stride "
                         f"on {x.device}, got {w.dtype} {tuple(w.shape)} strides {w.stride()}")
    k = w.shape[1]
    if d.shape != (t * k, hd) or d.dtype != torch.bfloat16 or d.stride(1) != 1 or d.device != x.device:
        raise ValueError(f"{what}: moe d must be bfloat16 [T k = {t * k}, H = {hd}] with unit column stride "
                         f"on {x.device}, got {d.dtype} {tuple(d.shape)} strides {d.stride()}")
    if pos.numel() != t * k or pos.dtype != torch.int32 or not pos.is_contiguous() or pos.device != x.device:
        raise ValueError(f"{what}: moe pos must be contiguous int32 [T k = {t * k}] on {x.device}, got "
                         f"{pos.dtype} {tuple(pos.shape)}")
    return d, pos.reshape(-1), w
