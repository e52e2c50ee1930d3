"""Test-session setup that must happen before any test module imports triton.

On machines without a GPU the Triton kernels run in the interpreter. TRITON_INTERPRET is read
when a kernel is decorated, and some oracle libraries (torchao) import triton and its helpers
early, so the variable is set here, before collection, rather than in the kernel test modules.
"""

import os
import shutil
import subprocess


def _has_cuda_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_cuda_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the GEMM tuner times every candidate in tests (no picks from, or written to, the user's disk cache);
# tests of the cache set their own directory
os.environ["FP4RL_TUNE_CACHE"] = "0"
