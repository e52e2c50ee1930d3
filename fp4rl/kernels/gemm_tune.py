"""The NVFP4 GEMM's tuner: which kernel and configuration runs each (rows bucket, N, K) of kernels.gemm.

Nothing is assumed about where the crossovers between kernels lie. For each key the candidates (the
Triton kernel's tile configurations from ``candidate_configs``, and those the caller puts first: the CUDA
kernel's wgmma configuration ``WIDE``, cuBLAS on a dense copy ``DENSE``; ``FALLBACK`` from 65 rows) are
timed once on the GPU the way the decode graph runs them (``time_chain``: back-to-back calls replayed from
one CUDA graph, rotating through enough weight copies that each call reads DRAM), and the fastest is kept
in memory (``_TUNED``) and on disk (fp4rl.kernels.tune_cache). ``TUNE_LOG`` keeps every candidate's time.
Without a GPU, without tuning, or inside a capture, the first candidate runs.
"""

from __future__ import annotations

import copy
import os
import time

import torch
import triton

from fp4rl.kernels import gemv as _gemv
from fp4rl.kernels import gemv_cuda as _mma16
from fp4rl.kernels import tune_cache as _tune_cache
from fp4rl.kernels._common import INTERPRET

DECODE_MAX_ROWS = 256  # rows up to this take the transposed (weights-as-M) kernel

# The tuner's candidate names beside the tile configurations (dicts): the CUDA kernel's wgmma configuration
# (gemm.WIDE_TUNE_MAX_ROWS), dequantize then cuBLAS, cuBLAS on a dense copy the weight carries.
WIDE = "wgmma"


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
TUNE_SECONDS: dict[tuple, float] = {}  # wall seconds each timed key cost (its candidates' compiles included)
FALLBACK = "dequantize+cublas"
DENSE = "cublas on the dense copy"  # a weight carrying `dense` (its DQ(W) in bfloat16): cuBLAS on it


# the tuner's key: (rows bucket, N, K/2, experts, grouped, W4A4, global-scale ndim, device, wgmma offered
# (WIDE), gemv32 layout, dense copy offered (DENSE)); the positions of the last three
KEY_WIDE, KEY_LAYOUT, KEY_DENSE = 8, 9, 10


def _bucket(m: int) -> int:
    return _pow2(m)


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: give an integer number of bytes >= 0 (0: time every weight), or "
                         f"unset it (default {default})")
    return value


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

# A weight smaller than this (packed bytes) is not timed: the first candidate that runs is kept. A call over
# it is bound by launch and latency (microseconds whichever candidate), while timing its candidates compiles
# each of them for every row bucket: with every weight timed, the default job's SmolLM2-135M (weights of
# 0.2-1 MB) took 129 s on an H200 to its first rollout (bench/RESULTS.md, twenty-fifth session).
# FP4RL_TUNE_MIN_BYTES=0 times every weight.
TUNE_MIN_BYTES = _env_bytes("FP4RL_TUNE_MIN_BYTES", 4 << 20)


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
    weight_bytes = rotate[1][0].nbytes + rotate[1][1].nbytes if rotate is not None else n * kh * 9 // 8
    if weight_bytes < TUNE_MIN_BYTES:
        return _first_that_runs(key, cands, run)
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
    started = time.perf_counter()
    for c in cands:
        # errors are kept as text: an exception's traceback would hold these frames, and with them the
        # weight copies, until the next garbage collection
        calls = [lambda r=r, c=c: r(c) for r in runs]
        error = _warm_or_error(c, calls)
        if error is not None:  # a configuration that does not compile or run on this GPU is skipped
            first_error = first_error or error[:300]
            log.append((c, error[:100]))
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
    TUNE_SECONDS[key] = time.perf_counter() - started
    if best is None:
        raise RuntimeError(f"no NVFP4 GEMM configuration ran for {key}; the first error: {first_error}")
    if cache is not None and first_error is None:  # (not a pick made without a candidate that failed here)
        best = _tune_cache.store(cache, key, best, cands)  # another process's pick, if it stored one first
    _TUNED[key] = best
    return best


def _warm_or_error(c, calls) -> str | None:
    """Warm candidate c on calls; None if it ran, else its error as text (a traceback would hold the caller's
    frames, and with them the weight copies, until the next garbage collection). A wgmma build that NVRTC or
    the driver refuses switches the wgmma kernels off for good."""
    try:
        warm(calls)
    except Exception as exc:
        if c == WIDE and isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError):
            _mma16.disable_wide(exc)
        return repr(exc)
    return None


def _first_that_runs(key, cands, run):
    """A small weight's pick, untimed: the first candidate that compiles and runs (as the timing loop skips
    one that fails: e.g. a tile that needs more shared memory than this GPU has)."""
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    first_error = None
    for c in cands:
        error = _warm_or_error(c, [lambda c=c: run(c)])
        if error is not None:
            first_error = first_error or error[:300]
            continue
        _TUNED[key] = c
        return c
    raise RuntimeError(f"no NVFP4 GEMM configuration ran for {key}; the first error: {first_error}")


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
