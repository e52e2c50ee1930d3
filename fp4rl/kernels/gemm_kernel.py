"""The Triton kernel of fp4rl.kernels.gemm (``_w4_gemm_kernel``), its launcher and its split-K workspace.

One kernel body, chosen by compile-time flags (SWAP decode, tiled prefill, GROUPED experts, XQ W4A4
emulation), computes y = x @ DQ(W).T on packed NVFP4 weights with the arithmetic that fp4rl.kernels.gemm's
docstring specifies. ``_launch`` runs it with one configuration (a dict from gemm_tune.candidate_configs);
``_WORKSPACE`` holds the split-K partials and per-tile counters (also lent to the Gluon GEMV, see
gemm.gemm), the only state here, and fp4rl.kernels.gemm re-exports it as ``gemm._WORKSPACE``.

This is device code and the one call that launches it: what runs on the GPU is one idea, the host-side
choice of what to run (argument checks, the mma16 / Gluon / Triton / cuBLAS dispatch, candidate
configurations and the tuner with its caches, fp4rl.kernels.gemm) another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import (
    ASM,
    COMPILED,
    INTERPRET,
    dot_acc,
    load_unpacked,
    with_asm_fallback,
)
from fp4rl.kernels.dequantize import _u8


@triton.jit
def _w4_gemm_kernel(
    x_ptr, xs_ptr, xg_ptr,  # x: bf16 [M, K], or (XQ) packed uint8 [M, K/2] + E4M3 bits [M, K/16] + fp32 [M]
    w_ptr, ws_ptr, wg_ptr,  # W: uint8 [E, N, K/2], E4M3 bits [E, N, K/16], fp32 [E] or [E, N]
    y_ptr, part_ptr, lock_ptr, offs_ptr,  # y [M, N]; split-K workspace; expert offsets int32 [E+1]
    M, N, K, KH, E,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_wge, stride_ym,
    GROUPED: tl.constexpr, XQ: tl.constexpr, WG_ROW: tl.constexpr, SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    USE_ASM: tl.constexpr, INTERP: tl.constexpr, EVEN: tl.constexpr, E_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BKH: tl.constexpr = BK // 2

    if GROUPED:  # which expert's token tile is program pid_m? one vector pass over the offsets
        e_idx = tl.arange(0, E_PAD)
        e_lo = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
        e_hi = tl.load(offs_ptr + e_idx + 1, mask=e_idx < E, other=0)
        n_tiles = tl.cdiv(e_hi - e_lo, BM)  # [E_PAD], 0 for an expert without tokens
        ends = tl.cumsum(n_tiles, 0)
        starts = ends - n_tiles
        hit = (pid_m >= starts) & (pid_m < ends)
        expert = tl.max(tl.where(hit, e_idx, -1), 0)
        m_lo = tl.sum(tl.where(hit, e_lo + (pid_m - starts) * BM, 0), 0)
        m_hi = tl.sum(tl.where(hit, e_hi, 0), 0)
        active = expert >= 0
        expert = tl.maximum(expert, 0)
    else:
        expert = pid_m * 0
        m_lo = pid_m * BM
        m_hi = M
        active = True

    if active:
        rows_m = m_lo + tl.arange(0, BM)  # [BM]
        mask_m = rows_m < m_hi
        rows_n = pid_n * BN + tl.arange(0, BN)  # [BN]
        mask_n = rows_n < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        ws_base = ws_ptr + expert.to(tl.int64) * stride_wse

        kh_per = tl.cdiv(tl.cdiv(KH, SPLIT_K), BKH) * BKH  # bytes of K per split
        kb_lo = pid_k * kh_per
        kb_hi = tl.minimum(KH, kb_lo + kh_per)
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb0 in range(kb_lo, kb_hi, BKH):
            w_lo, w_hi = load_unpacked(w_base, ws_base, rows_n, mask_n, kb0, KH, stride_wn, stride_wsn,
                                       BN, BKH, USE_ASM, EVEN)  # [BN, BKH] each: even / odd k
            if XQ:
                x_lo, x_hi = load_unpacked(x_ptr, xs_ptr, rows_m, mask_m, kb0, KH, stride_xm, stride_xsm,
                                           BM, BKH, USE_ASM)  # [BM, BKH]
            else:
                k = 2 * kb0 + tl.arange(0, BK)
                xt = tl.load(x_ptr + rows_m[:, None] * stride_xm + k[None, :],
                             mask=mask_m[:, None] & (k[None, :] < K), other=0.0)  # [BM, BK]
            if BM <= 2:  # 1-2 rows: CUDA-core FMAs, no tensor cores and no shared-memory staging
                if not XQ:
                    x_lo, x_hi = tl.split(tl.reshape(xt, (BM, BKH, 2)))
                wl = w_lo.to(tl.float32)
                wh = w_hi.to(tl.float32)
                if BM == 1:
                    xl0 = tl.reshape(x_lo, (BKH,)).to(tl.float32)
                    xh0 = tl.reshape(x_hi, (BKH,)).to(tl.float32)
                    acc += tl.reshape(tl.sum(wl * xl0[None, :] + wh * xh0[None, :], 1), (BN, 1))
                else:
                    xl0, xl1 = tl.split(tl.trans(x_lo.to(tl.float32)))  # [BKH] rows 0 and 1
                    xh0, xh1 = tl.split(tl.trans(x_hi.to(tl.float32)))
                    p0 = tl.sum(wl * xl0[None, :] + wh * xh0[None, :], 1)  # [BN]
                    p1 = tl.sum(wl * xl1[None, :] + wh * xh1[None, :], 1)
                    acc += tl.join(p0, p1)  # [BN, 2]
            elif BM <= 32:  # few rows: split x into even / odd k (cheap) and do two MMAs
                if not XQ:
                    x_lo, x_hi = tl.split(tl.reshape(xt, (BM, BKH, 2)))
                if SWAP:
                    acc = dot_acc(w_lo, tl.trans(x_lo), acc, INTERP)
                    acc = dot_acc(w_hi, tl.trans(x_hi), acc, INTERP)
                else:
                    acc = dot_acc(x_lo, tl.trans(w_lo), acc, INTERP)
                    acc = dot_acc(x_hi, tl.trans(w_hi), acc, INTERP)
            else:  # many rows: interleave W back to natural k order instead, x goes to the MMA as is
                wt = tl.reshape(tl.join(w_lo, w_hi), (BN, BK))
                if XQ:
                    xt = tl.reshape(tl.join(x_lo, x_hi), (BM, BK))
                if SWAP:
                    acc = dot_acc(wt, tl.trans(xt), acc, INTERP)
                else:
                    acc = dot_acc(xt, tl.trans(wt), acc, INTERP)

        if SWAP:
            idx = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
        else:
            idx = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        last = True
        if SPLIT_K > 1:  # publish this split's partial; the last split of the tile reduces
            tile = pid_m * tl.num_programs(1) + pid_n
            tl.store(part_ptr + (tile * SPLIT_K + pid_k) * (BM * BN) + idx, acc, cache_modifier=".cg")
            tl.debug_barrier()
            done = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = done == SPLIT_K - 1
            if last:  # sum all splits in split order, whichever finished last: bitwise reproducible
                acc = tl.load(part_ptr + (tile * SPLIT_K) * (BM * BN) + idx, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    acc += tl.load(part_ptr + (tile * SPLIT_K + s) * (BM * BN) + idx, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next call
        if last:
            if WG_ROW:
                g_w = tl.load(wg_ptr + expert * stride_wge + rows_n, mask=mask_n, other=0.0)  # [BN]
            else:
                g_w = tl.load(wg_ptr + expert * stride_wge)
            if XQ:
                g_x = tl.load(xg_ptr + rows_m, mask=mask_m, other=0.0)  # [BM]
            if SWAP:
                if WG_ROW:
                    acc = acc * g_w[:, None]
                else:
                    acc = acc * g_w
                if XQ:
                    acc = acc * g_x[None, :]
                ptrs = y_ptr + rows_m[None, :] * stride_ym + rows_n[:, None]
                tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])
            else:
                if WG_ROW:
                    acc = acc * g_w[None, :]
                else:
                    acc = acc * g_w
                if XQ:
                    acc = acc * g_x[:, None]
                ptrs = y_ptr + rows_m[:, None] * stride_ym + rows_n[None, :]
                tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class _Workspace:
    """Split-K partials and per-tile counters, one set per device. The counters return to zero
    after every call, so the buffers are reused (and CUDA-graph safe) on one stream."""

    def __init__(self):
        self.part: dict[torch.device, torch.Tensor] = {}
        self.lock: dict[torch.device, torch.Tensor] = {}

    def get(self, device, n_part: int, n_lock: int):
        p, k = self.part.get(device), self.lock.get(device)
        if p is None or p.numel() < n_part:
            p = self.part[device] = torch.empty(max(n_part, 1 << 20), dtype=torch.float32, device=device)
        if k is None or k.numel() < n_lock:
            k = self.lock[device] = torch.zeros(max(n_lock, 4096), dtype=torch.int32, device=device)
        return p, k


_WORKSPACE = _Workspace()


@with_asm_fallback
def _launch(x, xq, wd, ws, wg, y, cfg, offsets=None):
    """Run the fused kernel with one configuration. x bf16 [M, K] or xq=(data, scale, g)."""
    e, n, kh = wd.shape
    m = y.shape[0]
    k = xq[0].shape[1] * 2 if xq is not None else x.shape[1]
    bm, bn, bk, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT_K"]
    grouped = offsets is not None
    m_tiles = triton.cdiv(m, bm) + (e if grouped else 0)
    grid = (m_tiles, triton.cdiv(n, bn), split)
    part, lock = _WORKSPACE.get(y.device, m_tiles * grid[1] * split * bm * bn if split > 1 else 0,
                                m_tiles * grid[1])
    if xq is not None:
        xd, xs, xg = xq
        x_args = (xd, _u8(xs), xg)
        stride_xm, stride_xsm = xd.stride(0), xs.stride(0)
    else:
        x_args = (x, x, x)
        stride_xm, stride_xsm = x.stride(0), 0
    name = "w4_gemm " + ("decode" if cfg["SWAP"] else "prefill") + (" grouped" if grouped else "") + (
        " w4a4" if xq is not None else "")
    COMPILED[name] = _w4_gemm_kernel[grid](
        *x_args, wd, ws, wg, y, part, lock, offsets if grouped else lock,
        m, n, k, kh, e,
        stride_xm, stride_xsm, wd.stride(0), wd.stride(1), ws.stride(0), ws.stride(1),
        wg.stride(0), y.stride(0),
        GROUPED=grouped, XQ=xq is not None, WG_ROW=wg.ndim == 2, SWAP=cfg["SWAP"], SPLIT_K=split,
        BM=bm, BN=bn, BK=bk, USE_ASM=ASM["on"], INTERP=INTERPRET,
        EVEN=n % bn == 0 and kh % (bk // 2) == 0, E_PAD=triton.next_power_of_2(e + 1),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
