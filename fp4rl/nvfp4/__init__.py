"""NVFP4: 4-bit E2M1 values, one E4M3 scale per 16, one FP32 global scale (per tensor or row).

Public API (the contract used by the trainer, the sampler and the exporter):
    quantize(x, *, tile, scale_rule, err, rounding, scale_scope, generator, global_scale,
             amax, allow_nonfinite, pad, hadamard_seed) -> NVFP4Tensor
    dequantize(q, dtype=torch.float32) -> Tensor      ((e2m1 * block_scale) * global_scale)
    fake_quantize(x, **same) -> Tensor                (dequantize(quantize(x)) in x's dtype)
and the format's building blocks (E2M1 table, packing, rounding, E4M3 cast, Hadamard).

reference.py is the specification (plain torch, CPU and CUDA). A faster implementation
(fp4rl/nvfp4/triton.py, byte-identical to the reference) is chosen here, in
``_select_implementation``, once it exists; until then every device uses the reference.
"""

from __future__ import annotations

from fp4rl.nvfp4 import reference
from fp4rl.nvfp4.format import (
    BLOCK,
    E2M1_MAX,
    E2M1_TABLE,
    E2M1_VALUES,
    E4M3_MAX,
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


def _select_implementation():
    """The module providing quantize/dequantize/fake_quantize. Only the reference exists yet;
    the Triton kernels will be picked here for CUDA tensors."""
    return reference


_impl = _select_implementation()
quantize = _impl.quantize
dequantize = _impl.dequantize
fake_quantize = _impl.fake_quantize

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E2M1_TABLE",
    "E2M1_VALUES",
    "E4M3_MAX",
    "GLOBAL_SCALE_MAX",
    "NVFP4Tensor",
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
