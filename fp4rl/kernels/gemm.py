"""W4A16 and W4A4-emulation GEMMs on packed NVFP4 weights: y = x @ DQ(W).T, dequantized in registers.

Hopper has no FP4 tensor cores, so the win is bytes: a weight streams as 0.5625 B/element
instead of 2 (3.56x less), and is turned into bfloat16 only in registers. One kernel body
serves four uses, chosen by compile-time flags:

- decode (``SWAP``, 1..64 rows): purely memory bound. The product is computed transposed,
  y.T[N, M] = W[N, K] @ x.T[K, M], so the weight fills the MMA's large dimension and the few
  rows of x its small one (padded to 16). Split-K over a grid of (N tiles, K splits) keeps
  every multiprocessor streaming weights; the last program to finish a tile (an atomic
  counter per tile) adds all FP32 partials in split order (so the sum does not depend on which
  program finished last: run-to-run and graph-vs-eager identical) and writes y, in one launch.
- prefill (many rows): ordinary tiled MMA, bfloat16 operands after dequantization.
- grouped (``GROUPED``): routed MoE experts, weights [E, N, K/2], tokens sorted by expert
  with offsets [E+1]; program (m tile, n tile) finds its expert by walking the offsets, and
  an expert with no tokens costs nothing (its weights are never read).
- W4A4 emulation (``XQ``): x is itself packed NVFP4 (per-token global scale, from
  fp4rl.kernels.quantize) and is dequantized in registers like W.

Arithmetic (the same in every path): each K element contributes
x * (e2m1 * block_scale), where e2m1 * block_scale is exact in bfloat16 (see _common), with an
FP32 accumulator; the FP32 global scale(s) multiply the accumulator once at the end:
y = (sum_k x_k * (e2m1_k * s_k)) * g_w (* g_x for W4A4). This is Blackwell's block-scaled MMA
arithmetic; against the reference dequantize (which rounds (e2m1 * s) * g to bfloat16 per
element before a bfloat16 matmul) it differs by bfloat16 rounding, i.e. within bfloat16 GEMM
tolerance, and it spends no instruction per element on g.

Dispatch (``linear``): for each (rows bucket, N, K) the candidates are timed once on the GPU
(``tune``; call once before CUDA-graph capture) and the fastest is kept: the transposed kernel
(rows <= 256: the weights are unpacked exactly once per call when the rows fit one tile), the
tiled prefill kernel (rows > 32), and for rows > 64 a dequantize-then-cuBLAS path (a bf16 copy
of W made per call: 2.56 B/element of extra traffic, small next to an M x N x K GEMM once M is
in the thousands). Nothing is assumed about where the crossovers lie. A dense weight carrying the
CUDA kernel's copy (``mma16``) goes to that kernel at 1-16 rows and the rows of ``wide_rows``, and
offers its wgmma configuration as the tuner's first candidate (``WIDE``) up to 512 rows. A weight carrying
``dense`` (its DQ(W) in bfloat16, the reference dequantize, kept by the caller; [E, N, K] for grouped experts)
offers cuBLAS on it (``DENSE``: the BF16 engine's GEMM on the quantized weight's values, the reference's
arithmetic; ``torch._grouped_mm`` for experts) as the first candidate, in place of FALLBACK: timed against the
4-bit kernels when tuning, taken when not (the sampler passes it for calls of at least
``Sampler(dense_rows=...)`` rows).

This module is the host side (argument checks, dispatch); the tuner and its candidate configurations are
fp4rl.kernels.gemm_tune, the kernel itself, its launcher and its split-K workspace fp4rl.kernels.gemm_kernel.
"""

from __future__ import annotations

import os
import warnings

import torch

from fp4rl.kernels import fused as _fused
from fp4rl.kernels import gemm_tune as _tune
from fp4rl.kernels import gemv as _gemv
from fp4rl.kernels import gemv_cuda as _mma16
from fp4rl.kernels import gemv_cuda_grouped as _mma16_grouped
from fp4rl.kernels.dequantize import _u8, dequantize  # noqa: F401  (gemm.dequantize: part of this API)
from fp4rl.kernels.gemm_kernel import (  # noqa: F401  (the kernel; gemm._WORKSPACE: one object, re-exported)
    _WORKSPACE,
    _launch,
    _w4_gemm_kernel,
    _Workspace,
)

# Rows up to this go to the CUDA mma16 kernel when the weight carries its copy (weight.mma16): on the
# H200 1.4-2.2x cuBLAS BF16 at 1-8 rows and 1.1-1.4x at 16 (bench/RESULTS.md); 32-64 rows measured slower
# than cuBLAS, so they stay with the tuned Triton kernels.
MMA16_MAX_ROWS = 16
# Routed experts go to the grouped mma16 kernel (chunks of 8, 16 or 32 rows by the average rows per expert,
# gemv_cuda_grouped.grouped_mg; each chunk streams its expert's weights) while their sorted rows average at
# most this many per expert (rows <= this x E), else to the Triton grouped GEMM, which reads each expert's
# weights once.
# On an H200 (bench/RESULTS.md, twenty-second and twenty-third sessions): Qwen3-30B-A3B (128 experts, top 8)
# decodes 1.75x / 1.46x / 1.11x BF16 at batch 128 / 256 / 512 (8 / 16 / 32 rows per expert), against 0.97x /
# 0.95x / 0.95x with the Triton grouped GEMM. FP4RL_MMA16_GROUPED_ROWS=<rows per expert>: another bound.
MMA16_GROUPED_ROWS_PER_EXPERT = int(os.environ.get("FP4RL_MMA16_GROUPED_ROWS", "32"))
# The kernel's wgmma configuration (gemv_cuda.choose_wide) takes 17-32 rows, and 33-64 rows of weights with
# N >= WIDE_MIN_N_ABOVE_32, on sm_90 when the weight carries its mma16 copy: where it beat the tuned Triton
# kernels on the H200 (bench/RESULTS.md, sixth session: 1.02-1.37x cuBLAS BF16 at 32 rows).
WIDE_MAX_ROWS = 64
WIDE_MIN_N_ABOVE_32 = 8192
# gemm(silu=True) on the grouped mma16 kernel: SiLU(gate) * up computed by the kernel's x staging (its SILU
# build) instead of a fused.silu_mul launch first (the same bits), up to MMA16_SILU_MAX_TOKENS tokens: every
# n-block's CTA computes its rows' SiLU again, which outweighs the saved launch from 16 tokens on (H200,
# Qwen3-30B-A3B's down_proj: 8.16 -> 6.02 us at 1 token, 26.6 -> 28.2 at 16; bench/RESULTS.md, eleventh
# session). FP4RL_MOE_SILU=0: silu_mul first, always (A/B); also switched off if the SILU build fails.
FUSED_SILU = os.environ.get("FP4RL_MOE_SILU", "1") != "0"
MMA16_SILU_MAX_TOKENS = 8
# gemm(silu_out=True) (the dense MLP's gate | up): SiLU(gate) * up computed by the mma16 launch's epilogue
# (gemv_cuda GU_SILU) where its configuration takes it (gemv_cuda.gu_silu_ok: every mma.sync and wgmma
# configuration the Qwen3 gate | up shapes get at 1-64 rows), instead of a fused.silu_mul launch after it (the
# same bits). FP4RL_GU_SILU=0: silu_mul after the GEMM, always (A/B); also switched off if the build fails.
FUSED_GU_SILU = os.environ.get("FP4RL_GU_SILU", "1") != "0"

# The other rows up to WIDE_TUNE_MAX_ROWS (33-64 on narrower weights, 65-512) offer the wgmma configuration to
# the tuner as its first candidate (gemm_tune.WIDE; taken untimed when tuning is off): with one running x
# pointer per thread (XPRE 2) it beat the tuned Triton kernels there on the H200 (bench/RESULTS.md,
# nineteenth session).
WIDE_TUNE_MAX_ROWS = 512


def wide_rows(m: int, n: int) -> bool:
    """Whether m rows of an N-row weight take the wgmma configuration (given the mma16 copy and sm_90)."""
    return MMA16_MAX_ROWS < m <= WIDE_MAX_ROWS and (m <= 32 or n >= WIDE_MIN_N_ABOVE_32)


def wide_candidate(m: int, n: int) -> bool:
    """Whether m rows of an N-row weight offer the wgmma configuration to the tuner (WIDE, first)."""
    return MMA16_MAX_ROWS < m <= WIDE_TUNE_MAX_ROWS and not wide_rows(m, n)


def _weight_parts(weight, grouped: bool):
    """(data uint8 [E, N, KH], scale uint8 [E, N, K/16], global fp32 [E] or [E, N]) of an
    NVFP4 weight (anything with .data, .block_scale, .global_scale)."""
    data, scale, g = weight.data, weight.block_scale, weight.global_scale
    if data.dtype != torch.uint8 or scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(
            f"weight must hold uint8 data and float8_e4m3fn block scales, got {data.dtype}, {scale.dtype}"
        )
    want = 3 if grouped else 2
    if data.ndim != want or scale.shape[:-1] != data.shape[:-1] or scale.shape[-1] * 8 != data.shape[-1]:
        raise ValueError(
            f"weight.data must be [{'E, ' if grouped else ''}N, K/2] with block_scale [..., K/16]; got "
            f"{tuple(data.shape)} and {tuple(scale.shape)}"
        )
    if not grouped:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, n, _ = data.shape
    g = g.float().reshape(-1)
    if g.numel() == e:
        g = g.reshape(e)
    elif g.numel() == e * n:
        g = g.reshape(e, n)
    else:
        raise ValueError(f"weight.global_scale must have one value per {'expert' if grouped else 'tensor'} "
                         f"or per output row, got {g.numel()} values for data {tuple(weight.data.shape)}")
    return data.contiguous(), _u8(scale).contiguous(), g.contiguous()


def _check_x(x: torch.Tensor, k: int, name: str = "x") -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"{name} has K={x.shape[-1]} but the weight has K={k} (data is [N, K/2])")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16 for the W4A16 kernels, got {x.dtype}: pass x.bfloat16()")
    return x.reshape(-1, k).contiguous()


def _fallback(x2, xq, wd, ws, wg, y):
    """Reference dequantize to bfloat16 once per call, then cuBLAS."""
    w = dequantize(wd[0], ws[0], wg[0] if wg.ndim == 1 else wg[0], torch.bfloat16)  # [N, K]
    if xq is not None:
        x2 = dequantize(xq[0], xq[1], xq[2], torch.bfloat16)
    torch.matmul(x2, w.t(), out=y)
    return y


def _mma16_input(x2, xq):
    """(x, x_scale) for the CUDA mma16 kernel: W4A16's x as is; W4A4's x = e2m1 * block_scale (exact in bf16)
    with its per-row global scale, which the kernel applies to the FP32 sum with the weight's."""
    if x2 is not None:
        return x2, None
    return dequantize(xq[0], xq[1], xq[2], torch.bfloat16, apply_global=False), xq[2]


def _disable_fused_silu(exc: Exception) -> None:
    global FUSED_SILU
    FUSED_SILU = False
    warnings.warn(f"the grouped mma16 kernel's SILU build failed ({repr(exc)[:300]}); gemm(silu=True) runs "
                  "fused.silu_mul first from now on", stacklevel=3)


def _disable_fused_gu_silu(exc: Exception) -> None:
    global FUSED_GU_SILU
    FUSED_GU_SILU = False
    warnings.warn(f"the mma16 kernel's GU_SILU build failed ({repr(exc)[:300]}); gemm(silu_out=True) runs "
                  "fused.silu_mul after the GEMM from now on", stacklevel=3)


def _mma16_config(m: int, n: int, k: int, dense, device) -> dict | None:
    """The configuration gemm launches the CUDA mma16 kernel with (no config forced, the kernel available) for
    m rows of a dense N x K weight: gemv_cuda's plan for every row up to 16 where it fits (mma.sync; its wgmma
    build from 2 rows on sm_90a: gemv_cuda.choose_narrow), its wgmma configuration for the rows of wide_rows
    without a dense copy (with one the tuner weighs the two); else None."""
    if m <= MMA16_MAX_ROWS and _mma16.fits(n, k, m, _tune._sm_count(device)):
        return _mma16._plan(n, k, m, _mma16.cuda_index(device))
    if dense is None and wide_rows(m, n) and _mma16.wide_available(device) and _mma16.supports(n, k):
        return _mma16._plan_wide(n, k, m, _mma16.cuda_index(device))
    return None


def _gemm_silu_out(x, weight, tune: bool, config):
    """gemm(silu_out=True): the GU_SILU launch where gemm's own mma16 launch takes the call and its
    configuration has the epilogue, else fused.silu_mul(gemm(...))."""
    wd, _, wg = _weight_parts(weight, False)
    n, kh = wd.shape[1], wd.shape[2]
    if n % 2:
        raise ValueError(f"gemm: silu_out=True needs a fused gate | up weight of an even N, got N={n}")
    x2 = _check_x(x, 2 * kh)
    m16 = getattr(weight, "mma16", None)
    if (FUSED_GU_SILU and m16 is not None and config is None and _mma16.available(x2.device)
            and (m16.n, m16.k) == (n, 2 * kh)):
        m = x2.shape[0]
        cfg = _mma16_config(m, n, 2 * kh, getattr(weight, "dense", None), x2.device)
        if cfg is not None and _mma16.gu_silu_ok(cfg, n):
            y = torch.empty(m, n // 2, dtype=torch.bfloat16, device=x2.device)
            try:
                return _mma16.launch(x2, m16, wg[0] if wg.ndim == 2 else wg, y, cfg=cfg, silu_out=True)
            except RuntimeError as exc:  # NVRTC or the driver refused the GU_SILU build: silu_mul from now on
                _disable_fused_gu_silu(exc)
    return _fused.silu_mul(gemm(x2, weight, tune=tune, config=config))[0]


def gemm(x, weight, *, xq=None, offsets=None, tune: bool = True, config=None, tokens: int | None = None,
         rows=None, silu: bool = False, silu_out: bool = False):
    """Core entry: y [M, N] = x @ DQ(W).T on packed NVFP4 weights.

    x: bfloat16 [M, K] (W4A16), or None with xq = (data uint8 [M, K/2], block_scale [M, K/16],
    global_scale fp32 [M] or [M, 1]) for W4A4 emulation. weight: NVFP4 with data [N, K/2] (or
    [E, N, K/2] with offsets int32 [E+1] over the expert-sorted rows of x). config: a dict from
    gemm_tune.candidate_configs, gemm_tune.FALLBACK or gemm_tune.DENSE, to bypass the tuner. A weight may
    carry `dense` (its DQ(W), bfloat16 [N, K] or grouped [E, N, K], as `dequantize` makes it: DENSE, y = x @
    dense.T on cuBLAS, grouped torch._grouped_mm over offsets[1:] (offsets[0] must be 0), W4A4 with x =
    DQ(Q(x)), is then the tuner's first candidate, taken untuned, and replaces FALLBACK; grouped weights keep
    the grouped mma16 kernel where it is taken, below), a dense weight `gemv32` (gemv.swizzle of its data:
    the Gluon GEMV's copy) and/or `mma16` (gemv_cuda.relayout: the CUDA kernel's copy, taken for
    1-MMA16_MAX_ROWS rows of W4A16 or W4A4 when no config is forced, with or without `dense`, and for the rows
    of `wide_rows` with its wgmma configuration on sm_90, which with `dense` the tuner weighs against DENSE).
    Grouped weights may carry `mma16` too
    (gemv_cuda_grouped.relayout_stack): taken when the caller passes `tokens` (the batch's tokens before
    top-k) and the rows average at most MMA16_GROUPED_ROWS_PER_EXPERT per expert.
    rows: grouped W4A16 only, int32 [M]: x [T, K] holds the batch's tokens and sorted row r is x[rows[r]];
    the grouped mma16 kernel reads those rows itself, every other path gathers them first (same result).
    silu: W4A16 only: x is [M, 2K] = gate | up (gate in columns [0, K), up in [K, 2K), K the weight's) and
    y = silu_mul(x) @ DQ(W).T with silu_mul(x) = fused.silu_mul(x)[0] = bf16(bf16(silu(gate)) * up) (the MoE
    experts' down projection). The grouped mma16 kernel computes it while staging x (FUSED_SILU, tokens <=
    MMA16_SILU_MAX_TOKENS, not with rows); every other path runs fused.silu_mul first (the same bits). With
    rows, x [T, 2K] holds the tokens' gate | up (silu_mul, then the gather).
    silu_out: dense W4A16 only, the weight a fused gate | up [2I, K] (gate rows first): returns
    fused.silu_mul(y)[0] [M, I] = bf16(bf16(silu(y_gate)) * y_up), the dense MLP's input to its down
    projection. The mma16 launch (1-16 rows, and the rows of wide_rows without a dense copy) computes it in
    its epilogue where its configuration takes it (FUSED_GU_SILU, gemv_cuda.gu_silu_ok); every other path
    runs fused.silu_mul on y (the same bits).
    """
    if silu_out:
        if x is None or xq is not None or offsets is not None or rows is not None or silu:
            raise ValueError("gemm: silu_out=True is for a dense W4A16 gate | up weight: pass x [M, K] only "
                             "(no xq, offsets, rows or silu)")
        return _gemm_silu_out(x, weight, tune, config)
    grouped = offsets is not None
    if silu and (x is None or xq is not None):
        raise ValueError("gemm: silu=True is for W4A16: pass x = gate | up [M, 2K] (bfloat16), not xq")
    if rows is not None:
        if not grouped or xq is not None:
            raise ValueError("gemm: rows (the experts' gather) is for grouped W4A16 (offsets, x) only")
        if rows.dtype != torch.int32 or rows.ndim != 1:
            raise TypeError(f"gemm: rows must be int32 [M], got {rows.dtype} {tuple(rows.shape)}")
    wd, ws, wg = _weight_parts(weight, grouped)
    swz = getattr(weight, "gemv32", None)  # the same codes in the gemv32 layout (1-4 row GEMV only)
    m16 = getattr(weight, "mma16", None)  # the CUDA mma16 kernel's copy (gemv_cuda.relayout), 1-16 rows
    if swz is not None and (grouped or swz.shape != wd.shape[1:] or swz.dtype != torch.uint8):
        raise ValueError("weight.gemv32 must be uint8 data of the weight's shape [N, K/2] (dense weights "
                         "only)")
    e, n, kh = wd.shape
    if xq is not None:
        xd, xs, xg = xq
        if xd.shape[-1] != kh:
            raise ValueError(f"xq data has K/2={xd.shape[-1]}, the weight {kh}")
        xq = (xd.reshape(-1, kh).contiguous(), _u8(xs).reshape(-1, kh // 8).contiguous(),
              xg.float().reshape(-1).contiguous())
        m = xq[0].shape[0]
        x2 = None
    else:
        if silu and x.shape[-1] != 4 * kh:
            raise ValueError(f"gemm: silu=True needs x = gate | up [M, 2K] with K={2 * kh} (the weight's), "
                             f"i.e. {4 * kh} columns; got x {tuple(x.shape)}")
        x2 = _check_x(x, 4 * kh if silu else 2 * kh)
        m = x2.shape[0] if rows is None else rows.numel()
    if silu and (rows is not None or not FUSED_SILU or tokens is None or tokens > MMA16_SILU_MAX_TOKENS):
        x2, silu = _fused.silu_mul(x2)[0], False  # silu_mul first, then as without silu
    if grouped:
        offsets = offsets.to(torch.int32).contiguous()
        if offsets.numel() != e + 1:
            raise ValueError(
                f"offsets must have E+1={e + 1} entries (expert starts and the end), got {offsets.numel()}"
            )
    dense = getattr(weight, "dense", None)  # DQ(W) in bfloat16, kept by the caller: _tune.DENSE
    if dense is not None:
        want = (e, n, 2 * kh) if grouped else (n, 2 * kh)
        if tuple(dense.shape) != want or dense.dtype != torch.bfloat16:
            raise ValueError(f"weight.dense must be the weight's DQ(W), bfloat16 {list(want)}, got "
                             f"{dense.dtype} {tuple(dense.shape)}")
    device = wd.device
    y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    if m == 0:
        return y
    if (m16 is not None and grouped and config is None and tokens is not None
            and tokens >= 1 and m <= MMA16_GROUPED_ROWS_PER_EXPERT * e and _mma16.available(device)):
        if (m16.n, m16.k, m16.wt.shape[0]) != (n, 2 * kh, e * n // 16):
            raise ValueError(f"weight.mma16 is not a stacked copy of {e} experts of {n}x{2 * kh}")
        xin, x_scale = _mma16_input(x2, xq)
        try:
            _mma16_grouped.launch_grouped(xin, m16, wg, offsets, y, x_scale=x_scale, x_rows=rows, x_silu=silu)
            return y
        except ValueError:  # this K slice does not fit its shared memory: the Triton kernels below
            pass
        except RuntimeError as exc:  # NVRTC or the driver refused it: off for the process (the SILU build
            # alone if that was it: later calls take silu_mul + this kernel; this one the kernels below)
            (_disable_fused_silu if silu else _mma16.disable)(exc)
    if silu:  # every other kernel takes silu_mul(x)
        x2, silu = _fused.silu_mul(x2)[0], False
    if rows is not None:  # the other kernels take the sorted rows themselves
        x2 = x2.index_select(0, rows)
    if dense is not None and config == _tune.FALLBACK:  # the same product without the per-call dequantize
        config = _tune.DENSE
    if m16 is not None and not grouped and config is None and _mma16.available(device):
        # the CUDA kernel (fp4rl.kernels.gemv_cuda) in the configuration of _mma16_config
        cfg = _mma16_config(m, n, 2 * kh, dense, device)
        if cfg is not None:
            if (m16.n, m16.k) != (n, 2 * kh):
                raise ValueError(f"weight.mma16 is a copy of a {m16.n}x{m16.k} weight, the weight is "
                                 f"{n}x{2 * kh}")
            g1 = wg[0] if wg.ndim == 2 else wg
            # W4A4: the same exact products from x = e2m1 * block_scale (bf16, exact), x's per-row global
            # scale applied with the weight's to the FP32 sum
            xin, x_scale = _mma16_input(x2, xq)
            try:
                return _mma16.launch(xin, m16, g1, y, cfg=cfg, x_scale=x_scale)
            except RuntimeError as exc:  # NVRTC or the driver refused it: that configuration off for good
                # (1-16 rows may be on the wgmma build too: gemv_cuda.choose_narrow)
                (_mma16.disable_wide if cfg.get("WGMMA") else _mma16.disable)(exc)

    # the wgmma configuration as the tuner's first candidate for the rows of wide_candidate
    wide_tuned = (m16 is not None and not grouped and config is None
                  and (wide_candidate(m, n) or (dense is not None and wide_rows(m, n)))
                  and _mma16.available(device) and _mma16.wide_available(device)
                  and _mma16.supports(n, 2 * kh) and (m16.n, m16.k) == (n, 2 * kh))

    def make_run(wd, ws, wg, m16, swz, dense):
        def run(c):
            if c == _tune.FALLBACK:
                return _fallback(x2, xq, wd, ws, wg, y)
            if c == _tune.DENSE:
                if dense is None:
                    raise ValueError("the dense-copy configuration (DENSE) needs weight.dense")
                # W4A4: DQ(Q(x)) as the reference (dequantized again per call: timed with it)
                xin = x2 if xq is None else dequantize(xq[0], xq[1], xq[2], torch.bfloat16)
                if grouped:  # torch's grouped GEMM (the BF16 engine's experts); the sorted rows start at 0
                    return torch._grouped_mm(xin, dense.transpose(1, 2), offs=offsets[1:])
                return torch.matmul(xin, dense.t(), out=y)
            if c == _tune.WIDE:
                if m16 is None or grouped:
                    raise ValueError("the wgmma configuration (WIDE) needs a dense weight with its mma16 "
                                     "copy")
                xin, x_scale = _mma16_input(x2, xq)
                return _mma16.launch_wide(xin, m16, wg[0] if wg.ndim == 2 else wg, y, x_scale=x_scale)
            if isinstance(c, dict) and c.get("KIND") == "gemv_mma":
                if xq is not None or grouped or m > _gemv.MAX_ROWS:
                    raise ValueError(f"the Gluon GEMV config is for dense W4A16 with 1-{_gemv.MAX_ROWS} rows")
                if c["LAYOUT"] == 1 and swz is None:
                    raise ValueError("a gemv32 (LAYOUT 1) config needs weight.gemv32 (gemv.swizzle of its "
                                     "data)")
                g1 = wg[0] if wg.ndim == 2 else wg
                return _gemv.launch_mma(x2, swz if c["LAYOUT"] == 1 else wd[0], ws[0], g1, y, c, _WORKSPACE,
                                        layout=c["LAYOUT"])
            return _launch(x2, xq, wd, ws, wg, y, c, offsets)
        return run

    ops = (wd, ws, wg, m16, swz, dense)
    run = make_run(*ops)

    def copies(count):  # the tuner's rotation: run over `count` operand sets, the first the weight itself
        return [run] + [make_run(*_tune._clone_operands(ops)) for _ in range(count - 1)]

    rotate = (copies, ops)

    if config is None:
        layout = int(swz is not None)
        key = (_tune._bucket(m), n, kh, e, grouped, xq is not None, wg.ndim, device, wide_tuned, layout,
               dense is not None)
        # the dense copy first (untuned: the caller's choice), then the wgmma build
        lead = ((_tune.DENSE,) if dense is not None else ()) + ((_tune.WIDE,) if wide_tuned else ())
        config = _tune._choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped, tune=tune,
                               w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
        if config == _tune.WIDE:
            try:
                return run(config)
            except RuntimeError as exc:  # NVRTC or the driver refused it: off for good, the tuner again
                _mma16.disable_wide(exc)
                _tune._TUNED.pop(key, None)
                kw = _tune.KEY_WIDE
                key, lead = key[:kw] + (False,) + key[kw + 1:], lead[:-1]  # (WIDE was last)
                config = _tune._choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped,
                                       tune=tune, w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
        if isinstance(config, dict) and config.get("KIND") == "gemv_mma":
            try:
                return run(config)
            except Exception as exc:  # noqa: BLE001  (Gluon is experimental: fall back for good)
                _gemv.disable(exc)
                _tune._TUNED.pop(key, None)
                config = _tune._choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped,
                                       tune=tune, w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
    return run(config)


def linear(x, weight, *, tune: bool = True):
    """W4A16: x [..., K] bfloat16 @ DQ(weight).T -> [..., N] bfloat16 (weight data [N, K/2])."""
    lead = x.shape[:-1]
    y = gemm(x.reshape(-1, x.shape[-1]), weight, tune=tune)
    return y.reshape(*lead, y.shape[-1])


def grouped_linear(x, weight, offsets, *, tune: bool = True):
    """Routed experts, W4A16: x [M, K] sorted by expert, offsets int32 [E+1] (rows
    offsets[e]:offsets[e+1] go to expert e), weight data [E, N, K/2] -> y [M, N]."""
    return gemm(x, weight, offsets=offsets, tune=tune)


def quantize_activations(x, *, scale_rule: str = "6", err: str = "mse"):
    """Per-token NVFP4 quantization of x [M, K] (1x16 blocks, one FP32 global scale per row),
    no device sync: (data, block_scale, global_scale [M])."""
    from fp4rl.kernels.quantize import quantize_2d

    return quantize_2d(x.reshape(-1, x.shape[-1]), per_row=True, scale_rule=scale_rule, err=err,
                       check_finite=False)


def linear_w4a4(x, weight, *, scale_rule: str = "6", err: str = "mse", offsets=None, tune: bool = True):
    """W4A4 emulation (Blackwell numerics on Hopper): x [..., K] is quantized per token (the
    recipe's online per-token global scale), then y = (sum_k (e2m1 s)_x (e2m1 s)_w) * g_x * g_w,
    the exact-operand block-scaled product that an FP4 MMA computes. offsets: grouped experts."""
    lead = x.shape[:-1]
    xq = quantize_activations(x, scale_rule=scale_rule, err=err)
    y = gemm(None, weight, xq=xq, offsets=offsets, tune=tune)
    return y.reshape(*lead, y.shape[-1])
