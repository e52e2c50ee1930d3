"""NVFP4: 4-bit E2M1 values, one E4M3 scale per 16, one FP32 global scale (per tensor or row).

Public API (the contract used by the trainer, the sampler and the exporter):
    quantize(x, *, tile, scale_rule, err, rounding, scale_scope, generator, global_scale,
             amax, allow_nonfinite, pad, hadamard_seed) -> NVFP4Tensor
    dequantize(q, dtype=torch.float32) -> Tensor      ((e2m1 * block_scale) * global_scale)
    fake_quantize(x, **same) -> Tensor                (dequantize(quantize(x)) in x's dtype)
and the format's building blocks (E2M1 table, packing, rounding, E4M3 cast, Hadamard).

reference.py is the specification (plain torch, CPU and CUDA). Faster implementations,
byte-identical to the reference, are chosen here per call (``_implementation``): the Triton
kernels (fp4rl/nvfp4/triton.py) for CUDA tensors, and a C kernel (fp4rl/nvfp4/cpu.py, built
with the system C compiler on first use and cached) for CPU tensors. Each hands what it does
not cover (stochastic rounding, Hadamard, non-finite input, ...) to the reference. The CPU
path pays off from the smallest tensor (one 16-block), so there is no size threshold; set
``FP4RL_NVFP4_CPU=reference`` to force the reference on CPU (read on every call). If the C
kernel cannot be built, one warning is issued and CPU tensors use the reference.
"""

from __future__ import annotations

import os

import torch

from fp4rl.nvfp4 import cpu, reference
from fp4rl.nvfp4.format import (
    BLOCK,
    E2M1_MAX,
    E2M1_TABLE,
    E2M1_VALUES,
    E4M3_MAX,
    NonFiniteError,
    NVFP4Tensor,
    block_encode_scale,
    cast_to_e4m3,
    e2m1_codes_to_values,
    pack_fp4,
    round_to_e2m1,
    true_div,
    unpack_fp4,
)
from fp4rl.nvfp4.hadamard import hadamard_signs, inverse_random_hadamard, random_hadamard
from fp4rl.nvfp4.reference import GLOBAL_SCALE_MAX, global_scales_from_amax


def _implementation(t):
    """The module that quantizes `t`: the Triton kernels for CUDA tensors (imported lazily:
    triton is only needed, and only imported, once a CUDA tensor is quantized), the C kernel
    for CPU tensors (unless FP4RL_NVFP4_CPU=reference, or it cannot be built), else the
    reference. All are byte-identical to the reference."""
    if isinstance(t, torch.Tensor) and t.is_cuda:
        try:
            from fp4rl.nvfp4 import triton as kernels
        except ImportError:  # no triton on this CUDA machine: the reference runs on CUDA too
            return reference
        return kernels
    if (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and os.environ.get("FP4RL_NVFP4_CPU", "fast") != "reference" and cpu.available()):
        return cpu
    return reference


def quantize(x, **kwargs) -> NVFP4Tensor:
    """See fp4rl.nvfp4.reference.quantize (the specification)."""
    return _implementation(x).quantize(x, **kwargs)


def dequantize(q: NVFP4Tensor, dtype=torch.float32):
    """(e2m1 * block_scale) * global_scale; see fp4rl.nvfp4.reference.dequantize."""
    return _implementation(getattr(q, "data", None)).dequantize(q, dtype)


def fake_quantize(x, **kwargs):
    """dequantize(quantize(x)) in x's dtype; see fp4rl.nvfp4.reference.fake_quantize."""
    return _implementation(x).fake_quantize(x, **kwargs)


__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_TABLE",
    "E2M1_VALUES",
    "E4M3_MAX",
    "GLOBAL_SCALE_MAX",
    "NVFP4Tensor",
    "NonFiniteError",
    "block_encode_scale",
    "cast_to_e4m3",
    "dequantize",
    "e2m1_codes_to_values",
    "fake_quantize",
    "global_scales_from_amax",
    "hadamard_signs",
    "inverse_random_hadamard",
    "pack_fp4",
    "quantize",
    "random_hadamard",
    "round_to_e2m1",
    "true_div",
    "unpack_fp4",
]
