"""GEMMs for the sampler's CPU linears on x86 CPUs with AMX-BF16: packed NVFP4 or BF16 weights.

    y = x @ DQ(W).T + b        x, b, y bfloat16; W an NVFP4Tensor with 1x16 blocks (GemmWeight)
    y = x @ W.T + b            W bfloat16 (BF16Weight)

A decode step on a CPU is bound by the bytes of its weights (a batch-16 step of the default model
reads every weight once): a linear that reads 0.5625 byte per weight instead of 2 moves 3.6x fewer,
if the 4-bit codes can be turned into BF16 fast enough. The kernel (gemm_cpu.c, compiled once per
machine by fp4rl.nvfp4.cpu.build) keeps each weight in a tiled copy made per weight version: groups
of 64 rows, 32 columns at a time, so the whole weight is one sequential stream (the hardware
prefetcher and a software prefetch keep it coming at ~13-18 GB/s on one core here, against ~6-8 GB/s
for oneDNN's blocked BF16 GEMM at 16 rows). NVFP4 values come from tables of the 16 values each E4M3
scale byte gives, bf16((e2m1 * e4m3) * g), made by torch: bit for bit what
`dequantize(q, torch.bfloat16)` returns. Each 64 x 32 chunk is unpacked into L1 and multiplied at
once on AMX tiles with float32 accumulation, so results equal `F.linear(x, dequantize(q, bf16), b)`
up to the order of float32 additions; that order is fixed per output element, so a row of y does
not depend on the other rows of x (batch-invariant).

Runs when: the CPU has AMX-BF16, AVX512-BF16 and AVX512-VBMI (Linux grants the tile state), gcc builds the
file, x is bfloat16, K is a multiple of 16; for NVFP4, W has 1x16 blocks without a Hadamard
transform, its global scales are finite (at most 64 distinct ones: one per member of a fused stack)
and no block scale is NaN. Anything else: `GemmWeight.ok` or `supported_weight` is False and
callers use dequantize + F.linear.
`FP4RL_CPU_GEMM=off` (set before the first use) disables it. Work is split over
torch.get_num_threads() threads by groups of 64 rows of W (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from fp4rl.nvfp4 import cpu
from fp4rl.nvfp4.format import BLOCK, E2M1_TABLE, NVFP4Tensor

_SOURCE_FILE = Path(__file__).with_name("gemm_cpu.c")
_CFLAGS = ("-O3", "-march=native", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl",
           "-mavx512bf16", "-mavx512vbmi", "-std=gnu11", "-fPIC", "-shared")
_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl", "avx512vbmi")
_MAX_TABLES = 64  # distinct global scales per stacked weight (one per fused member in practice)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def _load() -> ctypes.CDLL:
    reason = cpu.missing_cpu_flags(_CPU_FLAGS)
    if reason:
        raise RuntimeError(reason)
    lib = cpu.open_library(lambda: cpu.build(_SOURCE_FILE, _CFLAGS))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.nvfp4_gemm_init.argtypes = []
    lib.nvfp4_gemm_init.restype = i32
    lib.nvfp4_gemm_pack_x.argtypes = [ptr, i64, i64, i64, ptr]
    lib.nvfp4_gemm_pack_x.restype = None
    lib.nvfp4_gemm_rows.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i64, ptr]
    lib.nvfp4_gemm_rows.restype = i32
    lib.nvfp4_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr]
    lib.nvfp4_gemm.restype = i32
    lib.nvfp4_gemm_dequantize.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ptr]
    lib.nvfp4_gemm_dequantize.restype = None
    lib.bf16_gemm_rows.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64]
    lib.bf16_gemm_rows.restype = i32
    lib.bf16_gemm.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr]
    lib.bf16_gemm.restype = i32
    if lib.nvfp4_gemm_init() != 0:
        raise RuntimeError("the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM failed)")
    return lib


def available() -> bool:
    """Whether the kernel can run here (builds and loads it on the first call; False, with one
    warning on a CPU that should support it, when that fails)."""
    if _lib is None and os.environ.get("FP4RL_CPU_GEMM", "").lower() in ("0", "off", "false", "no"):
        return False
    return cpu.load_once(globals(), _load, lambda failed: None if cpu.missing_cpu_flags(_CPU_FLAGS) else (
        f"fp4rl.nvfp4.cpu_gemm: the AMX NVFP4 GEMM is unavailable ({failed}); CPU linears dequantize "
        "their weights instead (same values, slower)"))


GROUP = 64  # rows of W per group of the tiled layouts (gemm_cpu.c)


def _tiled(t: torch.Tensor) -> torch.Tensor:
    """[N, C, E] per row and 32-column chunk -> [ceil(N/64), C, 64, E], rows zero-padded: the order in
    which the kernel streams a weight (one group of 64 rows, chunk after chunk)."""
    N, C, E = t.shape
    G = -(-N // GROUP)
    t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, G * GROUP - N))
    return t.reshape(G, GROUP, C, E).transpose(1, 2).contiguous()


class GemmWeight:
    """An NVFP4 weight (or several, stacked along N) in the layout the kernel reads (gemm_cpu.c): codes
    uint8 [G, C, 64, 16] (swizzled per 32 weights), E4M3 bytes [G, C, 64, 2], int32 table per row [64 G],
    and the value tables of its float32 global scales (one, or one per stacked member); G = ceil(N/64),
    C = ceil(K/32), zero-padded."""

    def __init__(self, parts: list[NVFP4Tensor]):
        if not parts:
            raise ValueError("GemmWeight needs at least one NVFP4Tensor")
        K = parts[0].shape[-1]
        for q in parts:
            if not supported_weight(q) or q.shape[-1] != K:
                raise ValueError(f"GemmWeight: {q!r} is not a 2-D 1x16 NVFP4 weight with K={K} (what the "
                                 "kernel reads)")
        self.K = K
        self.N = sum(q.shape[0] for q in parts)
        C = -(-K // 32)
        codes = torch.cat([q.data.reshape(q.shape[0], K // 2) for q in parts])
        codes = swizzle(torch.nn.functional.pad(codes, (0, C * 16 - K // 2)))  # zero codes past K
        scale = torch.cat([q.block_scale.reshape(q.shape[0], K // BLOCK) for q in parts]).view(torch.uint8)
        self.ok = not torch.isnan(scale.view(torch.float8_e4m3fn).float()).any().item()
        scale = torch.nn.functional.pad(scale, (0, 2 * C - K // BLOCK))  # scale byte 0 (value 0) past K
        self.data = _tiled(codes.reshape(self.N, C, 16))
        self.scale = _tiled(scale.reshape(self.N, C, 2))
        g = torch.cat([q.global_scale.float().reshape(-1).expand(q.shape[0]) for q in parts])  # [N]
        distinct, row_table = torch.unique(g, return_inverse=True)
        self.row_table = torch.nn.functional.pad(row_table.to(torch.int32), (0, self.data.shape[0] * GROUP
                                                                             - self.N)).contiguous()
        self.ok = bool(self.ok and distinct.numel() <= _MAX_TABLES and torch.isfinite(distinct).all())
        # tables[t, s, c] = bf16((e2m1[c] * e4m3[s]) * g_t): torch's own products and cast, the
        # order of dequantize, so the kernel's panels are its bytes; one padding row at the end
        tables = torch.zeros(distinct.numel() * 256 + 1, BLOCK, dtype=torch.bfloat16)
        if self.ok:
            e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            values = (E2M1_TABLE[None, None, :] * e4m3[None, :, None]) * distinct[:, None, None]
            tables[:-1] = values.reshape(-1, BLOCK).to(torch.bfloat16)
        self.tables = tables
        self.packed = True
        self.ptrs = (self.data.data_ptr(), self.scale.data_ptr(), self.tables.data_ptr(),
                     self.row_table.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + self.tables.nbytes + self.row_table.nbytes


class BF16Weight:
    """A BF16 weight [N, K] in the kernel's tiled layout: bf16 [G, C, 64, 32], zero-padded (a copy)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" \
                or weight.shape[1] % BLOCK:
            raise ValueError(f"BF16Weight: needs a 2-D bfloat16 CPU weight with K a multiple of {BLOCK}, got "
                             f"{weight.dtype} {list(weight.shape)} on {weight.device}")
        self.N, self.K = weight.shape
        C = -(-self.K // 32)
        w = torch.nn.functional.pad(weight.detach(), (0, C * 32 - self.K))
        self.data = _tiled(w.reshape(self.N, C, 32))
        self.ok, self.packed = True, False
        self.ptrs = (self.data.data_ptr(),)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _slots() -> torch.Tensor:
    """slot[w]: where weight w of a 32-weight group goes among the group's 32 nibbles (nibble 2b + h is
    the low (h = 0) or high nibble of byte b). Weights 4j..4j+3 are read from qword j % 2 of the 16
    bytes (gemm_cpu.c broadcasts them to every 128-bit lane and vpmultishiftqb reads qword j of lane
    j // 2), so qword 0 holds weights 0-3, 8-11, 16-19, 24-27 in that order and qword 1 the others."""
    w = torch.arange(32)
    return 16 * ((w // 4) % 2) + (w // 8) * 4 + w % 4


_SLOTS = _slots()


def swizzle(data: torch.Tensor) -> torch.Tensor:
    """NVFP4 codes [N, K/2] (element 2i in the low nibble of byte i) -> the kernel's order: per group of
    32 weights (16 bytes), weight w in nibble _SLOTS[w] (see _slots). A last group of 16 weights
    (K % 32 == 16) keeps the NVFP4 order; GemmWeight pads K to a multiple of 32 first."""
    N, half = data.shape
    full = half // 16 * 16
    codes = torch.stack((data[:, :full] & 0x0F, data[:, :full] >> 4), -1).reshape(N, full // 16, 32)
    nibbles = torch.empty_like(codes)
    nibbles[:, :, _SLOTS] = codes
    out = torch.empty_like(data)
    out[:, :full] = (nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)).reshape(N, full)
    out[:, full:] = data[:, full:]
    return out


def supported_weight(q: NVFP4Tensor) -> bool:
    """A weight the kernel reads: 2-D, 1x16 blocks, K a multiple of 16, no Hadamard, on the CPU."""
    return (isinstance(q, NVFP4Tensor) and len(q.shape) == 2 and q.tile in (16, (1, 16))
            and q.hadamard_seed is None and q.shape[-1] % BLOCK == 0 and q.data.device.type == "cpu"
            and q.data.dtype == torch.uint8 and q.block_scale.dtype == torch.float8_e4m3fn)


def dequantize_bf16(w: GemmWeight) -> torch.Tensor:
    """DQ(W) [N, K] in bfloat16 from the kernel's layout (what dequantize(q, torch.bfloat16) returns,
    ~8x faster: table lookups), in a per-thread buffer that the next call overwrites: use it at
    once (a prefill's F.linear) or clone it. Needs available() and w.ok."""
    if not available() or not w.ok:
        raise RuntimeError("cpu_gemm.dequantize_bf16 needs the kernel and a weight it reads (GemmWeight.ok)")
    out = _scratch("dequantized", w.N * w.K)
    _lib.nvfp4_gemm_dequantize(*w.ptrs, 0, w.N, w.K, out)
    return _local.buffers["dequantized"][:w.N * w.K].view(w.N, w.K)


def linear(x: torch.Tensor, w: GemmWeight | BF16Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bfloat16 @ W.T + bias -> [..., N] bfloat16, W = DQ(packed NVFP4) for a GemmWeight, or
    a BF16Weight's own values. Needs available() and w.ok. (Runs for every linear of every decode
    step: the checks are kept to what a wrong call would need.)"""
    if _lib is None and not available():
        raise RuntimeError("fp4rl.nvfp4.cpu_gemm.linear: the kernel is not available on this machine; "
                           "check available() and use dequantize + F.linear")
    K, N = w.K, w.N
    if x.dtype is not torch.bfloat16 or not x.is_cpu or x.shape[-1] != K:
        raise ValueError(f"cpu_gemm.linear: x must be bfloat16 [..., {K}] on the CPU, got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    if not w.ok:
        raise ValueError("cpu_gemm.linear: the weight has a non-finite global scale, a NaN block scale or "
                         f"more than {_MAX_TABLES} distinct global scales; use dequantize + F.linear")
    bias_ptr = None
    if bias is not None:
        if (bias.dtype is not torch.bfloat16 or bias.dim() != 1 or bias.shape[0] != N
                or bias.device.type != "cpu"):
            raise ValueError(f"cpu_gemm.linear: bias must be bfloat16 [{N}] on the CPU, got {bias.dtype} "
                             f"{list(bias.shape)} on {bias.device}")
        if not bias.is_contiguous():
            bias = bias.contiguous()
        bias_ptr = bias.data_ptr()
    flat = x.dim() == 2 and x.is_contiguous()
    x2 = x if flat else x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M == 0:
        return y if flat else y.reshape(*x.shape[:-1], N)
    K32 = -(-K // 32) * 32
    x_vnni = _scratch("x_vnni", -(-M // 16) * K32 * 16)
    packed = w.packed
    if M * N * K < (1 << 20) or torch.get_num_threads() <= 1:  # pack x and run every group in one C call
        if packed:
            rc = _lib.nvfp4_gemm(x2.data_ptr(), M, K, K, *w.ptrs, bias_ptr, N, y.data_ptr(), x_vnni,
                                 _work(M, K32))
        else:
            rc = _lib.bf16_gemm(x2.data_ptr(), M, K, K, *w.ptrs, bias_ptr, N, y.data_ptr(), x_vnni)
        if rc != 0:
            raise RuntimeError(f"cpu_gemm kernel failed ({rc})")
        return y if flat else y.reshape(*x.shape[:-1], N)
    _lib.nvfp4_gemm_pack_x(x2.data_ptr(), M, K, K, x_vnni)

    def rows(g0: int, g1: int) -> None:
        if packed:
            rc = _lib.nvfp4_gemm_rows(x_vnni, M, K, *w.ptrs, bias_ptr, g0, g1, N, y.data_ptr(), N,
                                      _work(M, K32))
        else:
            rc = _lib.bf16_gemm_rows(x_vnni, M, K, *w.ptrs, bias_ptr, g0, g1, N, y.data_ptr(), N)
        if rc != 0:
            raise RuntimeError(f"cpu_gemm kernel failed ({rc})")

    cpu._parallel_rows(rows, -(-N // GROUP), GROUP * K * M, 1)
    return y if flat else y.reshape(*x.shape[:-1], N)


def _work(M: int, K32: int) -> int:
    """The NVFP4 kernel's per-thread unpack buffer: a group's 64 x K32 weights (M > 16) or two chunks."""
    return _scratch("work", GROUP * K32 if M > 16 else 2 * GROUP * 32)


_local = threading.local()


def _scratch(name: str, elements: int) -> int:
    """Address of a per-thread bfloat16 work buffer of at least `elements` (kept between calls:
    fresh large allocations cost a page fault per 4 KiB on every call)."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(name)
    if buf is None or buf.numel() < elements:
        buf = buffers[name] = torch.empty(max(elements, 1 << 12), dtype=torch.bfloat16)
    return buf.data_ptr()
