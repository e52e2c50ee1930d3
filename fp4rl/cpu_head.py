"""The sampler's token choice on the CPU in one fused C pass per row (fp4rl/sampling_cpu.c).

`sample_head(logits, greedy, temperature, generator)` returns the tokens [B] and their logprobs
[B] under log_softmax(logits / T) for greedy decoding or plain temperature sampling (no top-k /
top-p), reading BF16 or FP32 logits in place: max, sum of exponentials and, when sampling, the
inverse CDF at a uniform drawn from `generator` (so a seed fixes the tokens). torch needs a float
copy, argmax, logsumexp, softmax and a cumulative sum for the same (4-6 ms per step at 16 x 49152
here, against well under 1 ms).

The BF16 CPU sampler uses it (`Sampler(fast_head=...)`); it returns None, and the caller uses
the torch code, when the C file cannot be built, the CPU lacks AVX-512, or a row's logits are not
finite. Its exp is a polynomial (~2 ulp in float32), so logprobs differ from torch's by float32
rounding, and a sampled token can differ from the torch path's for the same uniform only when
u * total falls within rounding of a CDF step.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from fp4rl.nvfp4 import cpu

_SOURCE = Path(__file__).with_name("sampling_cpu.c")
_CFLAGS = ("-O3", "-march=native", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-std=gnu11",
           "-fPIC", "-shared")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_lock = threading.Lock()
_lib = None
_failed: str | None = None


def _load() -> ctypes.CDLL:
    reason = cpu.missing_cpu_flags(_CPU_FLAGS)
    if reason:
        raise RuntimeError(reason)
    lib = cpu.open_library(lambda: cpu.build(_SOURCE, _CFLAGS, ldflags=("-lm",)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sampling_head.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr]
    lib.sampling_head.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the fused head runs here (builds it on first use; warns once if that fails)."""
    return cpu.load_once(globals(), _load, lambda failed: (
        f"fp4rl.cpu_head: the fused sampling head is unavailable ({failed}); the sampler uses torch ops"))


def sample_head(logits: torch.Tensor, greedy: bool, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens int64 [B], logprobs float32 [B]) from logits [B, V] (BF16 or FP32, CPU), or None
    when the fused head does not apply (see the module docstring)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32) \
            or logits.ndim != 2 or not available():
        return None
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = z.shape
    tokens = torch.empty(B, dtype=torch.int64)
    logprobs = torch.empty(B, dtype=torch.float32)
    uniforms = None if greedy else torch.rand(B, generator=generator, dtype=torch.float64)
    t = 1.0 if greedy else float(temperature)
    rc = _lib.sampling_head(z.data_ptr(), int(z.dtype == torch.bfloat16), 0, B, V, z.stride(0),
                            ctypes.c_float(t), None if uniforms is None else uniforms.data_ptr(),
                            tokens.data_ptr(), logprobs.data_ptr())
    if rc != 0:
        return None
    return tokens, logprobs
