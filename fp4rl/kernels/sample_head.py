"""The sampler's token choice on the GPU in two small kernels per decode step (cpu_head.py's CUDA side).

`sample_head(logits, greedy, temperature, generator)` returns the tokens [B] (int64) and their logprobs
[B] (fp32, under log_softmax(logits / T)) for greedy decoding or plain temperature sampling (no top-k /
top-p), reading BF16 or FP32 logits in place. torch's path (fp4rl.sampler.sample_next) takes ~35 kernels
for this: a float copy, softmax, a float64 copy, its cumulative sum (a row scan that took 230-280 us per
step of Qwen3-30B-A3B's 151936-token vocabulary at batch 8-32 on an H200, more than the MoE route and
combine of every layer together; bench/RESULTS.md), searchsorted, logsumexp and the gathers.

Two kernels, the first over (row, slice of SLICE logits), the row's logits staying in L2:
1. per slice: the maximum m_j of z = logits (/ T: IEEE division; torch's CUDA kernel multiplies by 1/T, so z
   can differ in its last bit), the first index of that maximum, the count of NaN / +inf values, then (the
   slice again, from L1 / L2) sum exp(z - m_j) in fp32 and in float64;
2. per row, with m the row's maximum: the slices' sums scaled by exp(m_j - m) (S, the logsumexp: logprob =
   z_token - m - log S), then the token, greedy: the first maximum over the slices in order; sampling: the
   inverse CDF, the first i whose running float64 sum of exp(z_i - m) exceeds u * S64 (the slice from the
   running sum of the slices' scaled sums, then a scan of that slice alone), u ~ U[0, 1) drawn from
   `generator` as torch.rand(B, dtype=float64) (the draws of the torch path: a seed gives the same
   tokens). A token whose exponential is 0 (a -inf logit, or underflow) is never drawn; a scan that finds no
   crossing for float64 rounding takes the slice's last token with mass.
A single program per row (first version) took ~115 us per step on the H200 at any batch: one SM streaming
the 151936 logits three times. Three kernels over slices of 8192 (the max, then the sums with the row's m,
then the pick; MERGED = False keeps them) took 13.6 / 14.4 / 18.5 / 41.1 us of kernel time (profiler) at
batch 1 / 8 / 32 / 128 on the H200 (temperature 1, V = 151936), the two over slices of 2048 5.9 / 7.5 / 12.9 /
34.1: fewer sequential chunks per program and one launch less (bench/sample_head_slices.py; in a CUDA graph,
bench/RESULTS.md).

Against sample_next (which also scans the unnormalized exponentials, as the C head does): the same
distribution and, for the same u, the same token unless u * total falls within rounding of a CDF step (the
float64 sums in another order, an exponential or z one fp32 ulp apart, a slice's sum scaled by
exp(m_j - m)); logprobs within fp32 rounding (another summation order; expf and logf are libdevice's on the
GPU, as torch's). A row with a NaN or an infinite logit gets a NaN logprob (its token is in range but
meaningless), which grpo_loss refuses with an error naming the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import INTERPRET
from fp4rl.kernels.fused import _exp, _libdevice_for, libdevice

BLOCK = 2048  # logits per program step
SLICE = 2048  # logits per program of the slice kernel(s) (a multiple of BLOCK)
WARPS = 4
MERGED = True  # one kernel for the slices' maxima and sums (each slice's sums relative to its own maximum);
# False: _max_kernel, then _sum_kernel relative to the row's maximum (three launches; for A/B timing)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _scaled(z_ptr, idx, V, t, SCALE: tl.constexpr):
    x = tl.load(z_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if SCALE:
        x = tl.math.div_rn(x, tl.zeros_like(x) + t)
    return x


@triton.jit
def _slice_max(z_ptr, j, V, t, SCALE: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr):
    """(maximum, its first index, non-finite count) of slice j of a row's z."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32) + j * SLICE
    bad = tl.full([], 0, tl.int32)
    for start in range(j * SLICE, (j + 1) * SLICE, BLOCK):
        idx = start + offs
        x = _scaled(z_ptr, idx, V, t, SCALE)
        bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0)
        cm = tl.max(x, 0)
        ci = tl.min(tl.where(x == cm, idx, V), 0)  # first index of the chunk's max
        best = tl.where(cm > m, ci, best)
        m = tl.maximum(m, cm)
    return m, best, bad


@triton.jit
def _slice_sums(z_ptr, j, m, V, t, SCALE: tl.constexpr, BLOCK: tl.constexpr, SLICE: tl.constexpr,
                LIBDEVICE: tl.constexpr):
    """(fp32, float64) sums of exp(z - m) over slice j of a row's z."""
    offs = tl.arange(0, BLOCK)
    s32 = tl.full([], 0.0, tl.float32)
    s64 = tl.full([], 0.0, tl.float64)
    for start in range(j * SLICE, (j + 1) * SLICE, BLOCK):
        idx = start + offs
        e = tl.where(idx < V, _exp(_scaled(z_ptr, idx, V, t, SCALE) - m, LIBDEVICE), 0.0)
        s32 += tl.sum(e, 0)
        s64 += tl.sum(e.to(tl.float64), 0)
    return s32, s64


@triton.jit
def _max_kernel(z_ptr, pm_ptr, pa_ptr, pb_ptr, V, NS, stride_z, t, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                SLICE: tl.constexpr):
    """Program (row, j): the maximum of slice j of the row's z, its first index, its non-finite count."""
    row, j = tl.program_id(0), tl.program_id(1)
    m, best, bad = _slice_max(z_ptr + row.to(tl.int64) * stride_z, j, V, t, SCALE, BLOCK, SLICE)
    tl.store(pm_ptr + row * NS + j, m)
    tl.store(pa_ptr + row * NS + j, best)
    tl.store(pb_ptr + row * NS + j, bad)


@triton.jit
def _sum_kernel(z_ptr, pm_ptr, p32_ptr, p64_ptr, V, NS, stride_z, t, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                SLICE: tl.constexpr, NSP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (row, j): sum over slice j of exp(z - m), m the row's maximum, in fp32 and float64."""
    row, j = tl.program_id(0), tl.program_id(1)
    jj = tl.arange(0, NSP)
    m = tl.max(tl.load(pm_ptr + row * NS + jj, mask=jj < NS, other=float("-inf")), 0)
    s32, s64 = _slice_sums(z_ptr + row.to(tl.int64) * stride_z, j, m, V, t, SCALE, BLOCK, SLICE, LIBDEVICE)
    tl.store(p32_ptr + row * NS + j, s32)
    tl.store(p64_ptr + row * NS + j, s64)


@triton.jit
def _slice_kernel(z_ptr, pm_ptr, pa_ptr, pb_ptr, p32_ptr, p64_ptr, V, NS, stride_z, t, SCALE: tl.constexpr,
                  BLOCK: tl.constexpr, SLICE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (row, j): _max_kernel's three figures of slice j, then its sums of exp(z - m_j) with m_j the
    slice's own maximum (the pick kernel scales them by exp(m_j - m)): one launch instead of two."""
    row, j = tl.program_id(0), tl.program_id(1)
    z_ptr += row.to(tl.int64) * stride_z
    m, best, bad = _slice_max(z_ptr, j, V, t, SCALE, BLOCK, SLICE)
    mm = tl.where(m == float("-inf"), 0.0, m)  # a slice without mass: its sums are 0, not NaN
    s32, s64 = _slice_sums(z_ptr, j, mm, V, t, SCALE, BLOCK, SLICE, LIBDEVICE)  # (the slice again: L1 / L2)
    tl.store(pm_ptr + row * NS + j, m)
    tl.store(pa_ptr + row * NS + j, best)
    tl.store(pb_ptr + row * NS + j, bad)
    tl.store(p32_ptr + row * NS + j, s32)
    tl.store(p64_ptr + row * NS + j, s64)


@triton.jit(do_not_specialize=["rec_col"])  # (the step: one kernel for every column)
def _pick_kernel(z_ptr, u_ptr, pm_ptr, pa_ptr, pb_ptr, p32_ptr, p64_ptr, tok_ptr, lp_ptr, rec_ptr,
                 rec_rows_ptr, rec_stride, rec_col, V, NS, stride_z, t, RECORD: tl.constexpr,
                 MERGED: tl.constexpr, GREEDY: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                 SLICE: tl.constexpr, NSP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program row: the token (the first maximum, or the inverse CDF at u * total) and its logprob."""
    row = tl.program_id(0)
    z_ptr += row.to(tl.int64) * stride_z
    jj = tl.arange(0, NSP)
    jm = jj < NS
    pm = tl.load(pm_ptr + row * NS + jj, mask=jm, other=float("-inf"))
    m = tl.max(pm, 0)
    bad = tl.sum(tl.load(pb_ptr + row * NS + jj, mask=jm, other=0), 0) + (m == float("-inf")).to(tl.int32)
    p32 = tl.load(p32_ptr + row * NS + jj, mask=jm, other=0.0)
    if MERGED:  # each slice's sums are relative to its own maximum
        p32 = p32 * _exp(pm - m, LIBDEVICE)
    s32 = tl.sum(p32, 0)
    first_j = tl.min(tl.where(jm & (pm == m), jj, NS), 0)  # slices in order: the first maximum
    tok = tl.load(pa_ptr + row * NS + tl.minimum(first_j, NS - 1))
    if not GREEDY:
        p64 = tl.load(p64_ptr + row * NS + jj, mask=jm, other=0.0)
        if MERGED:
            p64 = p64 * tl.exp((pm - m).to(tl.float64))
        cum = tl.cumsum(p64, 0)  # running sum of the slices, in order
        total = tl.max(tl.where(jm, cum, 0.0), 0)
        target = tl.load(u_ptr + row) * total
        js = tl.minimum(tl.min(tl.where(jm & (cum > target), jj, NS), 0), NS - 1)
        run = tl.sum(tl.where(jj == js - 1, cum, 0.0), 0)  # the mass before js, as the slice choice saw it
        offs = tl.arange(0, BLOCK)
        found = tl.full([], 0, tl.int32) + V
        last = tl.full([], -1, tl.int32)  # the last token of the slice with mass (if rounding finds none)
        for start in range(js * SLICE, (js + 1) * SLICE, BLOCK):
            idx = start + offs
            e = tl.where(idx < V, _exp(_scaled(z_ptr, idx, V, t, SCALE) - m, LIBDEVICE), 0.0).to(tl.float64)
            c = tl.cumsum(e, 0) + run
            # a token with no mass is never drawn, whatever the rounding of the scan (cumsum is a tree)
            found = tl.minimum(found, tl.min(tl.where((c > target) & (e > 0) & (idx < V), idx, V), 0))
            last = tl.maximum(last, tl.max(tl.where(e > 0, idx, -1), 0))
            run += tl.sum(e, 0)
        tok = tl.where(found < V, found, tl.where(last >= 0, last, tok))  # else the first maximum
    zt = tl.load(z_ptr + tok).to(tl.float32)
    if SCALE:
        zt = tl.math.div_rn(zt, t)
    lp = zt - m - _log(s32, LIBDEVICE)
    lp = tl.where(bad > 0, float("nan"), lp)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, lp)
    if RECORD:  # the sampler's logprob table: rec[rows[row], col]
        tl.store(rec_ptr + tl.load(rec_rows_ptr + row) * rec_stride + rec_col, lp)


def sample_head(logits: torch.Tensor, greedy: bool, temperature: float, generator: torch.Generator | None,
                record: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens int64 [B], logprobs float32 [B]) from logits [B, V] (BF16 or FP32, on CUDA or under
    TRITON_INTERPRET=1), or None where the kernel does not apply (the caller uses the torch code). record:
    (table float32 [R, C], rows int64 [B], col): the logprobs are also written to table[rows, col] by the
    same launch (the sampler's per-step record, without an index_put)."""
    if logits.ndim != 2 or logits.dtype not in (torch.bfloat16, torch.float32) \
            or not (logits.is_cuda or (INTERPRET and logits.device.type == "cpu")):
        return None
    if not greedy and not (temperature > 0):
        raise ValueError(f"sample_head: temperature must be > 0 for sampling, got {temperature!r}")
    u = None
    if not greedy and logits.shape[0] and logits.shape[1]:
        u = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    return choose(logits, u, temperature, record)


def choose(logits: torch.Tensor, u: torch.Tensor | None, temperature: float = 1.0,
           record: tuple | None = None):
    """The kernels of `sample_head` with the uniforms given: u float64 [B] in [0, 1) (inverse CDF at u), or
    None (greedy; temperature is then ignored, as torch's greedy path ignores it); record as sample_head's."""
    if logits.shape[1] == 0:
        raise ValueError("sample_head: logits have an empty vocabulary (V = 0)")
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    b, v = z.shape
    dev = z.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if record is not None:
        table, rows, col = record
        if table.dtype != torch.float32 or table.ndim != 2 or table.stride(1) != 1 or table.device != dev \
                or rows.dtype != torch.int64 or rows.shape != (b,) or not rows.is_contiguous() \
                or rows.device != dev or not 0 <= col < table.shape[1]:
            raise ValueError(f"sample_head: record needs a float32 [R, C] table with unit column stride, "
                             f"contiguous int64 rows [{b}] and a column in [0, C), all on {dev}; got "
                             f"{table.dtype} {tuple(table.shape)}, rows {rows.dtype} {tuple(rows.shape)}, "
                             f"column {col}")
    if b == 0:
        return tokens, logprobs
    greedy = u is None
    if not greedy and (u.dtype != torch.float64 or u.shape != (b,) or u.device != dev):
        raise ValueError(f"sample_head: u must be float64 [{b}] on {dev}, got {u.dtype} {tuple(u.shape)}")
    scale = not greedy and float(temperature) != 1.0
    t = float(temperature) if scale else 1.0
    ns = triton.cdiv(v, SLICE)
    nsp = max(2, triton.next_power_of_2(ns))
    pm = torch.empty(b, ns, dtype=torch.float32, device=dev)
    pa = torch.empty(b, ns, dtype=torch.int32, device=dev)
    pb = torch.empty(b, ns, dtype=torch.int32, device=dev)
    p32 = torch.empty(b, ns, dtype=torch.float32, device=dev)
    p64 = torch.empty(b, ns, dtype=torch.float64, device=dev)
    lib = _libdevice_for(dev)
    if MERGED:
        _slice_kernel[(b, ns)](z, pm, pa, pb, p32, p64, v, ns, z.stride(0), t, SCALE=scale, BLOCK=BLOCK,
                               SLICE=SLICE, LIBDEVICE=lib, num_warps=WARPS)
    else:
        _max_kernel[(b, ns)](z, pm, pa, pb, v, ns, z.stride(0), t, SCALE=scale, BLOCK=BLOCK, SLICE=SLICE,
                             num_warps=WARPS)
        _sum_kernel[(b, ns)](z, pm, p32, p64, v, ns, z.stride(0), t, SCALE=scale, BLOCK=BLOCK, SLICE=SLICE,
                             NSP=nsp, LIBDEVICE=lib, num_warps=WARPS)
    uu = logprobs if greedy else u  # a pointer the greedy kernel never reads
    table, rows, col = record if record is not None else (logprobs, tokens, 0)  # (unread without RECORD)
    _pick_kernel[(b,)](z, uu, pm, pa, pb, p32, p64, tokens, logprobs, table, rows, table.stride(0), col, v,
                       ns, z.stride(0), t, RECORD=record is not None, MERGED=MERGED, GREEDY=greedy,
                       SCALE=scale, BLOCK=BLOCK, SLICE=SLICE, NSP=nsp, LIBDEVICE=lib, num_warps=WARPS)
    return tokens, logprobs
