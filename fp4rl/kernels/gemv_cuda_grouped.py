"""The routed experts' W4A16 GEMM on Hopper: gemv_mma16.cu's GROUPED builds over a stack of expert weights
(``relayout_stack``), one launch for all the experts a step routes to, graph-capturable (no host sync: each
CTA finds its expert and chunk of rows from the route's offsets). ``launch_grouped`` also gathers the tokens'
rows itself (``x_rows``) and computes the down projection's SiLU(gate) * up in its x staging (``x_silu``).
The kernel, its compile cache and the dense launches are fp4rl.kernels.gemv_cuda's."""

from __future__ import annotations

import functools
import os

import torch

from fp4rl.kernels import pdl
from fp4rl.kernels.gemv_cuda import (
    SMEM_CTA_RESERVED,
    SMEM_MAX,
    SMEM_SM,
    STATE,
    WARPS,
    Mma16Weight,
    _kernel,
    _operands,
    _row_scale_key,
    _set_smem,
    block_rows,
    deeper,
    in_cta_split,
    relayout,
    smem_bytes,
)

# ring depth (DEPTH: 128-k steps in flight per warp) of the routed experts' launches; 0 keeps the choice of
# ``choose_grouped`` (deeper was slower in the 30B step: bench/RESULTS.md, sampler, thirty-first session)
DEPTH_GROUPED = int(os.environ.get("FP4RL_MMA16_GDEPTH", "0"))
# Two dependent L2 round trips fewer before x (with gemv_cuda.ROW_SCALE_EARLY, the 30B W4A16 step 2.17 -> 2.15
# ms at batch 1, 4.25 at 8 either way; the same bits: bench/RESULTS.md, sampler, thirty-second session; each
# "0" for A/B). Every offset a CTA looks at for its expert read in one round trip, up to 32 x
# SLOT_TABLE_MAX experts (gemv_mma16.cu SLOTTABLE; more experts: 32 a trip after those)
SLOT_TABLE = os.environ.get("FP4RL_MMA16_SLOTTABLE", "1") != "0"
SLOT_TABLE_MAX = 8
# ... with the gather (x_rows) at one token: x's one row through a row stride of 0 instead of x_rows
ONE_TOKEN_VIEW = os.environ.get("FP4RL_MMA16_ONE_TOKEN", "1") != "0"
# the offsets and x_rows read by a volatile load, which no compiler moves above griddepcontrol.wait
# (gemv_mma16.cu LDVOL; the default builds' plain loads stay after it in their SASS today, which a CPU test
# checks; volatile: 30B W4A16 at batch 8 4.24 -> 4.29 ms, batch 1 unchanged, thirty-third session: off)
LD_VOLATILE = os.environ.get("FP4RL_MMA16_LDVOL", "0") != "0"
# CTAs per SM that choose_grouped's split of K may fill at few rows: 3 takes Qwen3-30B-A3B's one-token
# gate / up from 192 CTAs on 132 SMs (68 of them with two; a CTA sharing its SM streamed 4.32 us against
# 3.55 alone) to 384 over 4 warps' parts of K (30B W4A16 at batch 1 2.149 -> 2.121 ms; other bits, the KW 4
# sums: bench/RESULTS.md, sampler, thirty-third session); 2 for the previous plan
GROUPED_FILL = int(os.environ.get("FP4RL_MMA16_GFILL", "3"))
# EARLY, measured and removed: the experts' down projection finding its expert (reading the offsets) and
# issuing its first weight steps before griddepcontrol.wait, told by its caller that the gate / up before it
# had waited for the offsets' writer. Unsound: behind a route whose writes land late it read the previous
# routing's offsets (its GPU test failed on an H200, thirty-fifth session, and an H100, fiftieth); and slower:
# the 30B W4A16 step 2.134 -> 2.308 ms at batch 1 (bench/RESULTS.md, thirty-fifth session). Its switch
# FP4RL_MMA16_EARLY is refused rather than ignored.


def _refuse_early() -> None:
    raw = os.environ.get("FP4RL_MMA16_EARLY", "").strip()
    if raw not in ("", "0"):
        raise ValueError(f"FP4RL_MMA16_EARLY={raw!r}: the EARLY build of the experts' down projection was "
                         "removed (it read the routing's offsets before its wait and could see the previous "
                         "routing's, and it measured slower: bench/RESULTS.md, thirty-fifth session): "
                         "unset it")


_refuse_early()
# where the routed experts' launches without SiLU staging (the gate / up; also a down projection whose SiLU
# ran apart: past MMA16_SILU_MAX_TOKENS, W4A4) let the next kernel start (gemv_mma16.cu TRIGGER): None keeps
# gemv_cuda.TRIGGER (2: after the weight stream); 3: once past their wait, so that the down projection's CTAs
# start while the gate / up still streams (measured only with the removed EARLY build: slower, thirty-fifth
# session). 1 (at the start) is refused: it would let the down projection start before the offsets' writer
# finished.
_GT = os.environ.get("FP4RL_MMA16_GTRIGGER", "").strip()
if _GT not in ("", "0", "2", "3"):
    raise ValueError(f"FP4RL_MMA16_GTRIGGER={_GT}: use 0 (at exit), 2 (after the weight stream) or 3 (after "
                     "the wait); 1 would let the next launch read the offsets before their writer finished")
GATE_UP_TRIGGER = int(_GT) if _GT else None


def slot_table(e: int) -> int:
    """SLOTTABLE for a launch over e experts: the 32-expert words of the offsets read at once."""
    return min(SLOT_TABLE_MAX, -(-e // 32)) if SLOT_TABLE else 0


@functools.cache
def _plan_grouped(n: int, k: int, slots: int, device_index: int, mg: int = 1) -> dict:
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return choose_grouped(n, k, slots, sms, mg)


def relayout_stack(data: torch.Tensor, block_scale: torch.Tensor) -> Mma16Weight:
    """Experts' packed data [E, N, K/2] and block scales [E, N, K/16] -> one copy whose tiles are expert
    after expert (16-row tiles never straddle two experts: N % 16 == 0). n is N per expert, k is K."""
    if data.ndim != 3:
        raise ValueError(f"expert data must be [E, N, K/2], got {tuple(data.shape)}")
    e, n, kh = data.shape
    wc = relayout(data.reshape(e * n, kh), block_scale.reshape(e * n, -1))
    return Mma16Weight(wt=wc.wt, st=wc.st, n=n, k=wc.k)


def grouped_mg(m: int, experts: int) -> int:
    """Row groups of 8 per (expert, chunk) CTA for m sorted rows over `experts` experts: 8-row chunks up to 8
    rows per expert on average, 16 up to 16, then 32 (fewer re-reads of each expert's weights; measured on
    the H200 at 64-512 tokens of Qwen3-30B-A3B's 128 experts, bench/gpu_kernels.md, twenty-third session)."""
    per = m / max(experts, 1)
    return 1 if per <= 8 else 2 if per <= 16 else 4


def choose_grouped(n: int, k: int, slots: int, sms: int, mg: int = 1) -> dict:
    """Configuration for about `slots` busy (expert, chunk) CTAs of an N x K weight, each chunk 8 x `mg` rows
    (decode batches put a few rows on each expert; an expert with more gets more chunks). An `mg` whose
    x slice does not fit shared memory falls back to fewer row groups. The split of K fills about one wave
    of GROUPED_FILL CTAs per SM, or of fewer (down to 2) where that many do not fit an SM's shared memory."""
    for fill in range(GROUPED_FILL, 2, -1):
        cfg = _grouped_plan(n, k, slots, sms, mg, fill)
        ctas = -(-n // block_rows(cfg)) * slots * cfg["SPLIT"]
        if ctas <= min(SMEM_SM // (smem_bytes(cfg, k, 8 * cfg["MG"]) + SMEM_CTA_RESERVED), fill) * sms:
            return cfg
    return _grouped_plan(n, k, slots, sms, mg, 2)


def _grouped_plan(n: int, k: int, slots: int, sms: int, mg: int, fill: int) -> dict:
    nblocks = -(-n // (WARPS * 16)) * slots
    steps = k // 128
    split = 1  # fill about one wave of `fill` CTAs per SM, >= 2 steps per split
    while split < 8 and nblocks * split * 2 <= fill * sms and steps // (split * 2) >= 2:
        split *= 2
    cfg = dict(NT=1, MG=mg, SPLIT=split, DEPTH=2)
    while cfg["MG"] > 1 and smem_bytes(cfg, k, 8 * cfg["MG"]) > SMEM_MAX:
        cfg["MG"] //= 2
    if smem_bytes(cfg, k, 8) > SMEM_MAX:
        raise ValueError(f"8 rows of K={k} do not fit the mma16 kernel's shared memory")
    return deeper(in_cta_split(cfg, k, 8 * cfg["MG"]), DEPTH_GROUPED, k, 8 * cfg["MG"])


def launch_grouped(x2: torch.Tensor, wc: Mma16Weight, global_scale: torch.Tensor, offsets: torch.Tensor,
                   y: torch.Tensor, x_scale: torch.Tensor | None = None,
                   x_rows: torch.Tensor | None = None, x_silu: bool = False,
                   cfg: dict | None = None) -> torch.Tensor:
    """Routed experts: y [M, N] = x2 [M, K] (rows sorted by expert; offsets int32 [E + 1], rows
    offsets[e]:offsets[e+1] go to expert e) @ DQ(W_e).T with the stacked copy of `relayout_stack`.
    global_scale fp32 [E, N] (per output row) or [E] (per expert). x_scale fp32 [M]: W4A4 as in `launch`.
    x_rows int32 [M] (W4A16 only): x2 [T, K] holds the tokens and sorted row r reads x2[x_rows[r]], i.e.
    y = (x2.index_select(0, x_rows)) @ ..., with the gather done by the kernel's x staging (bit-identical:
    the same rows reach the same arithmetic).
    x_silu (W4A16, without x_rows): x2 [M, 2K] is the experts' gate | up (gate in columns [0, K), up in
    [K, 2K), K = wc.k; any row stride) and y = silu_mul(x2) @ ..., the MoE down projection with
    fused.silu_mul(x2)[0] = bf16(bf16(silu(gate)) * up) computed by the kernel's x staging (bit-identical to
    silu_mul then this launch: fused.silu_mul's arithmetic, libdevice expf and IEEE division).
    No host sync: each CTA finds its (expert, chunk of 8 x MG rows) from the offsets (graph-capturable; any
    routing: an expert with r rows takes ceil(r / (8 MG)) chunks, each streaming its weights; MG from the
    average rows per expert, ``grouped_mg``).
    cfg: a configuration other than ``choose_grouped``'s (benchmarks)."""
    if x2.ndim != 2:
        raise ValueError(f"x2 must be 2-D [M, K], got {tuple(x2.shape)}")
    m, k = x2.shape
    if x_silu:
        if x_scale is not None:
            raise ValueError("x_silu (SiLU(gate) * up in the x staging) is for W4A16; W4A4 quantizes "
                             "silu_mul's output first")
        if x_rows is not None:
            raise ValueError("x_silu does not take x_rows: the down projection's gate | up rows are already "
                             "the sorted rows")
        if k != 2 * wc.k:
            raise ValueError(f"x_silu: x2 must be gate | up [M, 2K] with K={wc.k} (the weight's), got "
                             f"{tuple(x2.shape)}")
        k = wc.k
    if x_rows is not None:
        if x_scale is not None:
            raise ValueError("x_rows (the gather) is for W4A16; W4A4 gathers its quantized rows first")
        if x_rows.dtype != torch.int32 or x_rows.ndim != 1 or x_rows.device != x2.device:
            raise TypeError(f"x_rows must be int32 [M] on x's device, got {x_rows.dtype} "
                            f"{tuple(x_rows.shape)} on {x_rows.device}")
        m = x_rows.numel()
        if ONE_TOKEN_VIEW and x2.shape[0] == 1:
            # one token: every sorted row is row 0, so read it through a row stride of 0 (the plain build)
            # instead of loading x_rows first, one dependent round trip less; the same rows, the same bits
            x2, x_rows = x2.expand(m, x2.shape[1]), None
    e = offsets.numel() - 1
    if k != wc.k or wc.wt.shape[0] != e * (wc.n // 16):
        raise ValueError(f"x [*, {k}] / offsets for {e} experts do not match the copy "
                         f"({wc.wt.shape[0] * 16 // max(wc.n, 1)} experts of {wc.n}x{wc.k})")
    if x2.dtype != torch.bfloat16 or y.dtype != torch.bfloat16 or offsets.dtype != torch.int32:
        raise TypeError("the grouped mma16 kernel takes bfloat16 x and y and int32 offsets")
    if tuple(y.shape) != (m, wc.n) or y.stride(1) != 1:
        raise ValueError(f"y must be [{m}, {wc.n}] with unit column stride, got {tuple(y.shape)}")
    x2, g, xg = _operands(x2, global_scale, x_scale, (e, e * wc.n), f"E={e} or E*N={e * wc.n}")
    if m == 0:
        return y
    dev = x2.device.index if x2.device.index is not None else torch.cuda.current_device()
    cfg = cfg or _plan_grouped(wc.n, wc.k, min(e, m), dev, grouped_mg(m, e))
    slots = min(e, m) + -(-m // (8 * cfg["MG"]))  # >= sum over experts of ceil(rows / chunk rows)
    key = {**cfg, "GATHER": 1} if x_rows is not None else {**cfg, "SILU": 1} if x_silu else cfg
    table = slot_table(e)
    if table and "SLOTTABLE" not in key:
        key = {**key, "SLOTTABLE": table}
    if LD_VOLATILE:
        key = {**key, "LDVOL": 1}
    if GATE_UP_TRIGGER is not None and not x_silu:
        key = {**key, "TRIGGER": GATE_UP_TRIGGER}
    key = _row_scale_key(key, g.numel() > e)
    kern = _kernel(tuple(sorted(key.items())) + (g.numel() > e, x_scale is not None, True), dev)
    smem = smem_bytes(cfg, wc.k, 8 * cfg["MG"])
    nb = -(-wc.n // block_rows(cfg))
    offs = offsets.contiguous()
    rows = offs if x_rows is None else x_rows.contiguous()
    with torch.cuda.device(dev):
        _set_smem(kern, smem)
        pdl.launch(kern, (nb, cfg["SPLIT"], slots), (WARPS * 32, 1, 1),
                   [x2, wc.wt, wc.st, g, xg, y, m, wc.n, wc.k, x2.stride(0), y.stride(0), offs, e, rows],
                   smem,
                   torch.cuda.current_stream(dev), pdl.gemm_flag(dev, "grouped"))
    STATE["ok"] = True
    return y
