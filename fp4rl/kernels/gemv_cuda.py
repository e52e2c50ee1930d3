"""W4A16 skinny GEMM on Hopper in CUDA C++ (gemv_mma16.cu), compiled by NVRTC at run time: mma.sync for
1-64 rows (``choose``), wgmma for any number of rows (``choose_wide``, sm_90a; gemm.gemm takes it at 17-64,
and at 2-16 rows with the one-row split of K: ``choose_narrow``).

The kernel streams a re-laid-out copy of the packed weight (``Mma16Weight``: the same bytes per code plus
bf16 block scales, made once per weight version by ``relayout``; the sampler keeps it in
``fp4rl.gpu_linear._DecodeCopy``). The weights are the A operand of mma.sync.m16n8k16 (one 32-bit word
of codes = one lane's A fragment) and x^T the B operand, so each MMA serves 8 rows of x: up to 8 rows
cost the same per weight byte as one. Split-K partials are reduced in a fixed order, inside a thread-block
cluster through distributed shared memory (SPLIT CTAs per n-block), or, at one row and for the routed
experts, inside the CTA (KW warps per n-tile: ``in_cta_split``): the same bits for the same split, without
the cluster's barriers. The .cu file says how (layout, fragments). The routed experts' launches (one launch
over a stack of expert weights, rows sorted by expert) are fp4rl.kernels.gemv_cuda_grouped's.

The .cu's PRENORM build (the decode step's residual add + RMSNorm inside the x staging) is launched by
fp4rl.kernels.gemv_cuda_prenorm; ``smem_bytes`` and ``source`` here know its layout and header. Its
GU_SILU build (``launch(silu_out=True)``, where ``gu_silu_ok``) finishes a fused gate | up GEMM with
SiLU(gate) * up in the epilogue: y [M, N/2] = fused.silu_mul(the plain launch's y), bit for bit.

Arithmetic: the bf16 operands (e2m1 * block_scale, exact) times x in the tensor core with FP32
accumulation, the FP32 global scale once on the sum, one bfloat16 rounding: the same products as
fp4rl.kernels.gemm / gemv (within FP32 summation order).

CUDA only (NVRTC through torch.cuda._compile_kernel); ``available()`` says whether it can run here.
The weight copy (``relayout`` / ``unrelayout`` / ``emulate_weight``, plain torch, run anywhere: tests check
the layout, the bit unpack and the fragment mapping on CPU) is fp4rl.kernels.mma16_layout's, re-exported here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import torch

from fp4rl.kernels import pdl, prenorm, resnorm, tensor_map
from fp4rl.kernels.mma16_layout import (  # noqa: F401  (the weight copy, re-exported)
    Mma16Weight,
    _unpack_pairs,
    emulate_weight,
    relayout,
    supports,
    unrelayout,
)

_SOURCE = Path(__file__).with_name("gemv_mma16.cu")
WARPS = 8
STAGE_BYTES = 1280  # one 16-row n-tile and 128-k step: 1 KB of weight words, 256 B of bf16 scales
STATE = {"ok": None, "error": None, "wide": None}  # None: not tried yet here; "wide": the wgmma configuration
MAX_ROWS = 64  # MG up to 8 groups of 8 rows
SMEM_LIMIT = 110 * 1024  # two CTAs per SM on an H100/H200 (227 KB)
SMEM_MAX = 227 * 1024  # one CTA
SMEM_SM = 228 * 1024  # an SM's shared memory, of which the driver keeps SMEM_CTA_RESERVED per CTA
SMEM_CTA_RESERVED = 1024
# where the kernel signals programmatic dependent launch (gemv_mma16.cu: 1 at its start, 2 after its weight
# stream, 0 at exit); only matters for launches with the PDL attribute (fp4rl/kernels/pdl.py)
TRIGGER = int(os.environ.get("FP4RL_MMA16_TRIGGER", "2"))
# split K between the warps of a CTA instead of a cluster of CTAs where x's whole K fits (one row; the routed
# experts' chunks): FP4RL_MMA16_KW=0 keeps the cluster (measured in bench/RESULTS.md, fifteenth session)
IN_CTA_SPLIT = os.environ.get("FP4RL_MMA16_KW", "1") != "0"
# ring depth (DEPTH: 128-k steps in flight per warp) of one-row dense launches (the routed experts':
# gemv_cuda_grouped.DEPTH_GROUPED); 0 keeps the choice of ``choose`` (deeper was slower in the 30B step:
# bench/RESULTS.md, sampler, thirty-first session)
DEPTH_ONE_ROW = int(os.environ.get("FP4RL_MMA16_DEPTH1", "0"))
# in-CTA split builds (KW) with per-row global scales: each thread's row scale read before the stream instead
# of in the epilogue (gemv_mma16.cu GSR; the same bits; one of the three dependent L2 round trips taken out of
# the decode GEMMs' paths in the thirty-second session, gemv_cuda_grouped has the other two; "0" for A/B)
ROW_SCALE_EARLY = os.environ.get("FP4RL_MMA16_GSR", "1") != "0"
# GU_SILU builds with per-row global scales (a fused gate | up) on the plain and in-CTA split epilogues: each
# thread's gate and up row scales read before the stream (gemv_mma16.cu GSU; the same bits): their epilogue
# read them after the last MMA, an L2 round trip on every CTA's tail (SASS, sixtieth session). Off until a GPU
# has run its bit tests and timed it (FP4RL_GU_SILU_GSR=1)
GU_SILU_EARLY = os.environ.get("FP4RL_GU_SILU_GSR", "0") == "1"
# stamps builds only (fp4rl.benchmarks.stamps): where the third stamp is taken (gemv_mma16.cu STAMP_AT)
STAMP_AT = int(os.environ.get("FP4RL_MMA16_STAMP_AT", "0"))
# CTAs per SM that ``choose``'s split of K may fill (1-16 rows: the same split for all of them). 3 takes
# Qwen3-30B-A3B's q/k/v (5120x2048) from 160 CTAs (36 SMs with two, which left 0.7 us after the others at one
# row: bench/gpu_kernels.md, thirty-third session) to 320; other bits. Being measured (bench/device_run105.sh)
DENSE_FILL = int(os.environ.get("FP4RL_MMA16_FILL", "2"))
# device index -> the int64 buffer that kernels compiled there append their in-kernel stamps to (diagnostics
# only: set_stamp_buffer, from fp4rl.benchmarks.stamps; gemv_mma16.cu: STAMP_BUF)
STAMPS: dict = {}


def _row_scale_key(cfg: dict, per_row: bool) -> dict:
    """The compile key with GSR where it applies (ROW_SCALE_EARLY, per-row scales, the in-CTA split)."""
    return {**cfg, "GSR": 1} if ROW_SCALE_EARLY and per_row and cfg.get("KW", 1) > 1 else cfg


def set_stamp_buffer(device_index: int, buf: torch.Tensor | None) -> None:
    """Kernels compiled on this device from now on append their stamps to `buf` (None: plain builds again);
    the compiled kernels are dropped so that the next launches rebuild (CUDA graphs captured before keep
    theirs: recapture them)."""
    if buf is None:
        STAMPS.pop(device_index, None)
    else:
        STAMPS[device_index] = buf
    _kernel.cache_clear()
    _SMEM_SET.clear()


def hopper_nvrtc(device=None) -> bool:
    """A CUDA device of compute capability 9.x (the CUDA C++ kernels' sm_90 code: clusters, griddepcontrol)
    and NVRTC through torch."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
        return False
    return hasattr(torch.cuda, "_compile_kernel")


def available(device=None) -> bool:
    """True where the kernel can run: hopper_nvrtc, and no failure here before."""
    return STATE["ok"] is not False and hopper_nvrtc(device)


def disable_wide(exc: Exception) -> None:
    """The wgmma configuration failed here (NVRTC or the driver refused sm_90a): off for good; the mma.sync
    configurations stay on."""
    STATE["wide"] = False
    _plan.cache_clear()  # (1-16 rows: the mma.sync build again where choose_narrow took the wgmma one)
    warnings.warn(f"CUDA wgmma W4A16 configuration disabled ({repr(exc)[:300]}); 17+ rows use the Triton "
                  "kernels, 2-16 the mma.sync build", stacklevel=3)


def disable(exc: Exception) -> None:
    STATE["ok"], STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"CUDA mma16 W4A16 kernel disabled ({STATE['error']}); using the Triton/Gluon kernels",
                  stacklevel=3)


# ----------------------------------------------------------------------------- configuration
def ksplit(cfg: dict) -> int:
    """How many parts K is split into: SPLIT CTAs (a cluster) or KW warps of one CTA. The sums, and so the
    bits of the result, depend on this and on the ring-independent step ranges only."""
    return cfg.get("KW", 1) * cfg["SPLIT"]


def warps(cfg: dict) -> int:
    """A CTA's warps in this configuration (WS's producer warp not counted): WARPS, or its WARPS key (4)."""
    return cfg.get("WARPS", WARPS)


def block_rows(cfg: dict) -> int:
    """Weight rows (n) per CTA: warps / KW of NT 16-row tiles."""
    return warps(cfg) // cfg.get("KW", 1) * cfg["NT"] * 16


def set_in_cta_split(on: bool) -> None:
    """Choose in-CTA split-K (``in_cta_split``) or the cluster for launches planned from now on (the cached
    plans are dropped; CUDA graphs captured before keep their kernels: recapture them)."""
    global IN_CTA_SPLIT
    IN_CTA_SPLIT = bool(on)
    _plan.cache_clear()
    from fp4rl.kernels import gemv_cuda_grouped, gemv_cuda_prenorm  # (they import this module)

    gemv_cuda_grouped._plan_grouped.cache_clear()
    gemv_cuda_prenorm._plan_prenorm.cache_clear()


def in_cta_split(cfg: dict, k: int, m: int) -> dict:
    """`cfg` with its cluster split (SPLIT CTAs) moved inside the CTA (KW = SPLIT warps per n-tile, each
    streaming its part of K; NB = 128 / KW weight rows per CTA, so the grid keeps its warps) where the CTA's
    x slice then spans the whole K and still fits two CTAs per SM; else `cfg` unchanged. Same step ranges,
    same summation order: the same bits."""
    if (not IN_CTA_SPLIT or cfg["SPLIT"] == 1 or cfg.get("XSTREAM") or cfg.get("WGMMA")
            or cfg.get("KW", 1) > 1):
        return cfg
    moved = dict(cfg, SPLIT=1, KW=cfg["SPLIT"])
    return moved if smem_bytes(moved, k, m) <= SMEM_LIMIT else cfg


def deeper(cfg: dict, depth: int, k: int, m: int) -> dict:
    """`cfg` with a ring of `depth` steps (at most the steps a warp streams, at least 2) where it fits two
    CTAs per SM; else `cfg`. The ring does not change which steps a warp adds, or in which order: the same
    bits."""
    if not depth or cfg.get("XSTREAM") or cfg.get("WGMMA"):
        return cfg
    per_warp = -(-(k // 128) // ksplit(cfg))
    moved = dict(cfg, DEPTH=max(2, min(depth, per_warp)))
    return moved if smem_bytes(moved, k, m) <= SMEM_LIMIT else cfg


def choose(n: int, k: int, m: int, sms: int) -> dict:
    """(NT, MG, SPLIT, DEPTH[, XSTREAM, KW]) for an N x K weight and m rows. Up to 16 rows the split of K
    (``ksplit``) depends on N and K only, so a row's result does not depend on how many rows (<= 16) come
    with it (XSTREAM changes where x waits in shared memory, KW where the partials are added: neither the
    order of the sums)."""
    if m > MAX_ROWS:
        raise ValueError(f"the mma16 kernel takes 1-{MAX_ROWS} rows, got {m}")
    nt = 1
    mg = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
    nblocks = -(-n // (WARPS * nt * 16))
    steps = k // 128
    split = 1  # up to DENSE_FILL (2) CTAs per SM in one wave, >= 2 steps per split
    while split < 8 and nblocks * split * 2 <= DENSE_FILL * sms and steps // (split * 2) >= 2:
        split *= 2
    depth = 2  # 2 beat 3-8 on every Qwen3-8B decode shape at 1 and 8 rows (bench/RESULTS.md, fifth session)
    while smem_bytes(dict(NT=nt, MG=max(mg, 2), SPLIT=split, DEPTH=depth), k, max(m, 16)) > SMEM_LIMIT \
            and split < 8 and steps // (split * 2) >= 1:  # the same split for every m <= 16
        split *= 2
    cfg = dict(NT=nt, MG=mg, SPLIT=split, DEPTH=depth)
    if mg >= 2 and split <= 2:  # long x slices of 9+ rows: stream x with the weights instead of staging it
        cfg["XSTREAM"] = 1  # (24576x4096 at 16 rows: 29.6 vs 35.7 us; same arithmetic order, same bits)
    if m == 1:  # one row: the whole of x is 2K bytes; the split goes inside the CTA (same bits)
        cfg = deeper(in_cta_split(cfg, k, m), DEPTH_ONE_ROW, k, m)
    if smem_bytes(cfg, k, m) > SMEM_MAX:
        raise ValueError(f"{m} rows of K={k} do not fit the mma16 kernel's shared memory "
                         f"({smem_bytes(cfg, k, m)} B)")
    return cfg


WIDE_MG = 16  # the wgmma configuration: up to 128 rows of x per CTA (m64n128k16), more rows in grid z blocks


def _env_choice(name: str, default: str, allowed: tuple, meaning: str) -> int:
    """The int the A/B switch `name` holds (unset or blank: `default`); anything outside `allowed` raises,
    naming what the values mean."""
    raw = os.environ.get(name, default).strip() or default
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r}: expected {meaning}")
    return int(raw)


def _wide_nt_from_env() -> int:
    """FP4RL_WIDE_NT (A/B): 0 or unset = choose_wide's rule for the m64 tiles a warpgroup; 1 or 2 = that many
    at every row count (the split stays the rule's: as bench/mma16_sweep.py's `wide+nt2`)."""
    return _env_choice("FP4RL_WIDE_NT", "0", ("0", "1", "2"), "0 (the rule), 1 or 2 (m64 tiles a warpgroup)")


WIDE_NT = _wide_nt_from_env()


def _wide_ws_from_env() -> int:
    """FP4RL_WIDE_WS (A/B): 0 or unset = the wgmma configuration as ``choose_wide`` makes it; N in 2..8 = its
    warp-specialized build (gemv_mma16.cu WS: a producer warp copies the steps with the bulk / tensor copy
    engine into a ring of N stages) at every row count. Bit-identical, and 8-16% slower than the plain build
    on Qwen3-8B's shapes at 32 rows (H100, bench/RESULTS.md, fifty-fifth session): off by default."""
    return _env_choice("FP4RL_WIDE_WS", "0", ("0",) + tuple(map(str, range(2, 9))),
                       "0 (off) or a ring depth 2..8 (the warp-specialized wgmma build)")


WIDE_WS = _wide_ws_from_env()


def _wide_warps_from_env() -> int:
    """FP4RL_WIDE_WARPS (A/B): 0 or unset = ``choose_wide``'s rule for the warps a CTA; 4 or 8 = that many at
    every row count (4: one warpgroup, 64 weight rows a CTA, for the plain build only; the same bits)."""
    return _env_choice("FP4RL_WIDE_WARPS", "0", ("0", "4", "8"), "0 (the rule), 4 or 8 (warps a CTA)")


WIDE_WARPS = _wide_warps_from_env()
# the warp-specialized build's registers (288 threads a CTA): NT x MG up to 16 compiles without spills, NT 2
# at MG 13 spilled 108 B; wider tiles keep the plain build
WS_MAX_ACC = 16


def wide_available(device=None) -> bool:
    """Whether the wgmma configuration (``choose_wide``) can run: sm_90 exactly (wgmma needs sm_90a), and it
    has not failed on this process (``disable_wide``)."""
    if STATE["wide"] is False or not available(device):
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    return torch.cuda.get_device_capability(dev) == (9, 0)


def choose_wide(n: int, k: int, m: int, sms: int) -> dict:
    """The wgmma configuration for m rows (17 and more: wide decode batches and short prefills). x in blocks
    of up to 128 rows (grid z, the rows spread evenly over the blocks); one m64 tile per warpgroup (NT 1:
    128 weight rows per CTA, two CTAs per SM) for one row block, and for several when two would leave the
    GPU short of CTAs; else two (NT 2: 256 weight rows share every x chunk, halving x's L2 reads): NT 2 only
    when its n-blocks x row blocks reach 3/4 of the SMs (H200, nineteenth session: at 256-512 rows NT 1 was
    1.0-1.7x faster on weights of 4096-6144 rows, NT 2 1.25x faster on 14336 rows and up). Split-K by a cost
    model fitted on the H200 (bench/RESULTS.md, sixth session; within 2% of the best split on 28 shape x row
    cases): busy SM-time = max(1, CTAs / CTA slots) x steps per split x (2 + MG), plus 2 x SPLIT x MG x NT for
    the cluster reduction. At 65-128 rows where that split is 4 or more: two row blocks, split 2 (below).
    FP4RL_WIDE_NT (``WIDE_NT``, A/B) forces NT to 1 or 2 at every row count; the split stays the rule's."""
    if m < 1:
        raise ValueError(f"the wgmma configuration needs at least one row, got {m}")
    zb = -(-m // (8 * WIDE_MG))
    per_block = -(-m // zb)  # rows per block (spread evenly) ...
    mg = -(-per_block // 8)  # ... in groups of 8
    def tiles(zb: int) -> int:  # m64 tiles per warpgroup (NT does not change a row's arithmetic)
        return 2 if zb > 1 and -(-n // (WARPS * 2 * 16)) * zb * 4 >= 3 * sms else 1

    nt = tiles(zb)
    steps = k // 128
    # the split depends on the band of rows (1-32, 33-64, 65-128, 129+), not on m itself, so that a row's
    # result does not depend on how many rows of the same band come with it: 129+ are costed as 2 row blocks
    mg_band = 4 if m <= 32 else 8 if m <= 64 else 16
    zb_band = min(zb, 2)
    nt_band = tiles(zb_band)
    nblocks = -(-n // (WARPS * nt_band * 16))
    slots = (2 if nt_band == 1 else 1) * sms  # as fitted (MG 9-16 at NT 1: one CTA per SM, the fit took it)

    def cost(split: int) -> float:
        busy = max(1.0, nblocks * zb_band * split / slots) * -(-steps // split) * (2 + mg_band)
        return busy + (2 * split * mg_band * nt_band if split > 1 else 0)

    # several row blocks of up to 128 rows: the cluster reduction of 128-256 x 128 partials per CTA outweighs
    # more splits (NT 2, 4096x14336 at 256 rows: split 4 136.6 us, at 512 rows split 2 119.8 us; NT 1 was
    # measured at split 2 only)
    splits = (1, 2) if zb > 1 else (1, 2, 4, 8)
    split = min((s for s in splits if s == 1 or steps // s >= 2), key=cost)
    if 64 < m <= 128 and split >= 4:
        # 65-128 rows on weights of few n-blocks (N <= ~6144): two row blocks with split 2 rather than one
        # block split 4-8 ways; the reduction of a 128-row block's partials outweighs unpacking the weights
        # twice (H200, twentieth session: 4096x4096 at 128 rows 24.1 -> 17.6 us, 4096x6144 30.5 -> 23.6,
        # 4096x12288 55.3 -> 43.4, 4096x14336 60.0 -> 51.0). Decided by the band's split: row-invariant.
        zb, split = 2, 2
        per_block = -(-m // zb)
        mg = -(-per_block // 8)
        nt = tiles(zb)
    cfg = dict(NT=WIDE_NT or nt, MG=mg, SPLIT=split, DEPTH=2, XSTREAM=1, WGMMA=1, SWZ=1)
    # one warpgroup a CTA (WARPS 4: 64 weight rows, twice the CTAs at the same split: the same bits) where
    # the 8-warp grid of one row block is at most 2.5 CTAs a SM at 17-32 rows, at most two at 33-64 rows on
    # weights of few n-blocks (a third of the SMs); not timed past 64 rows. Fitted on three H100 sweeps (82
    # shape x row cases, 28 of them first out of sample; bench/RESULTS.md, fifty-sixth session: -16% to +1.8%
    # a call where taken).
    few = m <= 64 and zb == 1 and (2 * nblocks * split <= 5 * sms if mg_band <= 4
                                   else nblocks * split <= 2 * sms and 3 * nblocks <= sms)
    if (WIDE_WARPS or (4 if few else 8)) == 4 and cfg["NT"] == 1 and not WIDE_WS:
        cfg["WARPS"] = 4
    if WIDE_WS and cfg["NT"] * cfg["MG"] <= WS_MAX_ACC:  # (a ring as deep as the switch says, or as fits)
        cfg.update(WS=1, DEPTH=max([d for d in range(2, WIDE_WS + 1)
                                    if smem_bytes(dict(cfg, DEPTH=d), k, m) <= SMEM_MAX], default=2))
    if smem_bytes(cfg, k, m) > SMEM_MAX:  # cannot happen for the sizes above (<= 131 KB); kept as a guard
        raise ValueError(f"the wgmma configuration {cfg} does not fit shared memory")
    return cfg


def _narrow_from_env() -> int:
    """FP4RL_NARROW_WGMMA (A/B): the fewest rows (2-16) that ``choose_narrow`` gives the wgmma build; 0 = the
    mma.sync build at every row up to 16; unset or blank = NARROW_FROM_DEFAULT."""
    return _env_choice("FP4RL_NARROW_WGMMA", str(NARROW_FROM_DEFAULT), ("0",) + tuple(map(str, range(2, 17))),
                       "0 (mma.sync up to 16 rows) or 2..16 (the fewest rows the wgmma build takes)")


# from 2 rows: Qwen3-8B's decode step -1.4 / -2.8 / -6.0% at batch 4 / 8 / 16 with every 2-16-row GEMM at
# depth 2 (H100, bench/device_run188.sh); the 2-8-row rule below from the per-call sweep of 14 shapes in the
# same session (bench/wgmma_bits.py; bench/RESULTS.md, fifty-seventh session), not timed in a step yet
NARROW_FROM_DEFAULT = 2
NARROW_FROM = _narrow_from_env()


def choose_narrow(n: int, k: int, m: int, sms: int) -> dict:
    """The configuration of 1-16 rows on sm_90a: ``choose``'s mma.sync build, or from NARROW_FROM rows the
    wgmma build with one warpgroup a CTA (WARPS 4) at choose's split of K. Both add each 128-k step's eight
    k16 products in k order into FP32 and reduce the split in the same order, but the two instructions' adders
    do not round alike: a few elements in 10^4 differ by one bf16 ulp from the mma.sync build (and so from
    the row multiplied alone; H100, bench/wgmma_bits.py). A row's bits are the same at every row count of 2-16
    on the same build (tests/test_gemv_cuda_wide.py); where 2-8 rows stay on mma.sync, 8 and 9-16 rows differ
    by rounding. In the decode step against mma.sync at batch 4 / 8 / 16 (H100): Qwen3-8B -3.6 / -4.6 / -6.5%,
    Qwen3-4B and Qwen3-14B within +0.2% at 4, -2.0 / -2.6% at 8, -6.9 / -14.5% at 16 (bench/RESULTS.md,
    fifty-eighth session)."""
    cfg = choose(n, k, m, sms)
    if not NARROW_FROM or not max(2, NARROW_FROM) <= m <= 16:
        return cfg
    steps = -(-(k // 128) // ksplit(cfg))  # 128-k steps a CTA streams
    if m <= 8 and 4 < steps < 12:  # (one row group: mma.sync where the wgmma build at depth 2 or 3 was
        return cfg  # slower, 6144x4096 / 6144x2560 +1 to +8% a call; a 3-deep ring from 12 steps: -1 to -14%)
    depth = 3 if m <= 8 and steps >= 12 else 2
    wide = dict(NT=1, MG=cfg["MG"], SPLIT=ksplit(cfg), DEPTH=depth, XSTREAM=1, WGMMA=1, SWZ=1, WARPS=4)
    return wide if smem_bytes(wide, k, m) <= SMEM_LIMIT else cfg


def gu_silu_ok(cfg: dict, n: int) -> bool:
    """Whether `cfg`'s build can compute the dense MLP's SiLU(gate) * up in its epilogue (GU_SILU) for a fused
    gate | up weight of N = 2I rows: mma.sync or wgmma, not the warp-specialized build, with an even number of
    n-tiles a CTA whose half (the CTA's gate rows) divides I and, with a cluster split, is a multiple of
    SPLIT (each rank finishes whole gate / up pairs)."""
    if any(cfg.get(key) for key in ("WS", "GSR", "PRENORM", "SILU", "GROUPED")) or n % 32:
        return False  # (the builds the kernel's GU_SILU refuses to compile)
    tiles, half = block_rows(cfg) // 16, block_rows(cfg) // 2
    return tiles % 2 == 0 and (n // 2) % half == 0 and half % cfg["SPLIT"] == 0


def gsu_ok(cfg: dict) -> bool:
    """Whether a GU_SILU configuration has the GSU build (its row scales read before the stream): SPLIT 1 with
    x staged whole (the plain and in-CTA split epilogues), a thread's logical column one (the CTA's NB / 2
    gate rows divide its threads)."""
    return (cfg["SPLIT"] == 1 and not cfg.get("XSTREAM") and not cfg.get("WGMMA")
            and (warps(cfg) * 32) % (block_rows(cfg) // 2) == 0)


# where an RN_IN consumer makes rstd (gemv_mma16.cu; the same bits): 1 one warp a row from L2 while x lands,
# before the stream; 2 from the tile sums copied with x into shared memory, after the stream (FP4RL_RN_IN:
# A/B)
RN_IN_AT = _env_choice("FP4RL_RN_IN", "1", ("1", "2"), "1 (rstd before the stream) or 2 (after it)")


def rn_ok(cfg: dict, n: int, out: bool = True) -> bool:
    """Whether the configuration has the RN_OUT (out) / RN_IN build (the residual add + RMSNorm split over two
    GEMMs, fp4rl.kernels.resnorm) for an N-row weight: x staged whole (SPLIT 1: every dense Qwen3 GEMM at one
    row); RN_OUT the in-CTA split (KW > 1) with N a multiple of the CTA's rows (its epilogue: one column a
    thread, every 16-column tile whole in one CTA)."""
    if cfg["SPLIT"] != 1 or any(cfg.get(key) for key in ("XSTREAM", "WGMMA", "WS", "PRENORM", "SILU",
                                                         "GROUPED")):
        return False
    nb = block_rows(cfg)  # (RN_OUT: a thread's columns are t % NB, so NB must divide the CTA's threads)
    return not out or (cfg.get("KW", 1) > 1 and n % nb == 0 and (warps(cfg) * 32) % nb == 0)


def _rn_check(what: str, t: torch.Tensor, dtype, shape: tuple, device, fix: str) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous {dtype} {list(shape)} on {device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device} (contiguous: {t.is_contiguous()}); {fix}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _rn_args(m: int, n: int, k: int, y, rn_out, rn_in, dev) -> tuple[dict, list]:
    """The RN_OUT / RN_IN compile keys and the kernel's trailing arguments (gemv_mma16.cu RN_ARGS)."""
    if rn_out is not None:
        res, xo, nw, ss = rn_out
        if res.dtype != torch.bfloat16 or tuple(res.shape) != (m, n) or res.stride(1) != 1 \
                or res.device != dev:
            raise ValueError(f"rn_out: the residual must be bfloat16 [{m}, {n}] with unit column stride on "
                             f"{dev}, got {res.dtype} {list(res.shape)} stride {res.stride()} on "
                             f"{res.device}")
        _rn_check("rn_out: xo (the next residual)", xo, torch.bfloat16, (m, n), dev, "pass a new tensor")
        _rn_check("rn_out: the norm weight", nw, torch.bfloat16, (n,), dev, "pass the next RMSNorm's weight")
        _rn_check("rn_out: ss (the tile sums)", ss, torch.float32, (m, n // 16), dev, "pass a new tensor")
        if _overlap(xo, res) or _overlap(xo, y) or _overlap(ss, y) or _overlap(ss, xo):
            raise ValueError("rn_out: xo and ss must not overlap the residual, y or each other (the epilogue "
                             "writes x', xt and the tile sums side by side); pass new tensors")
        return {"RN_OUT": 1}, [res, xo, nw, ss, res.stride(0), 0, 0]
    if rn_in is not None:
        ss, eps = rn_in
        _rn_check("rn_in: ss (the producer's tile sums)", ss, torch.float32, (m, k // 16), dev,
                  "pass what the producer's rn_out wrote")
        if ss.data_ptr() % 16:  # (RN_IN 2 copies the rows with 16-byte cp.async)
            raise ValueError("rn_in: ss must be 16-byte aligned (a fresh tensor is); pass the producer's own")
        return {"RN_IN": RN_IN_AT}, [y, y, y, ss, 0, resnorm.f32_bits(1.0 / k), resnorm.f32_bits(eps)]
    return {}, []


def fits(n: int, k: int, m: int, sms: int) -> bool:
    """Whether the kernel takes an N x K weight with m rows on a GPU of `sms` SMs (shape and shared memory:
    very long K slices of many rows do not fit)."""
    if not supports(n, k) or not 1 <= m <= MAX_ROWS:
        return False
    try:
        choose(n, k, m, sms)
    except ValueError:
        return False
    return True


def smem_bytes(cfg: dict, k: int, m: int = 8) -> int:
    """Dynamic shared memory: x's K slice (its rows up to 8 MG and one zero row, 16 B pad per row; the whole
    K with KW) and one cp.async ring per warp (DEPTH stages x NT n-tiles x 1280 B), or the split-K partials
    if larger."""
    steps = k // 128
    per = -(-steps // cfg["SPLIT"])
    xrows = min(m, 8 * cfg["MG"]) + 1
    if cfg.get("WGMMA"):  # all 8 MG rows of each 128-k step, DEPTH stages, + 1 KB to align them to 1024 B
        xb = cfg["DEPTH"] * 8 * cfg["MG"] * 256 + 1024
        if cfg.get("ASH"):  # two A buffers: every warp's 16 weight rows x 128 k of bf16
            xb += 2 * WARPS * 16 * 256
    elif cfg.get("XSTREAM"):  # x in 128-k chunks through a ring of DEPTH stages
        xb = (cfg["DEPTH"] * xrows * 136 * 2 + 127) // 128 * 128
    else:  # (PRENORM: then hr's rows, as x's without the zero row, and the norm weight)
        pn = 0
        if cfg.get("PRENORM"):  # hr's rows (PRENORM 2: KTOP expert rows a row of x) and the norm weight
            rows = (xrows - 1) * (cfg.get("KTOP", 1) if cfg["PRENORM"] == 2 else 1)
            pn = rows * (per * 128 + 8) * 2 + 2 * k
        if cfg.get("RN_IN") == 2:  # the rows' tile sums (fp32 [rows, K / 16])
            pn += (xrows - 1) * (k // 16) * 4
        xb = (xrows * (per * 128 + 8) * 2 + pn + 127) // 128 * 128
    ring = warps(cfg) * cfg["DEPTH"] * cfg["NT"] * STAGE_BYTES
    # the split-K partials (rows padded by 4 floats): one set per CTA (cluster) or per k range (KW)
    parts = cfg.get("KW", 1) if cfg.get("KW", 1) > 1 else 1 if cfg["SPLIT"] > 1 or cfg.get("GU_SILU") else 0
    pb = parts * 8 * cfg["MG"] * (block_rows(cfg) + 4) * 4
    return max(xb + ring, pb)


def _wgmma_source(mg: int) -> str:
    """wgmma_m64k16 for n = 8 MG: d (4 MG fp32 per thread) += A (registers) x B (shared-memory descriptor)."""
    nd = 4 * mg
    outs = ", ".join(f"%{i}" for i in range(nd))
    ins = ", ".join(f"%{nd + i}" for i in range(4))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    return ("__device__ __forceinline__ void wgmma_m64k16(float* d, unsigned a0, unsigned a1, unsigned a2, "
            "unsigned a3, unsigned long long desc) {\n"
            f'  asm volatile("{{ .reg .pred p; setp.ne.b32 p, 1, 0; "\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{8 * mg}k16.f32.bf16.bf16 '
            f'{{{outs}}}, {{{ins}}}, %{nd + 4}, p, 1, 1, 0; }}"\n'
            f'      : {cons} : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc) : "memory");\n}}\n'
            # A from shared memory too (ASH): both operands K-major by descriptor
            "__device__ __forceinline__ void wgmma_m64k16_ss(float* d, unsigned long long da, "
            "unsigned long long db) {\n"
            f'  asm volatile("{{ .reg .pred p; setp.ne.b32 p, 1, 0; "\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{8 * mg}k16.f32.bf16.bf16 '
            f'{{{outs}}}, %{nd}, %{nd + 1}, p, 1, 1, 0, 0; }}"\n'
            f'      : {cons} : "l"(da), "l"(db) : "memory");\n}}\n')


def source(cfg: dict, wg_row: bool, xg_row: bool = False, grouped: bool = False) -> str:
    defs = {"TRIGGER": TRIGGER, **cfg, "WG_ROW": int(wg_row), "XG_ROW": int(xg_row), "GROUPED": int(grouped)}
    head = "".join(f"#define {key} {val}\n" for key, val in defs.items())
    if cfg.get("WGMMA"):
        head += _wgmma_source(cfg["MG"])
    cluster = f"__cluster_dims__(1, {cfg['SPLIT']}, 1)" if cfg["SPLIT"] > 1 else ""
    pn = prenorm.header() if cfg.get("PRENORM") or cfg.get("RN_OUT") or cfg.get("RN_IN") else ""
    return head + f"#define CLUSTER {cluster}\n" + pn + _SOURCE.read_text()


@functools.cache
def _kernel(key: tuple, device_index: int):
    """The compiled kernel for one configuration, per device (NVRTC builds for, and loads into, the current
    device's context)."""
    cfg = dict(key[:-3])
    src = source(cfg, *key[-3:])
    if device_index in STAMPS:  # diagnostics (fp4rl.benchmarks.stamps): every CTA appends its stamps there
        buf = STAMPS[device_index].data_ptr()
        src = f"#define STAMP_BUF {buf:#x}ull\n#define STAMP_AT {STAMP_AT}\n" + src
    with torch.cuda.device(device_index):
        if cfg.get("WGMMA"):  # wgmma needs the arch-specific target
            major, minor = torch.cuda.get_device_capability(device_index)
            return torch.cuda._compile_kernel(src, "w4a16_mma16", compute_capability=f"{major}{minor}a",
                                              nvcc_options=["-std=c++17"])
        return torch.cuda._compile_kernel(src, "w4a16_mma16", nvcc_options=["-std=c++17"])


def cuda_index(t) -> int:
    """The CUDA device index of a tensor or torch.device (the current device for a plain "cuda")."""
    d = getattr(t, "device", t)
    return d.index if d.index is not None else torch.cuda.current_device()


@functools.cache
def _plan(n: int, k: int, m: int, device_index: int) -> dict:
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return choose_narrow(n, k, m, sms) if wide_available(device_index) else choose(n, k, m, sms)


@functools.cache
def _plan_wide(n: int, k: int, m: int, device_index: int) -> dict:
    return choose_wide(n, k, m, torch.cuda.get_device_properties(device_index).multi_processor_count)


def launch_wide(x2: torch.Tensor, wc: Mma16Weight, global_scale: torch.Tensor, y: torch.Tensor,
                x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``launch`` with the wgmma configuration (any number of rows; sm_90a)."""
    return launch(x2, wc, global_scale, y, cfg=_plan_wide(wc.n, wc.k, x2.shape[0], cuda_index(x2)),
                  x_scale=x_scale)


_SMEM_SET: dict = {}  # (kernel, device) -> the largest dynamic shared memory size set on it


def _set_smem(kern, nbytes: int) -> None:
    if nbytes < 48 * 1024 or _SMEM_SET.get(id(kern), 0) >= nbytes:
        return
    _SMEM_SET[id(kern)] = nbytes
    if hasattr(kern, "set_shared_memory_config"):
        kern.set_shared_memory_config(nbytes)
        return
    lib = torch.cuda._utils._get_gpu_runtime_library()  # libcuda: cuFuncSetAttribute directly
    rc = lib.cuFuncSetAttribute(kern.func, 8, ctypes.c_int(nbytes))  # MAX_DYNAMIC_SHARED_SIZE_BYTES
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory = {nbytes}) failed: {rc}")


def _operands(x2, global_scale, x_scale, counts: tuple, what: str):
    """x2 with 16-byte rows for cp.async (copied if not), the global scales fp32 (one of `counts` values) and
    the per-row x scales (W4A4; else the global scales again, unused by the kernel)."""
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # a fresh allocation: 16-byte aligned
    g = global_scale.float().reshape(-1).contiguous()
    if g.numel() not in counts:
        raise ValueError(f"global_scale must have {what} values, got {g.numel()}")
    xg = g
    if x_scale is not None:
        xg = x_scale.float().reshape(-1).contiguous()
        if xg.numel() != x2.shape[0]:
            raise ValueError(f"x_scale must have one value per row of x ({x2.shape[0]}), got {xg.numel()}")
    return x2, g, xg


def _pdl_kind(cfg: dict, m: int) -> str:
    """The kind of a dense launch for fp4rl.kernels.pdl (which kinds carry PDL is decided there)."""
    return "wide" if cfg.get("WGMMA") else "gemv" if m == 1 else "mma"


def launch(x2: torch.Tensor, wc: Mma16Weight, global_scale: torch.Tensor, y: torch.Tensor,
           cfg: dict | None = None, x_scale: torch.Tensor | None = None,
           silu_out: bool = False, rn_out: tuple | None = None, rn_in: tuple | None = None) -> torch.Tensor:
    """y [M, N] bfloat16 = x2 [M, K] bfloat16 @ DQ(W).T with W's mma16 copy; global_scale fp32 [1]
    or [N]. x_scale fp32 [M] (W4A4 emulation): x2 is e2m1 * block_scale of an NVFP4 activation and row m's
    sum is multiplied by x_scale[m] and the weight's global scale before the one bfloat16 rounding.
    silu_out (W4A16; the weight a fused gate | up of N = 2I rows, where ``gu_silu_ok`` takes the
    configuration): y is [M, I] = fused.silu_mul(the plain launch's y)[0], bit for bit, made by the epilogue
    (GU_SILU) instead of a silu_mul launch; a configuration it does not take is a ValueError.
    rn_out = (r, xo, w, ss) (W4A16, where ``rn_ok`` takes the configuration; fp4rl.kernels.resnorm.produce):
    the epilogue writes the next residual xo = bf16(r + y) [M, N], y's place gets xt = bf16(w * xo) and ss
    [M, N / 16] fp32 the tiles' sums of squares. rn_in = (ss, eps) (W4A16, ``rn_ok``; silu_out too): y =
    bf16((acc g) * rstd) with rstd from the producer's ss [M, K / 16] (resnorm.rstd)."""
    m, k = x2.shape
    if k != wc.k:
        raise ValueError(f"x has K={k}, the weight {wc.k}")
    if x2.dtype != torch.bfloat16 or y.dtype != torch.bfloat16:
        raise TypeError("the mma16 kernel takes bfloat16 x and y")
    n_out = wc.n // 2 if silu_out else wc.n
    if tuple(y.shape) != (m, n_out) or y.stride(1) != 1 or y.device != x2.device:
        raise ValueError(f"y must be [{m}, {n_out}] with unit column stride on x's device, got "
                         f"{tuple(y.shape)} stride {y.stride()} on {y.device}")
    x2, g, xg = _operands(x2, global_scale, x_scale, (1, wc.n), f"1 or N={wc.n}")
    cfg = cfg or _plan(wc.n, wc.k, m, cuda_index(x2))
    if m > 8 * cfg["MG"] and not cfg.get("WGMMA"):
        raise ValueError(f"configuration {cfg} covers {8 * cfg['MG']} rows, x has {m}")
    zb = -(-m // (8 * cfg["MG"]))  # row blocks (WGMMA: any number; else 1)
    if silu_out:
        if x_scale is not None or not gu_silu_ok(cfg, wc.n):
            what = ("W4A4 (x_scale)" if x_scale is not None
                    else f"configuration {cfg} of a {wc.n}x{wc.k} weight")
            raise ValueError(f"silu_out: {what} has no GU_SILU build (gemv_cuda.gu_silu_ok); run the plain "
                             "launch and fused.silu_mul")
        cfg = {**cfg, "GU_SILU": 1}
        if GU_SILU_EARLY and g.numel() > 1 and gsu_ok(cfg):
            cfg["GSU"] = 1
    both = rn_out is not None and (silu_out or rn_in is not None)
    if (rn_out is not None or rn_in is not None) and (
            x_scale is not None or not rn_ok(cfg, wc.n, out=rn_out is not None) or both):
        w4a4 = "(W4A4) " if x_scale is not None else ""
        raise ValueError(f"rn_out / rn_in: configuration {cfg} of a {wc.n}x{wc.k} weight {w4a4}has no RN "
                         "build (gemv_cuda.rn_ok; rn_out without silu_out or rn_in); run add_rmsnorm and "
                         "the plain launch")
    rn_key, rn_tail = _rn_args(m, wc.n, wc.k, y, rn_out, rn_in, x2.device)
    cfg = {**cfg, **rn_key}
    dev = cuda_index(x2)
    key = cfg if silu_out else _row_scale_key(cfg, g.numel() > 1)
    kern = _kernel(tuple(sorted(key.items())) + (g.numel() > 1, x_scale is not None, False), dev)
    smem = smem_bytes(cfg, wc.k, m)
    nb = -(-wc.n // block_rows(cfg))
    args = [x2, wc.wt, wc.st, g, xg, y, m, wc.n, wc.k, x2.stride(0), y.stride(0), g, 0, g] + rn_tail
    ws = cfg.get("WS", 0)
    if ws:  # the warp-specialized build: one producer warp more, x through a tensor map
        args.append(tensor_map.x_tensor_map(x2, 8 * cfg["MG"]))
    with torch.cuda.device(dev):
        _set_smem(kern, smem)
        pdl.launch(kern, (nb, cfg["SPLIT"], zb), ((warps(cfg) + ws) * 32, 1, 1), args, smem,
                   torch.cuda.current_stream(dev), pdl.gemm_flag(dev, _pdl_kind(cfg, m)))
    STATE["ok"] = True
    return y

