"""The per-tensor amax pass: max |x| over the whole tensor, and the NaN/Inf flag, for the
quantize pass that follows it.

amax is taken as an integer max over |x|'s bit patterns (non-negative floats order like their
bits), exact and order-free, so many small programs each do one atomic max; the same pass takes a
second max over the raw patterns, >= 0x7F800000 meaning NaN or Inf, so that the caller can refuse
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import INTERPRET


@triton.jit
def _amax_kernel(x_ptr, part_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """part[0] = max |x| bits over finite x, part[1] = max raw |x| bits (NaN/Inf flag), by atomic max over
    programs (exact and order-free; part must start at 0)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    raw = tl.zeros((BLOCK,), tl.int32)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        raw = tl.maximum(raw, bits)
        acc = tl.maximum(acc, tl.where(bits >= 0x7F800000, 0, bits))
    tl.atomic_max(part_ptr, tl.max(acc, 0))
    tl.atomic_max(part_ptr + 1, tl.max(raw, 0))



def amax_partials(x: torch.Tensor):
    """max |x| bit patterns: (parts int32 [2, 1], 1). parts[0] is over the finite values, parts[1] over
    all (>= 0x7F800000 means NaN or Inf). Many small programs (loads in flight), one atomic max each."""
    flat = x.reshape(-1)
    numel = flat.numel()
    block, iters = (256, 4) if INTERPRET else (4096, 4)
    n_prog = max(1, triton.cdiv(numel, block * iters))
    parts = torch.zeros(2, 1, dtype=torch.int32, device=x.device)
    _amax_kernel[(n_prog,)](flat, parts, numel, BLOCK=block, ITERS=iters, num_warps=8)
    return parts, 1

