"""The sampler's token choice on the GPU in one kernel per decode step (fp4rl/cpu_head.py's CUDA side).

`sample_head(logits, greedy, temperature, generator)` returns the tokens [B] (int64) and their logprobs
[B] (fp32, under log_softmax(logits / T)) for greedy decoding or plain temperature sampling (no top-k /
top-p), reading BF16 or FP32 logits in place. torch's path (fp4rl.sampler.sample_next) takes ~35 kernels
for this: a float copy, softmax, a float64 copy, its cumulative sum (a row scan that took 230-280 us per
step of Qwen3-30B-A3B's 151936-token vocabulary at batch 8-32 on an H200, more than the MoE route and
combine of every layer together; bench/RESULTS.md), searchsorted, logsumexp and the gathers.

One program per row, three passes over its logits (the row stays in L2 after the first):
1. the maximum m of z = logits (/ T: IEEE division, as torch), the first index of the maximum (greedy),
   and whether the row holds a NaN or an infinity;
2. S = sum exp(z - m) in fp32 (the logsumexp: logprob = z_token - m - log S) and in float64;
3. (sampling) the running float64 sum of exp(z_i - m): the token is the first i whose running sum exceeds
   u * S64, u ~ U[0, 1) drawn from `generator` as torch.rand(B, dtype=float64) (the draws of the torch
   path: a seed gives the same tokens).

Against sample_next: the same distribution and, for the same u, the same token unless u * total falls
within float64 rounding of a CDF step (torch scans the normalized fp32 probabilities, this the unnormalized
exponentials); logprobs within fp32 rounding (another summation order; expf is libdevice's on the GPU,
as torch's). A row with a NaN or an infinite logit gets a NaN logprob (its token is in range but
meaningless), which the trainer's checks refuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import INTERPRET
from fp4rl.kernels.fused import _libdevice_for, libdevice

BLOCK = 4096  # logits per program step
WARPS = 8


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _scaled(z_ptr, idx, V, t, SCALE: tl.constexpr):
    x = tl.load(z_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if SCALE:
        x = tl.math.div_rn(x, tl.zeros_like(x) + t)
    return x


@triton.jit
def _sample_kernel(z_ptr, u_ptr, tok_ptr, lp_ptr, V, stride_z, t, GREEDY: tl.constexpr, SCALE: tl.constexpr,
                   BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    z_ptr += row.to(tl.int64) * stride_z
    offs = tl.arange(0, BLOCK)
    # 1. max, first index of the max, non-finite values
    m = tl.full((), float("-inf"), tl.float32)
    best = tl.full((), 0, tl.int32)
    bad = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = _scaled(z_ptr, idx, V, t, SCALE)
        bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0)
        cm = tl.max(x, 0)
        ci = tl.min(tl.where(x == cm, idx, V), 0)  # first index of the chunk's max
        best = tl.where(cm > m, ci, best)
        m = tl.maximum(m, cm)
    bad += (m == float("-inf")).to(tl.int32)
    # 2. the sum of exponentials, fp32 (logsumexp) and float64 (the sampling total)
    s32 = tl.full((), 0.0, tl.float32)
    s64 = tl.full((), 0.0, tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + offs
        e = _exp(_scaled(z_ptr, idx, V, t, SCALE) - m, LIBDEVICE)
        e = tl.where(idx < V, e, 0.0)
        s32 += tl.sum(e, 0)
        s64 += tl.sum(e.to(tl.float64), 0)
    tok = best
    if not GREEDY:
        # 3. inverse CDF: the first index whose running sum exceeds u * S64
        target = tl.load(u_ptr + row) * s64
        run = tl.full((), 0.0, tl.float64)
        first = tl.full((), V, tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            e = _exp(_scaled(z_ptr, idx, V, t, SCALE) - m, LIBDEVICE)
            e = tl.where(idx < V, e, 0.0).to(tl.float64)
            c = tl.cumsum(e, 0) + run
            first = tl.minimum(first, tl.min(tl.where((c > target) & (idx < V), idx, V), 0))
            run += tl.sum(e, 0)
        tok = tl.minimum(first, V - 1)
    zt = tl.load(z_ptr + tok).to(tl.float32)
    if SCALE:
        zt = tl.math.div_rn(zt, t)
    lp = zt - m - tl.log(s32)
    lp = tl.where(bad > 0, float("nan"), lp)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, lp)


def sample_head(logits: torch.Tensor, greedy: bool, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens int64 [B], logprobs float32 [B]) from logits [B, V] (BF16 or FP32, on CUDA or under
    TRITON_INTERPRET=1), or None where the kernel does not apply (the caller uses the torch code)."""
    if logits.ndim != 2 or logits.dtype not in (torch.bfloat16, torch.float32) \
            or not (logits.is_cuda or (INTERPRET and logits.device.type == "cpu")):
        return None
    if not greedy and not (temperature > 0):
        raise ValueError(f"sample_head: temperature must be > 0 for sampling, got {temperature!r}")
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    b, v = z.shape
    dev = z.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logprobs
    u = logprobs if greedy else torch.rand(b, generator=generator, dtype=torch.float64, device=dev)
    scale = not greedy and float(temperature) != 1.0
    _sample_kernel[(b,)](z, u, tokens, logprobs, v, z.stride(0), float(temperature) if scale else 1.0,
                         GREEDY=bool(greedy), SCALE=scale, BLOCK=BLOCK, LIBDEVICE=_libdevice_for(dev),
                         num_warps=WARPS)
    return tokens, logprobs
