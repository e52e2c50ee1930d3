"""TRACE guidance written by the GPU sampler: one kernel per guided input (fp4rl.trace's compact cache).

The decode engine (fp4rl.gpu_decode) quantizes a W4A4 linear's input x [R, K] per token into
(data, block_scale, global_scale); ``record`` turns that into the rows of a ``trace.Guidance``: the row's
amax of |x| in float32, the E4M3 block scales as the quantizer chose them, and one bit per element (bit
j % 8 of byte j // 8: the lowest bit of element j's magnitude index, i.e. bit 0 and bit 4 of its packed
byte). ``trace.compact`` computes the same bytes with torch ops (tested equal); this kernel does it inside
the engine's CUDA-graph step without host syncs or a dozen small launches (a zeroing memset for the
amax, which the column programs max into, and the kernel). ``src`` gathers: output row p is input row
src[p] (a routed expert's rows are in expert-sorted order; the guidance is by token and slot).

Measured alternatives (bench/RESULTS.md, twenty-fourth session): the kernel launched with programmatic
dependent launch and storing each chunk's max for the host to reduce (no memset, no atomics) made a guided
step slower (Qwen3-8B shape, batch 1: 1.86 against 1.39 ms): the host's per-step reduction fell on the
decode loop's critical path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import COMPILED

BK = 512  # columns per program: a decode step's few rows still spread over many programs


@triton.jit
def _record_kernel(x_ptr, data_ptr, bs_ptr, src_ptr, bits_ptr, obs_ptr, amax_ptr, K,
                   stride_x, stride_d, stride_s, HAS_SRC: tl.constexpr, BK: tl.constexpr):
    # program (p, c): output row p, columns [c BK, (c + 1) BK); the row's amax by an atomic max of the chunks'
    # (|x| as int32 bits: the same order for non-negative floats, NaN above inf; amax starts at 0)
    p = tl.program_id(0)
    k0 = tl.program_id(1) * BK
    r = p.to(tl.int64)  # (row offsets of a long prefill pass 2^31)
    if HAS_SRC:
        r = tl.load(src_ptr + p).to(tl.int64)
    cols = k0 + tl.arange(0, BK)
    xv = tl.load(x_ptr + r * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + p, tl.max(tl.abs(xv).to(tl.int32, bitcast=True), axis=0))
    # output byte j of the chunk: elements k0 + 8 j .. + 7 = packed bytes k0 / 2 + 4 j + i, i in 0..3
    j = tl.arange(0, BK // 8)
    i = tl.arange(0, 4)
    ok = (k0 + 8 * j) < K
    d = tl.load(data_ptr + r * stride_d + k0 // 2 + 4 * j[:, None] + i[None, :], mask=ok[:, None],
                other=0).to(tl.int32)
    two = ((d & 1) | ((d >> 3) & 2)) << (2 * i[None, :])  # element 2i's bit at 2i, element 2i+1's at 2i+1
    tl.store(bits_ptr + p.to(tl.int64) * (K // 8) + k0 // 8 + j, tl.sum(two, axis=1).to(tl.uint8), mask=ok)
    sb = tl.arange(0, BK // 16)
    sok = (k0 + 16 * sb) < K
    s = tl.load(bs_ptr + r * stride_s + k0 // 16 + sb, mask=sok, other=0)
    tl.store(obs_ptr + p.to(tl.int64) * (K // 16) + k0 // 16 + sb, s, mask=sok)


def record(x: torch.Tensor, data: torch.Tensor, block_scale: torch.Tensor,
           src: torch.Tensor | None = None):
    """(bits uint8 [P, K/8], block_scale float8_e4m3fn [P, K/16], amax float32 [P]) of activation rows
    x [R, K] (bfloat16 or float32, unit column stride) quantized per row to data uint8 [R, K/2] and
    block_scale [R, K/16]; P = R, or row p is x's row src[p] (src int32/int64 [P], values < R: unchecked,
    no host sync)."""
    if x.ndim != 2 or x.stride(-1) != 1:
        raise ValueError(f"trace record: x must be [R, K] with unit column stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    R, K = x.shape
    if K % 16:
        raise ValueError(f"trace record: K = {K} is not a multiple of 16 (NVFP4 blocks)")
    if (data.shape != (R, K // 2) or block_scale.shape != (R, K // 16) or data.stride(-1) != 1
            or block_scale.stride(-1) != 1):
        raise ValueError(f"trace record: for x {tuple(x.shape)} the quantized rows must be data [R, K/2] and "
                         f"block_scale [R, K/16] with unit column strides, got {tuple(data.shape)} and "
                         f"{tuple(block_scale.shape)}")
    if src is not None and (src.ndim != 1 or src.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"trace record: src must be a 1-D int32/int64 row index, got {src.dtype} "
                         f"{tuple(src.shape)}")
    P = R if src is None else src.numel()
    dev = x.device
    bits = torch.empty(P, K // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(P, K // 16, dtype=torch.float8_e4m3fn, device=dev)
    amax = torch.zeros(P, dtype=torch.int32, device=dev)  # float32 bits, max-ed by the programs
    if P:
        bk = min(BK, max(16, triton.next_power_of_2(K)))
        COMPILED["trace record"] = _record_kernel[(P, triton.cdiv(K, bk))](
            x, data, block_scale.view(torch.uint8), src if src is not None else data, bits,
            scales.view(torch.uint8), amax, K, x.stride(0), data.stride(0), block_scale.stride(0),
            HAS_SRC=src is not None, BK=bk, num_warps=2)
    return bits, scales, amax.view(torch.float32)
