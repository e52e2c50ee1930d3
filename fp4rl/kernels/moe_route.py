"""MoE routing and combine of the decode step in two kernels (fp4rl.gpu_experts.KernelMoeBlock).

At decode batch sizes the routed experts' grouped GEMMs are a small part of an MoE layer: the torch route
(softmax, top-k with a sorted output, the top-k normalization, the cast), the stable argsort that groups the
(token, slot) pairs by expert with searchsorted for the expert offsets, the gather index, and the weighted
combine back in token order (index_copy, casts, product, sum) are ~15 launches per layer. On Qwen3-30B-A3B
they took 50-90 us per layer on an H200 (bench/RESULTS.md, ninth session), more than the expert GEMMs at
batch 1-8, in BF16 and NVFP4 alike. Here they are:

- ``route(logits, top_k, norm)``: one program. Softmax in fp32 over the E router logits of every token, the
  top_k by repeated arg-max (descending, ties to the lower expert id), the weights p_k (or p_k / sum_K p
  when norm) in the logits' dtype, and the counting sort of the T * top_k pairs by expert, stable in pair
  order p = t * top_k + j: offsets [E + 1] (the start of each expert's rows), ``rows`` (the token of each
  sorted row: what the grouped GEMM's x gathers) and ``pos`` (the sorted row of each pair). The sort is
  two counts per pair, #{q : e_q < e_p} + #{q < p : e_q = e_p}, over blocks of pairs read back from idx
  (or, REGS, over all pairs at once from the ids the program holds): P^2 comparisons, nothing for P <=
  MAX_PAIRS.
- ``combine(d, pos, weight, top_k)``: y[t] = sum_j w[t, j] * d[pos[t * top_k + j]] in fp32, j in order, each
  product rounded to fp32 before the add (no FMA), one rounding to d's dtype: what
  ``(d_in_pair_order.float() * w.float()[..., None]).sum(1).to(dtype)`` computes with a sequential sum.

Arithmetic against SparseMoeBlock.route (torch): the softmax is exp(l - max) / sum with libdevice's expf on
the GPU (torch's CUDA softmax uses expf; the interpreter uses numpy's exp) and the sum over E in another
order than torch's reduction, so a probability can differ in its last fp32 bit; the expert set is the same
unless two probabilities tie or sit within that bit of each other (then either choice is a valid top-k,
and the sampler records whichever it used for routing replay). Weights: within one ulp of the dtype.
Tests: tests/test_moe_route.py (interpreter on CPU, and on CUDA under the gpu marker).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import COMPILED, INTERPRET, dot_acc
from fp4rl.kernels.fused import _bf16, _exp, _launch_opts, _libdevice_for, tlcuda

# T * top_k of the one-program route (Qwen3-30B-A3B at 64 tokens: 512, measured up to there); larger batches
# take the torch route (FP4RL_MOE_ROUTE_PAIRS=<pairs>: another bound, for measuring past it)
MAX_PAIRS = int(os.environ.get("FP4RL_MOE_ROUTE_PAIRS", "512"))
MAX_EXPERTS = 512
MAX_TILE = 32768  # tokens x experts (both to a power of two) in the program's softmax / top-k tile


def fits(tokens: int, top_k: int, experts: int) -> bool:
    """Whether ``route`` takes this many tokens (the caller falls back to the torch route otherwise)."""
    tile = max(2, triton.next_power_of_2(tokens)) * max(16, triton.next_power_of_2(experts))
    return 1 <= tokens * top_k <= MAX_PAIRS and 1 <= top_k <= experts <= MAX_EXPERTS and tile <= MAX_TILE


@triton.jit
def _rounded(v, BF16: tl.constexpr):
    """v (float32) as the stored dtype will round it: RNE to bfloat16 done in integers when BF16 (the CPU
    interpreter's cast truncates), else unchanged."""
    if BF16:
        return _bf16(v)
    else:
        return v


@triton.jit
def _pick(q, v, bad, e, E, BE: tl.constexpr):
    """The expert each row takes next: the lowest id among its maxima v; in a NaN row (a NaN or infinite
    router logit makes every probability NaN) the lowest id not taken yet (taken ones hold -1), so its K ids
    stay distinct and in range, as torch.topk's. `bad` marks those rows (the row maximum of a NaN row is
    not to be trusted: a max may skip NaN operands)."""
    cand = tl.where(bad[:, None], (q != -1.0) & (e[None, :] < E), q == v[:, None])
    return tl.minimum(tl.min(tl.where(cand, e[None, :], BE), 1), E - 1)


@triton.jit
def _route_body(logit_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E, stride_l,
                K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
                NORM: tl.constexpr, LIBDEVICE: tl.constexpr, W_BF16: tl.constexpr, CG: tl.constexpr,
                KEYED: tl.constexpr, KP: tl.constexpr, REGS: tl.constexpr):
    """The route of all T tokens by one program (see the module docstring), from the logits in memory. CG:
    they were written by other programs of this grid (router_route): read them past the L1 cache."""
    t = tl.arange(0, BT)
    e = tl.arange(0, BE)
    tm = t < T
    em = e < E
    lptr = logit_ptr + t[:, None] * stride_l + e[None, :]
    if CG:
        raw = tl.load(lptr, mask=tm[:, None] & em[None, :], other=0.0, cache_modifier=".cg")
    else:
        raw = tl.load(lptr, mask=tm[:, None] & em[None, :], other=0.0)
    _route_tile(raw.to(tl.float32), idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E,
                K, BT, BE, BP, BQ, NORM, LIBDEVICE, W_BF16, KEYED, KP, REGS)


@triton.jit
def _route_tile(raw, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E,
                K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
                NORM: tl.constexpr, LIBDEVICE: tl.constexpr, W_BF16: tl.constexpr,
                KEYED: tl.constexpr, KP: tl.constexpr, REGS: tl.constexpr):
    """The route of all T tokens from their logits raw [BT, BE] (float32, the values the logits' dtype holds;
    rows >= T and columns >= E anything). KEYED: the top-k in K rounds of one reduction each over packed
    (probability bits, reversed expert id) keys (KEYED_TOPK); else 2 K rounds of two (the chosen values' sum
    first, then the same choices again for the stores): the same outputs. REGS (by default where BT * KP <=
    REGS_PAIRS): the counting sort from the chosen ids as the program holds them, over all pairs at once,
    instead of reading them back from idx in blocks of BQ pairs (a global round trip): the same outputs."""
    t = tl.arange(0, BT)
    e = tl.arange(0, BE)
    tm = t < T
    em = e < E
    kk = tl.arange(0, KP)
    ids = tl.zeros([BT, KP], dtype=tl.int32)  # (REGS) the chosen experts, (token, slot)
    lg = tl.where(em[None, :], raw, float("-inf"))
    mx = tl.max(lg, 1)
    ex = _exp(lg - mx[:, None], LIBDEVICE)
    p = tl.math.div_rn(ex, tl.sum(ex, 1)[:, None])  # [BT, BE], 0 past E (IEEE division, as torch)
    # top-k by repeated arg-max: first the sum of the chosen probabilities, then (same choices) the stores
    bad = tl.sum((p != p).to(tl.int32), 1) > 0  # NaN rows (a NaN or infinite logit)
    total = tl.zeros([BT], dtype=tl.float32)
    if KEYED:
        # key = probability bits (a non-negative float orders as its bits) above the reversed id (ties to the
        # lower id); a NaN row's keys are its ids alone (the lowest id not taken, as _pick); -1: past E, taken
        bits = tl.where(bad[:, None], 0, p.to(tl.int32, bitcast=True)).to(tl.int64)
        key = tl.where(e[None, :] < E, (bits << 32) | (BE - 1 - e[None, :]).to(tl.int64), -1)
        vals = tl.zeros([BT, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            km = tl.max(key, 1)
            i = (BE - 1 - (km & (BE - 1))).to(tl.int32)
            v = (km >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            total += v
            key = tl.where(e[None, :] == i[:, None], -1, key)
            vals = tl.where(kk[None, :] == j, v[:, None], vals)
            ids = tl.where(kk[None, :] == j, i[:, None], ids)
            tl.store(idx_ptr + t * K + j, i.to(tl.int64), mask=tm)
        w = tl.math.div_rn(vals, total[:, None]) if NORM else vals
        w = tl.where(bad[:, None], float("nan"), w)
        tl.store(w_ptr + t[:, None] * K + kk[None, :], _rounded(w, W_BF16).to(w_ptr.dtype.element_ty),
                 mask=tm[:, None] & (kk[None, :] < K))
    else:
        q = p
        for _j in tl.static_range(K):
            v = tl.max(q, 1)
            i = _pick(q, v, bad, e, E, BE)
            total += v
            q = tl.where(e[None, :] == i[:, None], -1.0, q)
        q = p
        for j in tl.static_range(K):
            v = tl.max(q, 1)
            i = _pick(q, v, bad, e, E, BE)
            q = tl.where(e[None, :] == i[:, None], -1.0, q)
            w = tl.math.div_rn(v, total) if NORM else v
            w = tl.where(bad, float("nan"), w)
            ids = tl.where(kk[None, :] == j, i[:, None], ids)
            tl.store(idx_ptr + t * K + j, i.to(tl.int64), mask=tm)
            tl.store(w_ptr + t * K + j, _rounded(w, W_BF16).to(w_ptr.dtype.element_ty), mask=tm)
    P = T * K
    if REGS:
        # counting sort of the P = T * K pairs by expert, stable in pair order, over all pairs at once: pair
        # f = t KP + j of the flattened (token, slot) tile is pair p = t K + j when t < T and j < K
        f = tl.arange(0, BT * KP)
        fv = ((f // KP) < T) & ((f % KP) < K)
        fp = (f // KP) * K + f % KP
        ef = tl.where(fv, tl.reshape(ids, [BT * KP]), E)  # past the pairs: E, after every real expert
        less = (ef[None, :] < ef[:, None]) | ((ef[None, :] == ef[:, None]) & (fp[None, :] < fp[:, None]))
        before = tl.sum((less & fv[None, :]).to(tl.int32), 1)
        tl.store(pos_ptr + fp, before, mask=fv)
        tl.store(rows_ptr + before, (f // KP).to(tl.int32), mask=fv)
        xo = tl.arange(0, BE)
        cnt = tl.sum(((ef[None, :] < xo[:, None]) & fv[None, :]).to(tl.int32), 1)
        tl.store(offs_ptr + xo, cnt, mask=xo < E)
        tl.store(offs_ptr + E, P)
    else:
        tl.debug_barrier()  # the ids just stored are read back below by other threads of the program
        _sort_from_idx(idx_ptr, rows_ptr, pos_ptr, offs_ptr, P, E, K, BE, BP, BQ)


@triton.jit
def _sort_from_idx(idx_ptr, rows_ptr, pos_ptr, offs_ptr, P, E, K: tl.constexpr, BE: tl.constexpr,
                   BP: tl.constexpr, BQ: tl.constexpr):
    """The counting sort of the P pairs by expert, stable in pair order, from the ids stored in idx."""
    pp = tl.arange(0, BP)
    pm = pp < P
    ep = tl.load(idx_ptr + pp, mask=pm, other=E).to(tl.int32)  # past P: E, after every real expert
    before = tl.zeros([BP], dtype=tl.int32)
    for q0 in range(0, P, BQ):
        qq = q0 + tl.arange(0, BQ)
        eq = tl.load(idx_ptr + qq, mask=qq < P, other=E).to(tl.int32)
        less = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (qq[None, :] < pp[:, None]))
        before += tl.sum(less.to(tl.int32), 1)
    tl.store(pos_ptr + pp, before, mask=pm)
    tl.store(rows_ptr + before, (pp // K).to(tl.int32), mask=pm)
    # offsets[x] = #{q : e_q < x}, x = 0..E (offsets[E] = P)
    xo = tl.arange(0, BE)
    cnt = tl.zeros([BE], dtype=tl.int32)
    for q0 in range(0, P, BQ):
        qq = q0 + tl.arange(0, BQ)
        eq = tl.load(idx_ptr + qq, mask=qq < P, other=E).to(tl.int32)
        cnt += tl.sum((eq[None, :] < xo[:, None]).to(tl.int32), 1)
    tl.store(offs_ptr + xo, cnt, mask=xo < E)
    tl.store(offs_ptr + E, P)


@triton.jit
def _route_kernel(logit_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E, stride_l,
                  K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
                  NORM: tl.constexpr, LIBDEVICE: tl.constexpr, W_BF16: tl.constexpr, KEYED: tl.constexpr,
                  KP: tl.constexpr, REGS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    _route_body(logit_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E, stride_l,
                K, BT, BE, BP, BQ, NORM, LIBDEVICE, W_BF16, False, KEYED, KP, REGS)


@triton.jit
def _router_route_kernel(x_ptr, wr_ptr, logit_ptr, part_ptr, lock_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr,
                         offs_ptr, T, E, H, HC, stride_x, stride_wr,
                         K: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr,
                         BQ: tl.constexpr, BES: tl.constexpr, BH: tl.constexpr, SPLIT_H: tl.constexpr,
                         NORM: tl.constexpr, LIBDEVICE: tl.constexpr, W_BF16: tl.constexpr,
                         INTERP: tl.constexpr, KEYED: tl.constexpr, KP: tl.constexpr, REGS: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (p, s): the router sums of experts [p BES, p BES + BES) over hidden columns [s HC, s HC + HC)
    for all T tokens (x [T, H] @ Wr.T, fp32 sums of exact bf16 products). One column slice (SPLIT_H 1): the
    logits, rounded once to bf16 as F.linear's output, published past L1. Several: the fp32 partial sums,
    published past L1, and the last program adds them up in slice order and rounds once. The last program to
    finish (a counter, reset by it) then routes all tokens from the logits (_route_body; REGS with several
    slices: from its sums as it holds them, _route_tile)."""
    if PDL:
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    ex = pid * BES + tl.arange(0, BES)
    exm = ex < E
    h_end = tl.minimum(H, (sid + 1) * HC)
    for t0 in range(0, T, 16):
        tt = t0 + tl.arange(0, 16)
        ttm = tt < T
        acc = tl.zeros((16, BES), tl.float32)
        for h0 in range(sid * HC, h_end, BH):
            hh = h0 + tl.arange(0, BH)
            hm = hh < h_end
            xt = tl.load(x_ptr + tt[:, None].to(tl.int64) * stride_x + hh[None, :],
                         mask=ttm[:, None] & hm[None, :], other=0.0)
            wt = tl.load(wr_ptr + ex[:, None].to(tl.int64) * stride_wr + hh[None, :],
                         mask=exm[:, None] & hm[None, :], other=0.0)
            acc = dot_acc(xt, tl.trans(wt), acc, INTERP)
        if SPLIT_H == 1:
            tl.store(logit_ptr + tt[:, None] * E + ex[None, :], _bf16(acc).to(logit_ptr.dtype.element_ty),
                     mask=ttm[:, None] & exm[None, :], cache_modifier=".cg")
        else:
            tl.store(part_ptr + (sid * T + tt[:, None]) * E + ex[None, :], acc,
                     mask=ttm[:, None] & exm[None, :], cache_modifier=".cg")
    tl.debug_barrier()  # every thread's sums are stored before the counter moves
    done = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        if SPLIT_H > 1:  # the logits: the slices' partial sums in slice order, one rounding
            t = tl.arange(0, BT)
            e = tl.arange(0, BE)
            m = (t[:, None] < T) & (e[None, :] < E)
            tot = tl.zeros((BT, BE), tl.float32)
            for s in range(0, SPLIT_H):
                tot += tl.load(part_ptr + (s * T + t[:, None]) * E + e[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            lg = _bf16(tot)  # the bf16 logits as float32: what they load back as
            tl.store(logit_ptr + t[:, None] * E + e[None, :], lg.to(logit_ptr.dtype.element_ty),
                     mask=m, cache_modifier=".cg")
            if REGS:  # routed from the sums as held (no round trip through the logits just stored)
                _route_tile(lg, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E,
                            K, BT, BE, BP, BQ, NORM, LIBDEVICE, W_BF16, KEYED, KP, REGS)
            else:
                tl.debug_barrier()  # the logits just stored are read back below by other threads
                _route_body(logit_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E, E,
                            K, BT, BE, BP, BQ, NORM, LIBDEVICE, W_BF16, True, KEYED, KP, REGS)
        else:  # one slice: the programs stored the logits themselves
            _route_body(logit_ptr, idx_ptr, w_ptr, rows_ptr, pos_ptr, offs_ptr, T, E, E,
                        K, BT, BE, BP, BQ, NORM, LIBDEVICE, W_BF16, True, KEYED, KP, REGS)
        tl.atomic_xchg(lock_ptr, 0)  # ready for the next call


@triton.jit
def _combine_kernel(d_ptr, pos_ptr, w_ptr, y_ptr, H, stride_d, stride_y,
                    K: tl.constexpr, BH: tl.constexpr, Y_BF16: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(pos_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += w * tl.load(d_ptr + r * stride_d + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * stride_y + h, _rounded(acc, Y_BF16).to(y_ptr.dtype.element_ty), mask=hm)


# The one route program's warps (2 up to 16 pairs, else 8) and the pairs compared per step of its sort loops:
# measured best on an H200 at E 128, top 8, 1 / 8 / 32 tokens: 3.3 / 3.9 / 11.2 us against the torch route's
# 31.4 / 39.3 / 60.8 (bench/moe_route_bench.py, bench/RESULTS.md, ninth session).
ROUTE_WARPS = (2, 8)
ROUTE_BQ = 32
# The top-k: K rounds of one int64 max over (probability bits << 32 | reversed expert id) keys, instead of 2 K
# rounds of a max and a min (FP4RL_MOE_ROUTE_KEYED=0, for A/B; the same outputs).
KEYED_TOPK = os.environ.get("FP4RL_MOE_ROUTE_KEYED", "1") != "0"
# The counting sort from the chosen ids as the route program holds them, all pairs compared at once, where the
# (token, slot) tile has at most this many cells (0: always from idx in blocks of BQ pairs; the same outputs):
# no round trip through idx (nor, in router_route with column slices, through the logits); its all-pairs
# reductions have barriers of their own (offline SASS, Triton 3.6, sm_90: 81 against 70 at 8 tokens of top-8).
# Off until timed on a GPU (`python3 bench/moe_route_bench.py regs`, twenty-ninth session): e.g.
# FP4RL_MOE_ROUTE_REGS=16 takes it at 1-2 tokens of top-8. At most REGS_MAX cells (a cells^2 comparison).
REGS_PAIRS = int(os.environ.get("FP4RL_MOE_ROUTE_REGS", "0"))
REGS_MAX = 128


def _regs(t: int, top_k: int, regs: bool | None) -> bool:
    """Whether the route of t tokens' top_k takes the sort from registers: `regs` if given (within REGS_MAX
    cells), else by REGS_PAIRS."""
    cells = max(2, triton.next_power_of_2(t)) * triton.next_power_of_2(top_k)
    if regs and cells > REGS_MAX:
        raise ValueError(f"route: the sort from registers compares all {cells} (token, slot) cells "
                         f"pairwise; it takes at most {REGS_MAX} (pass regs=None or False for {t} tokens of "
                         f"top {top_k})")
    return cells <= min(REGS_PAIRS, REGS_MAX) if regs is None else bool(regs)


def _route_outputs(t: int, top_k: int, e: int, weight_dtype: torch.dtype, dev):
    """The route's outputs, uninitialized: idx [t, k] int64, w [t, k], rows and pos [t k] int32, offsets."""
    idx = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    w = torch.empty(t, top_k, dtype=weight_dtype, device=dev)
    rows, pos = (torch.empty(t * top_k, dtype=torch.int32, device=dev) for _ in range(2))
    return idx, w, rows, pos, torch.empty(e + 1, dtype=torch.int32, device=dev)


def route(logits: torch.Tensor, top_k: int, norm: bool, weight_dtype: torch.dtype | None = None, *,
          num_warps: int | None = None, bq: int | None = None, keyed: bool | None = None,
          regs: bool | None = None):
    """logits [T, E] (router output, any float dtype) -> (topk_idx [T, k] int64, topk_weight [T, k] in
    weight_dtype (default logits' dtype), rows [T k] int32, pos [T k] int32, offsets [E + 1] int32); see the
    module docstring. keyed: the top-k's form (default KEYED_TOPK); regs: the sort from the ids in registers
    (default: up to REGS_PAIRS cells); the same outputs either way."""
    if logits.ndim != 2 or logits.stride(-1) != 1:
        raise ValueError(f"route: logits must be [T, E] with unit column stride, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    t, e = logits.shape
    if not fits(t, top_k, e):
        raise ValueError(f"route: {t} tokens x top_k {top_k} over {e} experts is outside the one-program "
                         f"kernel (T * top_k <= {MAX_PAIRS}, top_k <= E <= {MAX_EXPERTS}, T x E <= "
                         f"{MAX_TILE} to powers of two); use the torch route (SparseMoeBlock.route)")
    dev = logits.device
    idx, w, rows, pos, offsets = _route_outputs(t, top_k, e, weight_dtype or logits.dtype, dev)
    bp = max(16, triton.next_power_of_2(t * top_k))
    bq = bq or (16 if INTERPRET else ROUTE_BQ)
    COMPILED["moe route"] = _route_kernel[(1,)](
        logits, idx, w, rows, pos, offsets, t, e, logits.stride(0),
        K=top_k, BT=max(2, triton.next_power_of_2(t)), BE=max(16, triton.next_power_of_2(e)), BP=bp, BQ=bq,
        NORM=bool(norm), LIBDEVICE=_libdevice_for(dev), W_BF16=w.dtype == torch.bfloat16,
        KEYED=KEYED_TOPK if keyed is None else bool(keyed), KP=triton.next_power_of_2(top_k),
        REGS=_regs(t, top_k, regs), num_warps=num_warps or ROUTE_WARPS[t * top_k > 16],
        enable_fp_fusion=False, **_launch_opts(dev))
    return idx, w, rows, pos, offsets


ROUTER_BES = 16  # experts per program of router_route (E 128: 8 per column slice)
ROUTER_BH = 256  # hidden columns per step of its sums
ROUTER_HC = 256  # hidden columns per program (H 2048: 8 column slices, 64 programs at E 128)
ROUTER_WARPS = int(os.environ.get("FP4RL_MOE_ROUTER_WARPS", "4"))  # (FP4RL_MOE_ROUTER_WARPS=<n>: for A/B)
_LOCKS: dict = {}  # router_route's counter per device (back to zero after every call)


def router_route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm: bool,
                 weight_dtype: torch.dtype | None = None, *, num_warps: int | None = None,
                 bes: int | None = None, bh: int | None = None, hc: int | None = None,
                 lock: torch.Tensor | None = None, keyed: bool | None = None, regs: bool | None = None):
    """The router and the route in one launch: logits = x [T, H] @ gate_weight [E, H].T (bfloat16, as
    F.linear's output: fp32 sums of the exact products in another order than cuBLAS, so a logit can differ in
    its last bf16 bit), then `route(logits, ...)` by the grid's last program. Returns (logits [T, E], idx, w,
    rows, pos, offsets) as `route`. The grid: E / bes expert slices x H / hc column slices (partial sums
    added in slice order by the last program). num_warps, bes (experts per program, >= 16), bh (hidden
    columns per step), hc (hidden columns per program, a multiple of bh; >= H: one slice): tuning
    (bench/moe_route_bench.py). No host sync. lock: the int32 [1] zero counter the grid's programs count on
    (back to zero after each call); calls that may run concurrently (two streams) need their own. Default: one
    per device. keyed, regs: as `route`'s."""
    if x.ndim != 2 or gate_weight.ndim != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"router_route: x must be [T, H] and gate_weight [E, H], got {tuple(x.shape)} and "
                         f"{tuple(gate_weight.shape)}")
    if x.dtype != torch.bfloat16 or gate_weight.dtype != torch.bfloat16:
        raise TypeError(f"router_route: x and gate_weight must be bfloat16, got {x.dtype} and "
                        f"{gate_weight.dtype}; use the module's gate and `route`")
    if x.stride(-1) != 1 or gate_weight.stride(-1) != 1:
        raise ValueError("router_route: x and gate_weight need unit column stride (pass .contiguous())")
    t, h = x.shape
    e = gate_weight.shape[0]
    if not fits(t, top_k, e):
        raise ValueError(f"router_route: {t} tokens x top_k {top_k} over {e} experts is outside the "
                         f"one-program route (see fits); use the module's gate and the torch route")
    bes, bh, hc = bes or ROUTER_BES, bh or ROUTER_BH, hc or ROUTER_HC
    if bes < 16 or bes & (bes - 1) or bh < 16 or bh & (bh - 1):
        raise ValueError(f"router_route: bes (experts per program) and bh (columns per step) must be powers "
                         f"of two >= 16, got {bes} and {bh}")
    if hc < bh or hc % bh:
        raise ValueError(f"router_route: hc (columns per program) must be a multiple of bh={bh}, got {hc}")
    dev = x.device
    if lock is None:
        lock = _LOCKS.get(dev)
        if lock is None:
            lock = _LOCKS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    elif lock.dtype != torch.int32 or lock.numel() != 1 or lock.device != dev:
        raise ValueError(f"router_route: lock must be an int32 [1] counter on {dev}, got {lock.dtype} "
                         f"{tuple(lock.shape)} on {lock.device}")
    split = triton.cdiv(h, hc)
    logits = torch.empty(t, e, dtype=torch.bfloat16, device=dev)
    # the column slices' fp32 sums (one slice: unused, the kernel stores bf16 logits directly)
    part = torch.empty((split, t, e) if split > 1 else (1,), dtype=torch.float32, device=dev)
    idx, w, rows, pos, offsets = _route_outputs(t, top_k, e, weight_dtype or torch.bfloat16, dev)
    bq = 16 if INTERPRET else ROUTE_BQ
    COMPILED["moe router+route"] = _router_route_kernel[(triton.cdiv(e, bes), split)](
        x, gate_weight, logits, part, lock, idx, w, rows, pos, offsets, t, e, h, hc, x.stride(0),
        gate_weight.stride(0),
        K=top_k, BT=max(2, triton.next_power_of_2(t)), BE=max(16, triton.next_power_of_2(e)),
        BP=max(16, triton.next_power_of_2(t * top_k)), BQ=bq, BES=bes, BH=bh, SPLIT_H=split, NORM=bool(norm),
        LIBDEVICE=_libdevice_for(dev), W_BF16=w.dtype == torch.bfloat16, INTERP=INTERPRET,
        KEYED=KEYED_TOPK if keyed is None else bool(keyed), KP=triton.next_power_of_2(top_k),
        REGS=_regs(t, top_k, regs), num_warps=num_warps or ROUTER_WARPS, enable_fp_fusion=False,
        **_launch_opts(dev))
    return logits, idx, w, rows, pos, offsets


def combine(d: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """d [T k, H] (expert outputs in sorted-row order), pos [T k] (route's), weight [T, k] -> y [T, H] in d's
    dtype: y[t] = sum_j w[t, j] * d[pos[t k + j]] in fp32, j in order."""
    t, k = weight.shape
    if d.ndim != 2 or d.stride(-1) != 1 or d.shape[0] != t * k or pos.numel() != t * k:
        raise ValueError(f"combine: d must be [T k = {t * k}, H] with unit column stride and pos [T k], "
                         f"got d {tuple(d.shape)} strides {d.stride()}, pos {tuple(pos.shape)}")
    h = d.shape[1]
    y = torch.empty(t, h, dtype=d.dtype, device=d.device)
    if t == 0:
        return y
    bh = min(1024, max(16, triton.next_power_of_2(h)))
    COMPILED["moe combine"] = _combine_kernel[(t, triton.cdiv(h, bh))](
        d, pos.contiguous(), weight.contiguous(), y, h, d.stride(0), y.stride(0), K=k, BH=bh,
        Y_BF16=y.dtype == torch.bfloat16, num_warps=4,
        enable_fp_fusion=False, **_launch_opts(d.device))
    return y
