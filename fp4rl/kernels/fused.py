"""Fused elementwise kernels of the decode step: residual add + RMSNorm, q/k-norm + RoPE + KV write (BF16,
or NVFP4 quantized per (row, head) there: fp4rl/kernels/fused_rope.py, re-exported here), SiLU(gate) * up;
the W4A4 activation quantizer fused into the first and the last.

At batch 1 a decode step of a dense model is ~20 small kernels per layer outside the GEMMs (fp32
upcasts, the norm's reductions, RoPE's cat/neg/mul/add, the residual adds, SiLU and the product, the
KV index_copy), and in W4A4 four activation quantizations per layer. Each is latency bound; these
kernels do the same arithmetic in four launches per layer (residual add + RMSNorm before attention and
before the MLP, q/k-norm + RoPE + KV write, SiLU * up) plus one for the final norm, with grid (rows,
chunks of columns) or (rows, heads).

The arithmetic is fp4rl/model.py's, rounding to bfloat16 where torch does:

    x' = bf16(x + h)                                  (residual; fp32 add of two bf16, one rounding)
    y  = bf16(w * bf16(x' * rsqrt(sum(x'^2) / K + eps)))    (RMSNorm: fp32 inside, bf16 out)
    RoPE: out = bf16(bf16(q * cos) + bf16(rotate_half(q) * sin))   (cos, sin: the step's bf16 tables)
    SiLU * up: y = bf16(bf16(g / (1 + exp(-g))) * u)  (IEEE division; libdevice expf on the GPU)

Where these are bit for bit the unfused path's, and where not:
- residual add, RoPE, the weight product, the KV write: exact (products of two bf16 are exact in
  fp32, each sum rounds once in fp32 then to bf16, as torch's opmath does).
- RMSNorm (and q/k-norm): the fp32 sum of squares is added in another order than torch's reduction,
  so it can differ in its last bits, and rstd is tl.math.rsqrt's, not necessarily torch.rsqrt's to the
  last fp32 bit; either moves x' * rstd by an fp32 ulp or so, and y = bf16(...) differs by one bfloat16
  ulp in the rare element that sits next to a rounding boundary. What the tests check
  (tests/test_fused_kernels.py): y within one bfloat16 ulp of torch's RMSNorm, equal in >= 98% of the
  elements (q/k-norm + RoPE: within 2^-6 relative after the rotation, equal in >= 95%); the decode
  step's CPU tests (tests/test_gpu_decode.py) see no difference at all in the logits.
- add_rmsnorm(prenorm_order=True): rstd as the CUDA PRENORM builds compute it (fp4rl.kernels.prenorm: the
  sum of squares in their lane / warp order, IEEE sqrt and division), so x' and y are prenorm.reference's
  bits; the decode step uses it for every norm when some are folded into those builds.
- SiLU: on the GPU expf is libdevice's (what torch's CUDA kernel calls) and the division is IEEE, so
  it is torch's result; in the CPU interpreter exp is numpy's, which may differ from torch's CPU exp
  in the last fp32 bit (1 bf16 ulp, rarely).

W4A4. A linear whose input is quantized per token (NVFP4, 1x16 blocks, one FP32 global scale per
row) takes its Q(y) from the producing kernel: after y is known (rounded to bf16 exactly as above),
the kernel takes the row amax (integer max of |y|'s bit patterns over the finite values) and runs
fp4rl.kernels.quantize's own @triton.jit helpers (`_global_from_amax`, `_quantize_blocks`,
`_store_blocks`) on the bfloat16 values: the bytes are those of `fp4rl.kernels.quantize.quantize_2d(y,
per_row=True, check_finite=False)`, hence of the reference, for the same y (tested).

Split rows. A quantizing launch runs several programs per row (grid (rows, chunks); at batch 1 of
Qwen3-8B 12 per 12288-column row, 8 per 4096, see SPLIT_PER_ROW), with no atomics and no second kernel:
each program recomputes what it needs of the whole row itself (the sum of squares of x' with the same
loop, so the same rstd bit for bit; the amax of y, an integer max, so the same in any order) and from it
the same global scale, then writes only its own columns of x', y and the codes/block scales; program 0
of the row writes the global scale. Programs only read the inputs (x, h, w; gu) and write outputs the
wrappers allocate apart from them, so no program reads a column that another writes (x' is a new
tensor, never x: an in-place x += h would let one program read another's updated columns). The
add + RMSNorm launch without quantization is split the same way.

MoE combine folded into the residual (add_rmsnorm's moe=(d, pos, w)). After a MoE layer's routed
experts the residual term is moe_route.combine's r = bf16(sum_j w[t, j] * d[pos[t k + j]]) (fp32, j in
order from 0, each product rounded before its add: enable_fp_fusion=False, no FMA), plus the shared
expert's h when given (r = bf16(r + h)); the kernel computes r itself where it loads h, so x', y and Q(y)
are the bits of combine followed by add_rmsnorm, one launch fewer per MoE layer. Each program gathers the
row's k expert rows in every pass over the row (sum of squares, amax, its own chunk): k x 2 B x K per pass
from L2.

Programmatic dependent launch (fp4rl.kernels.pdl; Hopper): with the PDL constexpr on, a kernel's first
statements are griddepcontrol.launch_dependents (the next kernel on the stream may be scheduled now) and
griddepcontrol.wait (until the previous grid has finished and its writes are visible), and the launch
carries launch_pdl, so nothing is read or written before the previous kernel is done.

NaN/Inf follow the unfused path: a NaN in a row makes its norm NaN (as torch's), and the quantizer
sees the same values the separate quantizer would (amax over finite values, no check: the engine's
quantizer runs with check_finite=False inside CUDA graphs as well).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from fp4rl.kernels import pdl
from fp4rl.kernels._common import COMPILED, INTERPRET
from fp4rl.kernels.quantize import _global_from_amax, _quantize_blocks, _store_blocks

try:  # griddepcontrol (programmatic dependent launch); traced only when a kernel's PDL constexpr is on
    from triton.language.extra import cuda as tlcuda
except ImportError:
    tlcuda = None

try:
    from triton.language.extra import libdevice
    _LIBDEVICE_ERROR = None
except Exception as exc:  # noqa: BLE001
    libdevice = None
    _LIBDEVICE_ERROR = f"{type(exc).__name__}: {str(exc)[:200]}"

USE_LIBDEVICE = libdevice is not None and not INTERPRET  # the interpreter has no libdevice
_WARNED_NO_LIBDEVICE = False


def _libdevice_for(device: torch.device) -> bool:
    """Whether SiLU's exp is libdevice's expf for a launch on `device`; warns once when a compiled CUDA launch
    has to fall back to tl.exp (ex2.approx: SiLU * up is then no longer torch's bit for bit)."""
    global _WARNED_NO_LIBDEVICE
    if USE_LIBDEVICE or INTERPRET or device.type != "cuda":
        return USE_LIBDEVICE
    if not _WARNED_NO_LIBDEVICE:
        _WARNED_NO_LIBDEVICE = True
        warnings.warn(f"fp4rl.kernels.fused: triton.language.extra.libdevice did not import "
                      f"({_LIBDEVICE_ERROR}); SiLU uses tl.exp (approximate), so the fused SiLU * up can "
                      "differ from torch's in the last bits. A Triton with libdevice restores bit-equality.",
                      RuntimeWarning, stacklevel=3)
    return False


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)  # expf, as torch's CUDA SiLU (tl.exp is ex2.approx on NVIDIA)
    else:
        return tl.exp(x)


@triton.jit
def _bf16(v):
    """Round float32 to bfloat16 (RNE, as the GPU's cvt.rn and torch do) and back to float32. In integer
    arithmetic: the CPU interpreter's float -> bfloat16 cast truncates. NaN stays NaN."""
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v == v, r, v)


@triton.jit
def _combined(md_ptr, mpos_ptr, mw_ptr, row, cols, mask, stride_md, stride_mwt, stride_mwk,
              K_TOP: tl.constexpr):
    """moe_route.combine of one chunk of token `row`: bf16(sum_j w[row, j] * d[pos[row K_TOP + j]]) in fp32,
    j in order from 0.0 (as _combine_kernel: an all -0 sum is +0), each product rounded (no FMA)."""
    acc = tl.zeros(cols.shape, tl.float32)
    for j in tl.static_range(K_TOP):
        r = tl.load(mpos_ptr + row * K_TOP + j).to(tl.int64)
        w = tl.load(mw_ptr + row * stride_mwt + j * stride_mwk).to(tl.float32)
        acc += w * tl.load(md_ptr + r * stride_md + cols, mask=mask, other=0.0).to(tl.float32)
    return _bf16(acc)


@triton.jit
def _residual(x_ptr, h_ptr, row, cols, mask, stride_x, stride_h, HAS_RES: tl.constexpr,
              md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk,
              HAS_MOE: tl.constexpr, K_TOP: tl.constexpr):
    """x' of one chunk of a row, as float32: bf16(x + h); with HAS_MOE bf16(x + r), r = the MoE combine
    (bf16) or, with HAS_RES too, r = bf16(combine + h)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_MOE:
        r = _combined(md_ptr, mpos_ptr, mw_ptr, row, cols, mask, stride_md, stride_mwt, stride_mwk, K_TOP)
        if HAS_RES:
            h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            r = _bf16(r + h)
        x = _bf16(x + r)
    else:
        if HAS_RES:
            h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
            x = _bf16(x + h)
    return x


@triton.jit
def _normed(x_ptr, h_ptr, w_ptr, row, cols, mask, stride_x, stride_h, rstd, HAS_RES: tl.constexpr,
            md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk,
            HAS_MOE: tl.constexpr, K_TOP: tl.constexpr):
    """y = bf16(w * bf16(x' * rstd)) of one chunk (float32)."""
    xs = _residual(x_ptr, h_ptr, row, cols, mask, stride_x, stride_h, HAS_RES,
                   md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _bf16(w * _bf16(xs * rstd))


@triton.jit
def _pn_sumsq(x_ptr, h_ptr, row, K, stride_x, stride_h, HAS_RES: tl.constexpr,
              md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk,
              HAS_MOE: tl.constexpr, K_TOP: tl.constexpr):
    """The fp32 sum of squares of a row's x' as the CUDA PRENORM builds add it (fp4rl.kernels.prenorm.sumsq):
    8 warps x 32 lanes, lane l of warp w adds the 8 squares of its chunks c = l + 32 (w + 8 j), j ascending,
    elements in order (a [8, 32, 8] tile is 2048 consecutive columns: block j); then the warp's xor butterfly
    (pairs l, l + 16, then l, l + 8, ...) and the 8 warps' sums in warp order."""
    wi = tl.arange(0, 8)
    off = 8 * (tl.arange(0, 32)[None, :, None] + 32 * wi[:, None, None]) + tl.arange(0, 8)[None, None, :]
    acc = tl.zeros((8, 32), tl.float32)
    for c0 in range(0, K, 2048):
        cols = c0 + off
        xs = _residual(x_ptr, h_ptr, row, cols, cols < K, stride_x, stride_h, HAS_RES,
                       md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
        sq = xs * xs  # exact (bf16 values)
        ev, od = tl.split(tl.reshape(sq, (8, 32, 4, 2)))  # elements 2k, 2k + 1
        e04, e26 = tl.split(tl.reshape(ev, (8, 32, 2, 2)))  # 4p, 4p + 2
        e15, e37 = tl.split(tl.reshape(od, (8, 32, 2, 2)))  # 4p + 1, 4p + 3
        e0, e4 = tl.split(e04)
        e2, e6 = tl.split(e26)
        e1, e5 = tl.split(e15)
        e3, e7 = tl.split(e37)
        acc = acc + e0
        acc = acc + e1
        acc = acc + e2
        acc = acc + e3
        acc = acc + e4
        acc = acc + e5
        acc = acc + e6
        acc = acc + e7
    lo, hi = tl.split(tl.permute(tl.reshape(acc, (8, 2, 16)), (0, 2, 1)))  # lanes l, l + 16
    v = lo + hi
    lo, hi = tl.split(tl.permute(tl.reshape(v, (8, 2, 8)), (0, 2, 1)))
    v = lo + hi
    lo, hi = tl.split(tl.permute(tl.reshape(v, (8, 2, 4)), (0, 2, 1)))
    v = lo + hi
    lo, hi = tl.split(tl.permute(tl.reshape(v, (8, 2, 2)), (0, 2, 1)))
    v = lo + hi
    lo, hi = tl.split(v)  # [8]: each warp's sum
    part = lo + hi
    tot = tl.sum(tl.where(wi == 0, part, 0.0), 0)
    for w in tl.static_range(1, 8):
        tot = tot + tl.sum(tl.where(wi == w, part, 0.0), 0)
    return tot


@triton.jit
def _pn_rstd(x_ptr, h_ptr, row, K, stride_x, stride_h, inv_k, eps, HAS_RES: tl.constexpr,
             md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk,
             HAS_MOE: tl.constexpr, K_TOP: tl.constexpr):
    """rstd of a row as the CUDA PRENORM builds compute it: _pn_sumsq, then IEEE sqrt and division."""
    tot = _pn_sumsq(x_ptr, h_ptr, row, K, stride_x, stride_h, HAS_RES,
                    md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tot * inv_k + eps))


@triton.jit
def _silu_up(gu_ptr, row, cols, mask, stride_gu, I, LIBDEVICE: tl.constexpr):
    """y = bf16(bf16(silu(g)) * u) of one chunk (float32); g, u: columns [0, I) and [I, 2I)."""
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = _bf16(tl.math.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)))
    return _bf16(s * u)


@triton.jit
def _row_globals(amax_bits, N: tl.constexpr, RULE46: tl.constexpr):
    """(s_enc, s_dec, g, amax) [N] of a row from its amax bit pattern (per-token scale)."""
    amax = tl.zeros((N,), tl.float32) + amax_bits.to(tl.float32, bitcast=True)
    s_enc, s_dec, g = _global_from_amax(amax, RULE46, 1)
    return s_enc, s_dec, g, amax


@triton.jit
def _quantize_chunk(y, row, c0, K, d_ptr, s_ptr, s_enc, s_dec, g, amax,
                    QBC: tl.constexpr, RULE46: tl.constexpr, MAE: tl.constexpr):
    """Quantize columns [c0, c0 + QBC) of a row (y float32 [QBC], K % 16 == 0) into data/scales."""
    NB: tl.constexpr = QBC // 16
    xb = tl.reshape(y, (NB, 16))
    codes, s = _quantize_blocks(xb, s_enc, s_dec, g, amax, NB, False, RULE46, MAE, False)
    col = c0 // 16 + tl.arange(0, NB)
    nb_row = K // 16
    _store_blocks(d_ptr, s_ptr, row.to(tl.int64) * nb_row + col, col < nb_row, codes, s, NB)


@triton.jit
def _bits_max(acc, y):
    """Running max of |y|'s bit patterns over the finite values (the quantizer's amax, exact)."""
    bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.maximum(acc, tl.where(bits >= 0x7F800000, 0, bits))


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, h_ptr, w_ptr, xo_ptr, y_ptr, d_ptr, s_ptr, g_ptr, md_ptr, mpos_ptr, mw_ptr,
    K, stride_x, stride_h, stride_xo, stride_y, stride_md, stride_mwt, stride_mwk, inv_k, eps,
    HAS_RES: tl.constexpr, WRITE_Y: tl.constexpr, QUANT: tl.constexpr, RULE46: tl.constexpr,
    MAE: tl.constexpr, BC: tl.constexpr, QBC: tl.constexpr, CH: tl.constexpr, PDL: tl.constexpr,
    HAS_MOE: tl.constexpr, K_TOP: tl.constexpr, PN_ORDER: tl.constexpr,
):
    """Program (row, chunk): the row's statistics over the whole row (sum of x'^2; with QUANT the amax of
    y), then its own columns [chunk * CH, chunk * CH + CH) of x' = x + h (HAS_MOE: x + r, r the MoE
    combine [+ h], gathered again from the expert rows in every pass), y = RMSNorm(x') * w (if WRITE_Y) and
    Q(y) (if QUANT); chunk 0 stores the row's global scale. Every program reads x, h and the MoE inputs only
    (never xo or y), and the wrapper allocates xo apart from them, so no program reads what another writes."""
    if PDL:  # programmatic dependent launch: let the next kernel launch, then wait for our inputs
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PN_ORDER:  # the CUDA PRENORM builds' rstd (prenorm.reference's bits)
        rstd = _pn_rstd(x_ptr, h_ptr, row, K, stride_x, stride_h, inv_k, eps, HAS_RES,
                        md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
    else:
        acc = tl.zeros((BC,), tl.float32)
        for c0 in range(0, K, BC):  # the same loop in every program: the same rstd, bit for bit
            cols = c0 + tl.arange(0, BC)
            xs = _residual(x_ptr, h_ptr, row, cols, cols < K, stride_x, stride_h, HAS_RES,
                           md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
            acc += xs * xs
        rstd = tl.math.rsqrt(tl.sum(acc, 0) * inv_k + eps)
    if QUANT:
        amax_acc = tl.zeros((BC,), tl.int32)
        for c0 in range(0, K, BC):
            cols = c0 + tl.arange(0, BC)
            y = _normed(x_ptr, h_ptr, w_ptr, row, cols, cols < K, stride_x, stride_h, rstd, HAS_RES,
                        md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
            amax_acc = _bits_max(amax_acc, y)
        s_enc, s_dec, g, amax = _row_globals(tl.max(amax_acc, 0), QBC // 16, RULE46)
    for j0 in range(0, CH, QBC):
        c0 = chunk * CH + j0
        cols = c0 + tl.arange(0, QBC)
        mask = cols < K
        xs = _residual(x_ptr, h_ptr, row, cols, mask, stride_x, stride_h, HAS_RES,
                       md_ptr, mpos_ptr, mw_ptr, stride_md, stride_mwt, stride_mwk, HAS_MOE, K_TOP)
        if HAS_RES or HAS_MOE:
            tl.store(xo_ptr + row * stride_xo + cols, xs.to(xo_ptr.dtype.element_ty), mask=mask)
        if WRITE_Y or QUANT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = _bf16(w * _bf16(xs * rstd))  # _normed's arithmetic on the x' just loaded
            if WRITE_Y:
                tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
            if QUANT:
                _quantize_chunk(y, row, c0, K, d_ptr, s_ptr, s_enc, s_dec, g, amax, QBC, RULE46, MAE)
    if QUANT:
        j = tl.arange(0, QBC // 16)
        tl.store(g_ptr + row + j * 0, g, mask=j + chunk == 0)  # element 0 of chunk 0


@triton.jit
def _silu_mul_kernel(
    gu_ptr, y_ptr, d_ptr, s_ptr, g_ptr, I, stride_gu, stride_y,
    WRITE_Y: tl.constexpr, QUANT: tl.constexpr, RULE46: tl.constexpr, MAE: tl.constexpr,
    BC: tl.constexpr, QBC: tl.constexpr, CH: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, chunk). Without QUANT: its BC columns of y. With QUANT: the row's amax over the whole
    row, then its own columns [chunk * CH, chunk * CH + CH) of y (if WRITE_Y) and Q(y); chunk 0 stores
    the row's global scale. gu is only read, y and the codes only written: no program reads another's."""
    if PDL:  # programmatic dependent launch: let the next kernel launch, then wait for our inputs
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if QUANT:
        amax_acc = tl.zeros((BC,), tl.int32)
        for c0 in range(0, I, BC):
            cols = c0 + tl.arange(0, BC)
            y = _silu_up(gu_ptr, row, cols, cols < I, stride_gu, I, LIBDEVICE)
            amax_acc = _bits_max(amax_acc, y)
        s_enc, s_dec, g, amax = _row_globals(tl.max(amax_acc, 0), QBC // 16, RULE46)
        for j0 in range(0, CH, QBC):
            c0 = chunk * CH + j0
            cols = c0 + tl.arange(0, QBC)
            mask = cols < I
            y = _silu_up(gu_ptr, row, cols, mask, stride_gu, I, LIBDEVICE)
            if WRITE_Y:
                tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
            _quantize_chunk(y, row, c0, I, d_ptr, s_ptr, s_enc, s_dec, g, amax, QBC, RULE46, MAE)
        j = tl.arange(0, QBC // 16)
        tl.store(g_ptr + row + j * 0, g, mask=j + chunk == 0)  # element 0 of chunk 0
    else:
        cols = chunk * BC + tl.arange(0, BC)
        mask = cols < I
        y = _silu_up(gu_ptr, row, cols, mask, stride_gu, I, LIBDEVICE)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# host side


def _quant_flags(quant: dict | None):
    if quant is None:
        return False, False
    rule, err = quant.get("scale_rule", "6"), quant.get("err", "mse")
    if rule not in ("6", "4/6") or err not in ("mse", "mae"):
        raise ValueError(f"fused quantize: scale_rule={rule!r} err={err!r}; use '6' or '4/6', 'mse' or 'mae'")
    return rule == "4/6", err == "mae"


def _quant_out(r: int, k: int, device):
    if k % 16:
        raise ValueError(f"fused quantize needs a row length that is a multiple of 16, got {k}")
    return (torch.empty(r, k // 2, dtype=torch.uint8, device=device),
            torch.empty(r, k // 16, dtype=torch.uint8, device=device),
            torch.empty(r, dtype=torch.float32, device=device))


def _qbc(k: int, rule46: bool, block: int | None) -> int:
    if block is not None:
        return block
    if INTERPRET:
        return max(16, min(512, triton.next_power_of_2(k)))
    return max(16, min(1024 if rule46 else 2048, triton.next_power_of_2(k)))


# The quantizing kernels split each row over several programs (grid (rows, chunks)), each recomputing the
# row's statistics over the whole row (8-48 KB, in L2) and writing its own chunk of columns. Default
# chunk: SPLIT_PER_ROW programs per row at small batch (Qwen3-8B at batch 1: 12288 columns -> 12 programs
# of 1024, 4096 -> 8 of 512), fewer as rows grow (about SPLIT_PROGRAMS programs in all: the redundant
# statistics passes cost compute once the rows alone fill the GPU), never under SPLIT_MIN_COLS columns.
SPLIT_PER_ROW = 12
SPLIT_PROGRAMS = 192
SPLIT_MIN_COLS = 256


def _chunk(k: int, r: int, tile: int, chunk: int | None) -> tuple[int, int]:
    """(columns per program, tile width of its loop): `chunk` if given (a multiple of 16), else the default
    above (a power of two); the tile is `tile` cut to the largest power of two dividing the chunk."""
    if chunk is None:
        per_row = max(1, min(SPLIT_PER_ROW, SPLIT_PROGRAMS // max(r, 1)))
        chunk = max(SPLIT_MIN_COLS, triton.next_power_of_2(triton.cdiv(k, per_row)))
        chunk = min(chunk, max(16, triton.next_power_of_2(k)))
    elif chunk <= 0 or chunk % 16:
        raise ValueError(f"fused: chunk must be a positive multiple of 16 columns, got {chunk}")
    return chunk, min(tile, chunk & -chunk)


def _launch_opts(device: torch.device) -> dict:
    """The PDL constexpr and, only when it is on, Triton's launch_pdl option (fp4rl.kernels.pdl decides:
    a CUDA device of compute capability >= 9, a Triton with griddepcontrol, PDL not switched off). Both
    are part of the compiled variant's key."""
    return {"PDL": True, "launch_pdl": True} if pdl.triton_flag(device) else {"PDL": False}


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.ndim != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor [rows, K] with unit column stride, got "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return t


def _moe_args(moe, x: torch.Tensor):
    """Check add_rmsnorm's moe = (d [T k, H] bf16, pos [T k] int32, w [T, k] bf16/fp32) against x [T, H];
    returns (d, pos, w, k)."""
    if not isinstance(moe, (tuple, list)) or len(moe) != 3:
        raise ValueError("add_rmsnorm: moe must be the tuple (d, pos, w) of moe_route.combine: d [T k, H] "
                         "the expert outputs in sorted-row order, pos [T k] int32 (route's), w [T, k]")
    d, pos, w = moe
    t, hdim = x.shape
    for name, v in (("d", d), ("pos", pos), ("w", w)):
        if not isinstance(v, torch.Tensor) or v.device != x.device:
            raise ValueError(f"add_rmsnorm: moe {name} must be a tensor on x's device {x.device}, got "
                             f"{v.device if isinstance(v, torch.Tensor) else type(v).__name__}")
    if w.ndim != 2 or w.shape[0] != t or w.shape[1] < 1:
        raise ValueError(f"add_rmsnorm: moe w must be [T, k] with T = {t} (x's rows, one token each) and "
                         f"k >= 1, got {tuple(w.shape)}; pass route's topk_weight of these tokens")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"add_rmsnorm: moe w must be bfloat16 or float32, got {w.dtype}; pass route's "
                         "topk_weight (or .float() it)")
    k = w.shape[1]
    if d.ndim != 2 or d.shape[0] != t * k or d.shape[1] != hdim:
        raise ValueError(f"add_rmsnorm: moe d must be [T k, H] = [{t} x {k}, {hdim}] (k from w, T and H "
                         f"from x), got {tuple(d.shape)}; pass the routed experts' down projection of x's "
                         "tokens")
    if d.dtype != torch.bfloat16:
        raise ValueError(f"add_rmsnorm: moe d must be bfloat16 (the combine rounds to it), got {d.dtype}")
    if d.stride(-1) != 1:
        raise ValueError(f"add_rmsnorm: moe d needs unit column stride, got strides {d.stride()}; pass "
                         "d.contiguous()")
    if pos.dtype != torch.int32 or pos.numel() != t * k or not pos.is_contiguous():
        raise ValueError(f"add_rmsnorm: moe pos must be a contiguous int32 [T k = {t * k}] tensor (route's "
                         f"pos: the sorted row of each (token, slot) pair), got {pos.dtype} "
                         f"{tuple(pos.shape)} strides {pos.stride()}")
    return d, pos, w, k


def add_rmsnorm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                quant: dict | None = None, write_y: bool = True, block: int | None = None,
                chunk: int | None = None, moe: tuple | None = None, prenorm_order: bool = False):
    """x' = x + h (h None: x' = x) and y = RMSNorm(x') * weight, x/h [R, K]; with quant (the activation
    quantizer's scale_rule/err) also Q(y) per row. Returns (x', y or None, (data, block_scale,
    global_scale [R]) or None). block: the tile width of the kernel's loops (tests; default from K);
    chunk: the columns each program writes (a multiple of 16; default: see SPLIT_PER_ROW). x' is a new
    tensor (never x: every program reads all of x's row), or x itself when h and moe are None.

    moe = (d [R k, K] bf16, pos [R k] int32, w [R, k] bf16 or fp32) folds moe_route.combine into the residual:
    x' = x + r with r = combine(d, pos, w) (bf16, combine's bits) or, with h too, r = bf16(combine + h) (a
    shared expert's term); the same bits as add_rmsnorm(x, combine(d, pos, w) [+ h], ...) in one launch.

    prenorm_order: rstd as the CUDA PRENORM builds compute it (the sum of squares in
    fp4rl.kernels.prenorm.sumsq's order, IEEE sqrt and division): x' and y are then prenorm.reference's bits,
    so a step that folds some of its norms into those builds (gpu_decode's ROUTER_NORM / DENSE_NORM) gives the
    same bits wherever a norm runs here instead (the buckets those builds do not take)."""
    _rows(x, "x")
    if h is not None:
        _rows(h, "h")
        if h.shape != x.shape:
            raise ValueError(f"add_rmsnorm: h {tuple(h.shape)} != x {tuple(x.shape)}")
    r, k = x.shape
    if weight.numel() != k or not weight.is_contiguous() or weight.device != x.device:
        raise ValueError(f"add_rmsnorm: weight must be the norm's contiguous [{k}] vector on {x.device} (one "
                         f"per column of x), got {tuple(weight.shape)} on {weight.device}; pass the RMSNorm "
                         "of this width")
    if moe is not None:
        md, mpos, mw, k_top = _moe_args(moe, x)
        moe_strides = (md.stride(0), mw.stride(0), mw.stride(1))
    else:
        md, mpos, mw, k_top = x, x, x, 1
        moe_strides = (0, 0, 0)
    rule46, mae = _quant_flags(quant)
    xo = torch.empty_like(x) if (h is not None or moe is not None) else x
    y = torch.empty_like(x) if (write_y or quant is None) else x
    xq = _quant_out(r, k, x.device) if quant is not None else None
    bc = block or max(16, min(4096, triton.next_power_of_2(k)))  # the statistics' tile (fixes the sum order)
    ch, qbc = _chunk(k, r, _qbc(k, rule46, block), chunk)
    d, s, g = xq if xq is not None else (x, x, x)
    if r:
        COMPILED["fused add_rmsnorm"] = _add_rmsnorm_kernel[(r, triton.cdiv(k, ch))](
            x, h if h is not None else x, weight, xo, y, d, s, g, md, mpos, mw,
            k, x.stride(0), h.stride(0) if h is not None else 0, xo.stride(0), y.stride(0), *moe_strides,
            1.0 / k, eps,
            HAS_RES=h is not None, WRITE_Y=write_y or quant is None, QUANT=quant is not None,
            RULE46=rule46, MAE=mae, BC=bc, QBC=qbc, CH=ch, HAS_MOE=moe is not None, K_TOP=k_top,
            PN_ORDER=bool(prenorm_order),
            num_warps=4 if k <= 4096 else 8, enable_fp_fusion=False, **_launch_opts(x.device))
    if xq is not None:
        xq = (xq[0], xq[1].view(torch.float8_e4m3fn), xq[2])
    return xo, (y if write_y or quant is None else None), xq


def silu_mul(gu: torch.Tensor, *, quant: dict | None = None, write_y: bool = True, block: int | None = None,
             chunk: int | None = None):
    """y = silu(gate) * up for gu [R, 2I] = (gate | up); with quant also Q(y) per row. Returns
    (y [R, I] or None, (data, block_scale, global_scale [R]) or None). block: the tile width (tests);
    chunk: the columns each quantizing program writes (a multiple of 16; default: see SPLIT_PER_ROW;
    without quant each program writes one tile)."""
    _rows(gu, "gu")
    r, i2 = gu.shape
    if i2 % 2:
        raise ValueError(f"silu_mul: gu must be [R, 2I], got {tuple(gu.shape)}")
    i = i2 // 2
    rule46, mae = _quant_flags(quant)
    write_y = write_y or quant is None
    y = torch.empty(r, i, dtype=gu.dtype, device=gu.device) if write_y else gu
    xq = _quant_out(r, i, gu.device) if quant is not None else None
    d, s, g = xq if xq is not None else (gu, gu, gu)
    bc = block or (max(16, min(2048, triton.next_power_of_2(i))) if quant is not None
                   else max(16, min(1024, triton.next_power_of_2(i))))
    if quant is not None:
        ch, qbc = _chunk(i, r, _qbc(i, rule46, block), chunk)
    else:
        ch, qbc = bc, bc  # one tile of y per program
    if r:
        COMPILED["fused silu_mul"] = _silu_mul_kernel[(r, triton.cdiv(i, ch))](
            gu, y, d, s, g, i, gu.stride(0), y.stride(0),
            WRITE_Y=write_y, QUANT=quant is not None, RULE46=rule46, MAE=mae, BC=bc, QBC=qbc, CH=ch,
            LIBDEVICE=_libdevice_for(gu.device), num_warps=4 if quant is None or i <= 4096 else 8,
            enable_fp_fusion=False, **_launch_opts(gu.device))
    if xq is not None:
        xq = (xq[0], xq[1].view(torch.float8_e4m3fn), xq[2])
    return (y if write_y else None), xq


# q/k-norm + RoPE + KV write lives in its own module (it uses the helpers above)
from fp4rl.kernels.fused_rope import fp4_cache_fits, qk_norm_rope  # noqa: E402, F401
