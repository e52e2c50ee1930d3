"""CUtensorMap descriptors for the copy engine's tensor copies (cp.async.bulk.tensor): made on the host with
the driver's cuTensorMapEncodeTiled and passed to a kernel by value (fp4rl.kernels.pdl.launch takes ctypes
structures). Used by the warp-specialized wgmma build of the W4A16 GEMM (gemv_mma16.cu WS) to copy x."""

from __future__ import annotations

import ctypes

import torch


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes, passed to a kernel by value (64-byte aligned there)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_TMAPS: dict = {}  # (address, rows, K, row stride, box rows) -> its TensorMap (eager launches encode once)


def x_tensor_map(x2: torch.Tensor, box_rows: int) -> TensorMap:
    """The tensor map through which the warp-specialized wgmma build (gemv_mma16.cu WS) copies x [M, K]
    bfloat16 (unit column stride, 16-byte rows): boxes of 64 k x `box_rows` rows into the 128-byte swizzle of
    its stages, rows past M read as zeros."""
    m, k = x2.shape
    if (x2.stride(1) != 1 or x2.stride(0) < k or (x2.stride(0) * 2) % 16 or x2.data_ptr() % 16
            or not 1 <= box_rows <= 256):
        raise ValueError(f"x {tuple(x2.shape)} stride {x2.stride()} (box {box_rows} rows) does not fit a "
                         "tensor map: unit column stride, 16-byte aligned rows that do not overlap, at most "
                         "256 rows a box")
    key = (x2.data_ptr(), m, k, x2.stride(0), box_rows)
    tm = _TMAPS.get(key)
    if tm is not None:
        return tm
    tm = TensorMap()
    dims = (ctypes.c_uint64 * 2)(k, m)
    strides = (ctypes.c_uint64 * 1)(x2.stride(0) * 2)
    box = (ctypes.c_uint32 * 2)(64, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    # bfloat16 (9), no interleave (0), 128-byte swizzle (3), L2 promotion 256 B (3), out-of-bounds zeros (0)
    rc = lib.cuTensorMapEncodeTiled(ctypes.byref(tm), 9, 2, ctypes.c_void_p(x2.data_ptr()), dims, strides,
                                    box, elem, 0, 3, 3, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (x {tuple(x2.shape)} stride "
                           f"{x2.stride()}, box 64 x {box_rows})")
    if len(_TMAPS) >= 1024:
        _TMAPS.clear()
    _TMAPS[key] = tm
    return tm
