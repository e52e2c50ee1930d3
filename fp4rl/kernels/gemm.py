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

This module is the host side (argument checks, dispatch, candidate configurations, the tuner and its
caches); the kernel itself, its launcher and its split-K workspace are fp4rl.kernels.gemm_kernel.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
import triton

from fp4rl.kernels import fused as _fused
from fp4rl.kernels import gemv as _gemv
from fp4rl.kernels import gemv_cuda as _mma16
from fp4rl.kernels import tune_cache as _tune_cache
from fp4rl.kernels._common import INTERPRET
from fp4rl.kernels.dequantize import _u8, dequantize  # noqa: F401  (gemm.dequantize: part of this API)
from fp4rl.kernels.gemm_kernel import (  # noqa: F401  (the kernel; gemm._WORKSPACE: one object, re-exported)
    _WORKSPACE,
    _launch,
    _w4_gemm_kernel,
    _Workspace,
)

DECODE_MAX_ROWS = 256  # rows up to this take the transposed (weights-as-M) kernel
# Rows up to this go to the CUDA mma16 kernel when the weight carries its copy (weight.mma16): on the
# H200 1.4-2.2x cuBLAS BF16 at 1-8 rows and 1.1-1.4x at 16 (bench/RESULTS.md); 32-64 rows measured slower
# than cuBLAS, so they stay with the tuned Triton kernels.
MMA16_MAX_ROWS = 16
# Routed experts go to the grouped mma16 kernel (chunks of 8, 16 or 32 rows by the average rows per expert,
# gemv_cuda.grouped_mg; each chunk streams its expert's weights) while their sorted rows average at most this
# many per expert (rows <= this x E), else to the Triton grouped GEMM, which reads each expert's weights once.
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


# The other rows up to WIDE_TUNE_MAX_ROWS (33-64 on narrower weights, 65-512) offer the wgmma configuration to
# the tuner as its first candidate (WIDE; taken untimed when tuning is off): with one running x pointer per
# thread (XPRE 2) it beat the tuned Triton kernels there on the H200 (bench/RESULTS.md, nineteenth session).
WIDE_TUNE_MAX_ROWS = 512
WIDE = "wgmma"


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


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


SMEM_BUDGET = 200 * 1024  # of the H100/H200's 227 KB per block, leaving room for Triton's scratch


def _smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """Shared memory a configuration needs, roughly: pipelined weight bytes, scales and x tiles,
    plus one bfloat16 weight tile staged for the MMA."""
    return stages * (bn * bk // 2 + bn * bk // 16 + bm * bk * 2) + bn * bk * 2


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def candidate_configs(m: int, n: int, kh: int, device, grouped: bool = False,
                      w4a16: bool = False, layout: int = 0) -> list[dict]:
    """The tile configurations tried for m rows (see module docstring); first is the default.
    w4a16 (dense bf16 x, CUDA): 1-4 rows first try the Gluon tensor-core GEMV (fp4rl.kernels.gemv;
    layout 1: the weight also carries its codes in the gemv32 layout, see gemm())."""
    if INTERPRET:  # small tiles: the CPU interpreter runs every program in Python
        swap = m <= 16
        bm = 16 if swap else 32
        return [dict(SWAP=swap, BM=bm, BN=32, BK=64, SPLIT_K=2 if (swap and not grouped) else 1,
                     num_warps=4, num_stages=1)]
    out = []
    if m <= _gemv.MAX_ROWS and w4a16 and not grouped and device.type == "cuda" and kh % 4 == 0 \
            and _gemv.available():
        # the Gluon tensor-core GEMV (fp4rl.kernels.gemv): 1.1-1.9x the Triton kernels below at 1-4 rows
        out += [dict(KIND="gemv_mma", LAYOUT=layout, **c)
                for c in _gemv.configs_mma(n, kh, _sm_count(device), m)]
    if m <= 2:  # CUDA-core kernel: BM = rows
        sms = _sm_count(device)
        for bn, bk, warps, stages in ((64, 128, 4, 4), (32, 256, 4, 4), (128, 128, 8, 4), (64, 256, 8, 3)):
            tiles = triton.cdiv(n, bn)
            split = 1
            if not grouped:
                while split < 16 and tiles * split < 4 * sms and kh // (split * 2) >= 2 * (bk // 2):
                    split *= 2
            for sk in dict.fromkeys((split, max(1, split // 2))):
                out.append(dict(SWAP=True, BM=_pow2(m), BN=bn, BK=bk, SPLIT_K=sk,
                                num_warps=warps, num_stages=stages))
    if m <= DECODE_MAX_ROWS:
        bm = max(16, _pow2(m))
        sms = _sm_count(device)
        # Compiled for sm_90 these use 79-214 registers and no spills (512-wide K tiles spilled).
        if bm <= 32:
            tiles_cfg = ((64, 128, 4, 6), (128, 128, 8, 4), (64, 256, 4, 4), (64, 256, 8, 4),
                         (128, 256, 8, 4))
        else:
            tiles_cfg = ((64, 128, 4, 4), (128, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 2))
        for bn, bk, warps, stages in tiles_cfg:
            if _smem_bytes(bm, bn, bk, stages) > SMEM_BUDGET:
                continue
            tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
            split = 1
            if not grouped:  # enough programs for ~3 waves, each split >= 2 K steps
                while split < 16 and tiles * split < 3 * sms and kh // (split * 2) >= 2 * (bk // 2):
                    split *= 2
            for sk in dict.fromkeys((split, max(1, split // 2), max(1, split // 4))):  # longer K loops too
                out.append(dict(SWAP=True, BM=bm, BN=bn, BK=bk, SPLIT_K=sk,
                                num_warps=warps, num_stages=stages))
    if m > 32:
        for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
                                          (64, 128, 128, 4, 4)):
            if bm > 2 * _pow2(m) or _smem_bytes(bm, bn, bk, stages) > SMEM_BUDGET:
                continue
            out.append(dict(SWAP=False, BM=bm, BN=bn, BK=bk, SPLIT_K=1, num_warps=warps, num_stages=stages))
    return out


_TUNED: dict[tuple, dict | str] = {}
TUNE_LOG: dict[tuple, list] = {}  # every candidate's time (us per call, time_chain) per key, for notes
FALLBACK = "dequantize+cublas"
DENSE = "cublas on the dense copy"  # a weight carrying `dense` (its DQ(W) in bfloat16): cuBLAS on it


# the tuner's key: (rows bucket, N, K/2, experts, grouped, W4A4, global-scale ndim, device, wgmma offered
# (WIDE), gemv32 layout, dense copy offered (DENSE)); the positions of the last three
KEY_WIDE, KEY_LAYOUT, KEY_DENSE = 8, 9, 10


def _bucket(m: int) -> int:
    return _pow2(m)


# The tuner times each candidate as the sampler runs it: TUNE_CALLS back-to-back calls replayed from one
# CUDA graph (launch gaps and PDL overlap as in the decode graph), rotating through copies of the weight so
# that each call reads its weight from DRAM as every layer does. Single launches after an L2 flush (triton's
# do_bench, the tuner until the twentieth session) timed the wgmma build 2-4x slower than it replays (e.g.
# 101 vs 34 us, 4096x14336 at 64 rows) and kept slower Triton configurations (bench/RESULTS.md, nineteenth
# session).
TUNE_CALLS = 8
TUNE_REPLAYS = 5
TUNE_MAX_COPIES = 32
TUNE_COPY_BUDGET = 1 << 30  # bytes of weight copies at most (and at most a quarter of the free memory)


def rotation_copies(read_bytes: int, copy_bytes: int, l2_bytes: int, free_bytes: int) -> int:
    """How many operand sets the tuner rotates through (the first is the weight itself): enough that a pass
    reads >= 3x the L2 (read_bytes: what one call reads of its weight), at most TUNE_MAX_COPIES, the extra
    copies (copy_bytes each) within min(TUNE_COPY_BUDGET, free_bytes / 4)."""
    want = -(-3 * max(l2_bytes, 1) // max(read_bytes, 1))
    fit = 1 + min(TUNE_COPY_BUDGET, max(free_bytes, 0) // 4) // max(copy_bytes, 1)
    return max(1, min(want, TUNE_MAX_COPIES, fit))


def warm(calls) -> None:
    """Run each callable once on a side stream (compile, allocate, lazy library set-up) before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for c in calls:
                c()
    finally:  # (also when a call fails: nothing of it may overlap the next candidate's calls)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()


def time_chain(calls, n_calls: int = TUNE_CALLS, replays: int = TUNE_REPLAYS, warm_ms: float = 0.0) -> float:
    """Median microseconds per call of calls[i % len(calls)], i < max(n_calls, len(calls)), captured back to
    back in one CUDA graph and replayed `replays` times after two untimed replays (run `warm` first). warm_ms:
    keep replaying the graph this long before timing (steady clocks: an idle H200 drops its SM clock within
    milliseconds, and instruction-bound kernels then time slower)."""
    n = max(n_calls, len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for r in range(replays + 2):  # two replays warm the clocks and the instruction caches
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        if r == 0 and warm_ms > 0:
            for _ in range(min(2000, int(warm_ms / max(t0.elapsed_time(t1), 1e-3)))):
                graph.replay()
            torch.cuda.synchronize()
        if r >= 2:
            times.append(t0.elapsed_time(t1) * 1e3 / n)
    del graph
    times.sort()
    return times[len(times) // 2]


def _l2_bytes(device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20)


def _choose(key, m, n, kh, device, run, grouped, allow_fallback, tune, w4a16=False, layout=0, lead=(),
            rotate=None):
    """Pick (and cache) the fastest candidate for this key by timing each on the GPU (lead: candidates put
    first, e.g. DENSE, WIDE). rotate: (make(count) -> `count` run functions over copies of the weight, the
    weight's operands (data, scale, global, mma16 copy, gemv32 copy, dense copy)), see rotation_copies; None:
    run alone. Inside a CUDA-graph capture nothing is timed: the first candidate runs, and is not kept. Picks
    are kept on disk
    too (fp4rl.kernels.tune_cache): a later process on the same kind of GPU, software and kernels takes them
    without timing."""
    if key in _TUNED:
        return _TUNED[key]
    cands = list(lead) + candidate_configs(m, n, kh, device, grouped, w4a16, layout)
    if allow_fallback and m > 64 and DENSE not in cands:  # (DENSE is FALLBACK without its dequantize)
        cands = cands + [FALLBACK]
    if not tune or INTERPRET or device.type != "cuda" or len(cands) == 1:
        _TUNED[key] = cands[0]
        return cands[0]
    cache = _tune_cache.file_for(device)  # an earlier process's pick for this GPU, software and key
    if cache is not None:
        hit = _tune_cache.lookup(cache, key, cands)
        if hit is not None:
            _TUNED[key] = hit
            return hit
    if torch.cuda.is_current_stream_capturing():  # tune before capture (gpu_decode warms up first)
        return cands[0]
    runs = [run]
    if rotate is not None:
        make, ops = rotate  # (a call reads the packed data and scales, or the mma16 copy of the same size)
        count = rotation_copies(ops[0].nbytes + ops[1].nbytes, _operand_bytes(ops), _l2_bytes(device),
                                torch.cuda.mem_get_info(device)[0])
        runs = make(count)
    best, best_t, first_error = None, float("inf"), None
    log = TUNE_LOG.setdefault(key, [])
    for c in cands:
        # errors are kept as text: an exception's traceback would hold these frames, and with them the
        # weight copies, until the next garbage collection
        calls = [lambda r=r, c=c: r(c) for r in runs]
        try:
            warm(calls)
        except Exception as exc:  # a configuration that does not compile or run on this GPU is skipped
            first_error = first_error or repr(exc)[:300]
            log.append((c, repr(exc)[:100]))
            if c == WIDE and isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError):
                _mma16.disable_wide(exc)  # NVRTC / the driver refused sm_90a: off for good
            continue
        try:
            t = time_chain(calls)
        except Exception as exc:  # ran, but not inside a graph capture: skipped (not switched off)
            first_error = first_error or repr(exc)[:300]
            log.append((c, repr(exc)[:100]))
            continue
        log.append((c, t))  # microseconds
        if t < best_t:
            best, best_t = c, t
    del runs, calls
    if best is None:
        raise RuntimeError(f"no NVFP4 GEMM configuration ran for {key}; the first error: {first_error}")
    _TUNED[key] = best
    if cache is not None and first_error is None:  # (not a pick made without a candidate that failed here)
        _tune_cache.store(cache, key, best)
    return best


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


def _clone_operands(ops):
    """A copy of (data, scale, global, mma16 copy or None, gemv32 copy or None, dense copy or None) in fresh
    memory."""
    wd, ws, wg, m16, swz, dense = ops
    m16c = None
    if m16 is not None:  # (gemv_cuda.Mma16Weight, or any object with its fields)
        m16c = copy.copy(m16)
        m16c.wt, m16c.st = m16.wt.clone(), m16.st.clone()
    return (wd.clone(), ws.clone(), wg.clone(), m16c, None if swz is None else swz.clone(),
            None if dense is None else dense.clone())


def _operand_bytes(ops) -> int:
    wd, ws, wg, m16, swz, dense = ops
    extra = (0 if m16 is None else m16.wt.nbytes + m16.st.nbytes) + (0 if swz is None else swz.nbytes)
    return wd.nbytes + ws.nbytes + wg.nbytes + extra + (0 if dense is None else dense.nbytes)


def _disable_fused_silu(exc: Exception) -> None:
    global FUSED_SILU
    FUSED_SILU = False
    warnings.warn(f"the grouped mma16 kernel's SILU build failed ({repr(exc)[:300]}); gemm(silu=True) runs "
                  "fused.silu_mul first from now on", stacklevel=3)


def gemm(x, weight, *, xq=None, offsets=None, tune: bool = True, config=None, tokens: int | None = None,
         rows=None, silu: bool = False):
    """Core entry: y [M, N] = x @ DQ(W).T on packed NVFP4 weights.

    x: bfloat16 [M, K] (W4A16), or None with xq = (data uint8 [M, K/2], block_scale [M, K/16],
    global_scale fp32 [M] or [M, 1]) for W4A4 emulation. weight: NVFP4 with data [N, K/2] (or
    [E, N, K/2] with offsets int32 [E+1] over the expert-sorted rows of x). config: a dict from
    candidate_configs, FALLBACK or DENSE, to bypass the tuner. A weight may carry `dense` (its DQ(W),
    bfloat16 [N, K] or grouped [E, N, K], as `dequantize` makes it: DENSE, y = x @ dense.T on cuBLAS, grouped
    torch._grouped_mm over offsets[1:] (offsets[0] must be 0), W4A4 with x = DQ(Q(x)), is then the tuner's
    first candidate, taken untuned, and replaces FALLBACK; grouped weights keep the grouped mma16 kernel where
    it is taken, below), a dense weight `gemv32` (gemv.swizzle
    of its data: the Gluon GEMV's copy) and/or `mma16` (gemv_cuda.relayout: the CUDA kernel's copy, taken for
    1-MMA16_MAX_ROWS rows of W4A16 or W4A4 when no config is forced, with or without `dense`, and for the rows
    of `wide_rows` with its wgmma configuration on sm_90, which with `dense` the tuner weighs against DENSE).
    Grouped weights may carry `mma16` too
    (gemv_cuda.relayout_stack): taken when the caller passes `tokens` (the batch's tokens before top-k) and
    the rows average at most MMA16_GROUPED_ROWS_PER_EXPERT per expert.
    rows: grouped W4A16 only, int32 [M]: x [T, K] holds the batch's tokens and sorted row r is x[rows[r]];
    the grouped mma16 kernel reads those rows itself, every other path gathers them first (same result).
    silu: W4A16 only: x is [M, 2K] = gate | up (gate in columns [0, K), up in [K, 2K), K the weight's) and
    y = silu_mul(x) @ DQ(W).T with silu_mul(x) = fused.silu_mul(x)[0] = bf16(bf16(silu(gate)) * up) (the MoE
    experts' down projection). The grouped mma16 kernel computes it while staging x (FUSED_SILU, tokens <=
    MMA16_SILU_MAX_TOKENS, not with rows); every other path runs fused.silu_mul first (the same bits). With
    rows, x [T, 2K] holds the tokens' gate | up (silu_mul, then the gather).
    """
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
    dense = getattr(weight, "dense", None)  # DQ(W) in bfloat16, kept by the caller: DENSE
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
            return _mma16.launch_grouped(xin, m16, wg, offsets, y, x_scale=x_scale, x_rows=rows, x_silu=silu)
        except ValueError:  # this K slice does not fit its shared memory: the Triton kernels below
            pass
        except RuntimeError as exc:  # NVRTC or the driver refused it: off for the process (the SILU build
            # alone if that was it: later calls take silu_mul + this kernel; this one the kernels below)
            (_disable_fused_silu if silu else _mma16.disable)(exc)
    if silu:  # every other kernel takes silu_mul(x)
        x2, silu = _fused.silu_mul(x2)[0], False
    if rows is not None:  # the other kernels take the sorted rows themselves
        x2 = x2.index_select(0, rows)
    if dense is not None and config == FALLBACK:  # the same product without the per-call dequantize
        config = DENSE
    if m16 is not None and not grouped and config is None and _mma16.available(device):
        # the CUDA kernel (fp4rl.kernels.gemv_cuda): mma.sync for every row up to 16 on one MMA, its wgmma
        # configuration for the rows of wide_rows (with a dense copy: the tuner weighs the two, below)
        narrow = m <= MMA16_MAX_ROWS and _mma16.fits(n, 2 * kh, m, _sm_count(device))
        wide = (dense is None and not narrow and wide_rows(m, n) and _mma16.wide_available(device)
                and _mma16.supports(n, 2 * kh))
        if narrow or wide:
            if (m16.n, m16.k) != (n, 2 * kh):
                raise ValueError(f"weight.mma16 is a copy of a {m16.n}x{m16.k} weight, the weight is "
                                 f"{n}x{2 * kh}")
            g1 = wg[0] if wg.ndim == 2 else wg
            # W4A4: the same exact products from x = e2m1 * block_scale (bf16, exact), x's per-row global
            # scale applied with the weight's to the FP32 sum
            xin, x_scale = _mma16_input(x2, xq)
            try:
                if narrow:
                    return _mma16.launch(xin, m16, g1, y, x_scale=x_scale)
                return _mma16.launch_wide(xin, m16, g1, y, x_scale=x_scale)
            except RuntimeError as exc:  # NVRTC or the driver refused it: that configuration off for good
                (_mma16.disable if narrow else _mma16.disable_wide)(exc)

    # the wgmma configuration as the tuner's first candidate for the rows of wide_candidate
    wide_tuned = (m16 is not None and not grouped and config is None
                  and (wide_candidate(m, n) or (dense is not None and wide_rows(m, n)))
                  and _mma16.available(device) and _mma16.wide_available(device)
                  and _mma16.supports(n, 2 * kh) and (m16.n, m16.k) == (n, 2 * kh))

    def make_run(wd, ws, wg, m16, swz, dense):
        def run(c):
            if c == FALLBACK:
                return _fallback(x2, xq, wd, ws, wg, y)
            if c == DENSE:
                if dense is None:
                    raise ValueError("the dense-copy configuration (DENSE) needs weight.dense")
                # W4A4: DQ(Q(x)) as the reference (dequantized again per call: timed with it)
                xin = x2 if xq is None else dequantize(xq[0], xq[1], xq[2], torch.bfloat16)
                if grouped:  # torch's grouped GEMM (the BF16 engine's experts); the sorted rows start at 0
                    return torch._grouped_mm(xin, dense.transpose(1, 2), offs=offsets[1:])
                return torch.matmul(xin, dense.t(), out=y)
            if c == WIDE:
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
        return [run] + [make_run(*_clone_operands(ops)) for _ in range(count - 1)]

    rotate = (copies, ops)

    if config is None:
        layout = int(swz is not None)
        key = (_bucket(m), n, kh, e, grouped, xq is not None, wg.ndim, device, wide_tuned, layout,
               dense is not None)
        # the dense copy first (untuned: the caller's choice), then the wgmma build
        lead = ((DENSE,) if dense is not None else ()) + ((WIDE,) if wide_tuned else ())
        config = _choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped, tune=tune,
                         w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
        if config == WIDE:
            try:
                return run(config)
            except RuntimeError as exc:  # NVRTC or the driver refused it: off for good, the tuner again
                _mma16.disable_wide(exc)
                _TUNED.pop(key, None)
                key, lead = key[:KEY_WIDE] + (False,) + key[KEY_WIDE + 1:], lead[:-1]  # (WIDE was last)
                config = _choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped, tune=tune,
                                 w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
        if isinstance(config, dict) and config.get("KIND") == "gemv_mma":
            try:
                return run(config)
            except Exception as exc:  # noqa: BLE001  (Gluon is experimental: fall back for good)
                _gemv.disable(exc)
                _TUNED.pop(key, None)
                config = _choose(key, m, n, kh, device, run, grouped, allow_fallback=not grouped, tune=tune,
                                 w4a16=xq is None, layout=layout, lead=lead, rotate=rotate)
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
