"""Programmatic dependent launch (PDL) on Hopper for the decode step's kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still running; it does
its independent work first (the mma16 GEMM streams its first weight stages into shared memory), then
waits with ``griddepcontrol.wait`` until the previous grid has finished and its writes are visible. Each
PDL kernel also calls ``griddepcontrol.launch_dependents`` at its start so the next one can be scheduled
as soon as all of its own blocks are resident. At batch 1 a decode step is ~300 short kernels, so the
launch gap and the DRAM ramp-up of each are a large part of the step.

Only kernels that wait before touching their inputs may be launched with the attribute: the CUDA GEMM
(fp4rl/kernels/gemv_mma16.cu) and the fused Triton kernels (fp4rl/kernels/fused.py). Others (cuBLAS,
SDPA) launch normally and keep full stream ordering. CUDA graphs capture the programmatic edges.

``FP4RL_PDL=0`` (or ``set_enabled(False)``) turns it off; launches made while it is off carry no
attribute and the kernels' ``griddepcontrol`` instructions are no-ops.

Which launches carry it (``KINDS``): by default the fused Triton kernels, the grouped (routed-expert) GEMM and
the dense CUDA GEMM at one row ("gemv"), the CUDA MoE router + route ("route"), not the dense GEMM at 2-16
rows ("mma"), its wgmma configuration ("wide"), the Triton decode attention ("attn": no faster in the 30B
step, thirty-first session) or the Gluon NVFP4 decode attention ("gluon": Qwen3-8B at 4K context, batch 1 / 8
/ 32, 3.075 / 4.141 / 6.124 ms a step without it, 3.105 / 4.162 / 6.086 with it, H100, fiftieth session):
``DEFAULT_OFF``.
Measured on the H200 at full depth, W4A16 (bench/RESULTS.md, "sampler on H200", fourteenth session): PDL on
the dense GEMM cost Qwen3-8B's step 0.75 ms of 5.15 at batch 32 and 0.18 ms of 3.1 at batch 8, and
Qwen3-30B-A3B's 0.23 ms of 7.7 at batch 32, while at batch 1 it saved 0.04-0.09 ms and PDL on the Triton
kernels saved 0.30 ms of 2.7 (Qwen3-30B-A3B). ``FP4RL_PDL_OFF`` (comma-separated kinds, empty for none) or
``set_kinds_off`` chooses another set.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

# the kinds of PDL launch: the dense CUDA GEMM's mma.sync configurations at 1 row ("gemv") and at 2-16 rows
# ("mma"), its wgmma configuration ("wide": 17+ rows, and 2-16 where gemv_cuda.choose_narrow takes it), its
# grouped (routed-expert) launches, the fused Triton kernels, the Triton decode attention ("attn": BF16 and
# FP8 caches, and NVFP4 where the Gluon kernel does not take it), the CUDA MoE router + route (moe_route_cuda:
# "route", which reads the router weight before its wait), the Gluon NVFP4 decode attention ("gluon": off by
# default, no faster in the 8B's step at 4K context)
KINDS = ("gemv", "mma", "wide", "grouped", "triton", "attn", "route", "gluon")
DEFAULT_OFF = frozenset({"mma", "wide", "attn", "gluon"})


def _kinds(names, what: str) -> frozenset:
    """`names` as a frozenset of KINDS; an unknown one raises, `what` saying where it came from."""
    names = frozenset(names)
    if names - set(KINDS):
        raise ValueError(f"{what} unknown launch kinds {sorted(names - set(KINDS))}; the kinds are {KINDS}")
    return names


def env_kinds_off() -> frozenset:
    """The kinds FP4RL_PDL_OFF names (comma-separated, empty for none), else DEFAULT_OFF."""
    if "FP4RL_PDL_OFF" not in os.environ:
        return DEFAULT_OFF
    names = (k.strip() for k in os.environ["FP4RL_PDL_OFF"].split(","))
    return _kinds((k for k in names if k), "FP4RL_PDL_OFF names")


_STATE = {"on": os.environ.get("FP4RL_PDL", "1") != "0", "step": 0, "hazard": False, "off": env_kinds_off()}
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


def set_enabled(on: bool) -> None:
    """Switch PDL on or off for launches made from now on (graphs captured before keep what they have)."""
    _STATE["on"] = bool(on)


def is_enabled() -> bool:
    return _STATE["on"]


def set_kinds_off(kinds) -> None:
    """Launches of these kinds (``KINDS``) go without PDL from now on; the others keep it."""
    _STATE["off"] = _kinds(kinds, "set_kinds_off:")


def kinds_off() -> frozenset:
    return _STATE["off"]


def enabled(device) -> bool:
    """PDL for launches on `device`: switched on, a CUDA device of compute capability >= 9."""
    if not _STATE["on"] or not torch.cuda.is_available():
        return False
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] >= 9


@functools.cache
def triton_supported() -> bool:
    """This Triton has the griddepcontrol builtins and the `launch_pdl` launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tlcuda
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(tlcuda, "gdc_wait") and hasattr(tlcuda, "gdc_launch_dependents") and "launch_pdl" in fields


@contextlib.contextmanager
def step():
    """The scope of a decode step (the engine's eager step or graph capture): only inside it does the CUDA
    GEMM prefetch weights before waiting, because only there is it known that no kernel just before it
    wrote those weights (decode copies are rebuilt before the step; a rebuild inside calls `hazard`)."""
    _STATE["step"] += 1
    try:
        yield
    finally:
        _STATE["step"] -= 1


def hazard() -> None:
    """The stream just wrote weights that a GEMM may read next: its launch goes without PDL."""
    _STATE["hazard"] = True


def gemm_flag(device, kind: str) -> bool:
    """Whether the CUDA GEMM's launch of `kind` (one of KINDS) on `device` carries the PDL attribute now
    (consumes a hazard)."""
    if _STATE["hazard"]:
        _STATE["hazard"] = False
        return False
    return _STATE["step"] > 0 and kind not in _STATE["off"] and enabled(device)


def weights_flag(device, kind: str) -> bool:
    """Whether a launch of `kind` that reads a module's weights before its griddepcontrol.wait (the CUDA MoE
    router + route) carries the PDL attribute now: inside a step, with no hazard pending (which it leaves for
    the GEMM it concerns)."""
    return _STATE["step"] > 0 and not _STATE["hazard"] and kind not in _STATE["off"] and enabled(device)


def triton_flag(device, kind: str = "triton") -> bool:
    """The `PDL` constexpr (and `launch_pdl`) for a Triton kernel of `kind` ("triton", "attn" or "gluon")
    launched on `device`."""
    return kind not in _STATE["off"] and enabled(device) and triton_supported()


# ----------------------------------------------------------------------------- cuLaunchKernelEx
class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


def launch(kern, grid: tuple, block: tuple, args: list, shared_mem: int, stream: torch.cuda.Stream,
           pdl: bool) -> None:
    """Launch a kernel compiled by ``torch.cuda._compile_kernel`` (its ``.func``) through
    cuLaunchKernelEx, with the programmatic-stream-serialization attribute when `pdl`. Tensors are
    passed as device pointers, Python ints as 32-bit ints (the kernels' int parameters), ctypes structures
    by value (a CUtensorMap: tensor_map.x_tensor_map)."""
    keep = []
    ptrs = (ctypes.c_void_p * len(args))()
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            v = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, ctypes.Structure):
            v = a
        elif isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"kernel argument {i}: tensors, ints and ctypes structures only, got "
                            f"{type(a).__name__}")
        else:
            if not -(2 ** 31) <= a < 2 ** 31:
                raise ValueError(f"kernel argument {i} = {a} does not fit a 32-bit int")
            v = ctypes.c_int(a)
        keep.append(v)
        ptrs[i] = ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
    attr = _Attr()
    attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.flag = 1
    cfg = _Config()
    cfg.grid[:] = list(grid)
    cfg.block[:] = list(block)
    cfg.shared = shared_mem
    cfg.stream = ctypes.c_void_p(stream.cuda_stream)
    cfg.attrs = ctypes.pointer(attr) if pdl else None
    cfg.num_attrs = 1 if pdl else 0
    lib = torch.cuda._utils._get_gpu_runtime_library()
    rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), kern.func, ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc} (grid {grid}, block {block}, "
                           f"{shared_mem} B shared, pdl={pdl})")
