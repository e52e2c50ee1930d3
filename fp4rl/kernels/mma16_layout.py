"""The dense mma16 GEMM's weight copy (fp4rl/kernels/gemv_mma16.cu, fp4rl.kernels.gemv_cuda): the packed NVFP4
codes laid out as the A fragments of mma.sync.m16n8k16 (the .cu's header says how), the block scales as bf16
pairs, and the plain-torch round trip and emulation the CPU tests check the layout with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.kernels.gemv import _MOVES, _permute_words, swizzle

_TWO_POW_118 = 2.0 ** 118


@dataclass
class Mma16Weight:
    """The mma16 copy of one packed NVFP4 weight [N, K/2] (N % 16 == 0, K % 128 == 0)."""

    wt: torch.Tensor  # int32 [N/16, K/128, 2, 32, 4]
    st: torch.Tensor  # bfloat16 [N/16, K/128, 8, 8, 2]: block_scale * 2^118 of rows g, g + 8
    n: int
    k: int


def supports(n: int, k: int) -> bool:
    return n % 16 == 0 and k % 128 == 0 and n > 0 and k > 0


def _codes(data: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K] (element 2i in the low nibble)."""
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], -1)


def _kk_index(device) -> torch.Tensor:
    """[4 lanes t, 4]: k within a 16-block of lane t's A fragment: 2t, 2t+1, 2t+8, 2t+9."""
    t = torch.arange(4, device=device)[:, None] * 2
    return t + torch.tensor([0, 1, 8, 9], device=device)


def relayout(data: torch.Tensor, block_scale: torch.Tensor) -> Mma16Weight:
    """Packed NVFP4 data uint8 [N, K/2] and E4M3 block scales [N, K/16] -> the kernel's copy.
    Plain torch (runs on the weights' device; a one-time cost per weight version)."""
    if data.dtype != torch.uint8 or data.ndim != 2:
        raise ValueError(f"packed NVFP4 data must be uint8 [N, K/2], got {data.dtype} {tuple(data.shape)}")
    n, k = data.shape[0], 2 * data.shape[1]
    if not supports(n, k):
        raise ValueError(f"the mma16 layout needs N % 16 == 0 and K % 128 == 0, got N={n}, K={k}")
    if tuple(block_scale.shape) != (n, k // 16):
        raise ValueError(f"block_scale must be [N, K/16] = [{n}, {k // 16}], got {tuple(block_scale.shape)}")
    s = k // 128
    c = _codes(data).reshape(n // 16, 2, 8, s, 2, 4, 16)  # [tile, hh (row g / g+8), g, step, half, word, kk]
    c = c[..., _kk_index(data.device)].reshape(n // 16, 2, 8, s, 2, 4, 4, 2, 2)  # ..., t, jp, je
    # word codes in pair order (a0 a1 a2 a3) = (jp, hh) = (0, 0) (0, 1) (1, 0) (1, 1), element je
    c = c.permute(0, 3, 4, 2, 6, 5, 7, 1, 8).reshape(-1, 8)  # [tile, step, half, g, t, word] x 8
    packed = c[:, 0::2] | (c[:, 1::2] << 4)  # 4 bytes per word, element 2i in the low nibble
    # the gemv32 bit order (gemv.swizzle: one memory-bound Triton kernel on CUDA, torch integer ops elsewhere)
    wt = swizzle(packed.reshape(-1, 4)).view(torch.int32).reshape(n // 16, s, 2, 32, 4)
    sc = block_scale.view(torch.uint8) if block_scale.dtype != torch.uint8 else block_scale
    sf = (sc.view(torch.float8_e4m3fn).float() * _TWO_POW_118).to(torch.bfloat16)
    st = sf.reshape(n // 16, 2, 8, s, 8).permute(0, 3, 2, 4, 1).contiguous()  # [tile, step, g, block, hh]
    return Mma16Weight(wt=wt.contiguous(), st=st, n=n, k=k)


def _unpack_pairs(w: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's unpack (gemv_mma16.cu `unpack`) on int64 words: four uint32 bf16 pairs."""
    w = w & 0xFFFFFFFF
    m = 0x81C081C0
    p0 = w & m
    p1 = (w << 3) & m
    p2 = (w << 6) & m
    p3 = ((w >> 4) & 0x00C000C0) | ((w << 1) & 0x80008000) | ((w >> 5) & 0x01000100)
    return [p & 0xFFFFFFFF for p in (p0, p1, p2, p3)]


def _bf16_bits_to_float(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 16).view(torch.float32)


def emulate_weight(wc: Mma16Weight) -> torch.Tensor:
    """Float64 [N, K] of e2m1 * block_scale * 2^-8 as the kernel's lanes see it: each word unpacked by the
    kernel's bit operations, times its bf16 scale, placed where the MMA's A fragment puts it (pair j of lane
    (g, t) = row g + 8 (j % 2), k 2t + 8 (j // 2) and the next)."""
    n, k, s = wc.n, wc.k, wc.k // 128
    dev = wc.wt.device
    words = wc.wt.reshape(n // 16, s, 2, 8, 4, 4).to(torch.int64)  # [tile, step, half, g, t, word]
    pairs = _unpack_pairs(words)
    scales = _bf16_bits_to_float(wc.st.view(torch.int16).to(torch.int32) & 0xFFFF).double()
    scales = scales.reshape(n // 16, s, 8, 2, 4, 2)  # [tile, step, g, half, word, hh]
    # [tile, hh, g, step, half, word, kk]
    out = torch.zeros(n // 16, 2, 8, s, 2, 4, 16, dtype=torch.float64, device=dev)
    t = torch.arange(4, device=dev)
    for j, p in enumerate(pairs):
        jp, hh = j // 2, j % 2
        sc = scales[..., hh].permute(0, 1, 3, 2, 4)[:, :, :, :, None, :]  # [tile, step, half, g, 1, word]
        for val, off in ((_bf16_bits_to_float(p & 0xFFFF).double(), 0),
                         (_bf16_bits_to_float(p >> 16).double(), 1)):
            v = (val * sc).permute(0, 3, 1, 2, 5, 4)  # [tile, g, step, half, word, t]
            out[:, hh].index_copy_(-1, 2 * t + 8 * jp + off, v.contiguous())
    return out.reshape(n, k)


def unrelayout(wc: Mma16Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The mma16 copy -> (standard packed data uint8 [N, K/2], E4M3 block scales uint8 [N, K/16])."""
    n, k, s = wc.n, wc.k, wc.k // 128
    inv = [(d, src) for src, d in _MOVES]
    packed = _permute_words(wc.wt.view(torch.uint8).reshape(-1, 4), inv).reshape(-1, 4)
    c = torch.stack((packed & 15, packed >> 4), dim=-1)  # [..., byte, nibble] = 8 codes per word
    c = c.reshape(n // 16, s, 2, 8, 4, 4, 2, 2, 2)  # [tile, step, half, g, t, word, jp, hh, je]
    c = c.permute(0, 7, 3, 1, 2, 5, 4, 6, 8)  # [tile, hh, g, step, half, word, t, jp, je]
    codes = torch.zeros(n // 16, 2, 8, s, 2, 4, 16, dtype=torch.uint8, device=wc.wt.device)
    codes[..., _kk_index(wc.wt.device).reshape(-1)] = c.reshape(n // 16, 2, 8, s, 2, 4, 16)
    codes = codes.reshape(n, k)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sf = wc.st.permute(0, 4, 2, 1, 3).reshape(n, k // 16).float() / _TWO_POW_118
    return data, sf.to(torch.float8_e4m3fn).view(torch.uint8)
