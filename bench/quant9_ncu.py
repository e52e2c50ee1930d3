"""Quantize kernels under ncu (bench/device_run9.sh QNCU=1): amax pass, flat and rows kernels."""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import quantize as Q  # noqa: E402

x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    Q.quantize_2d(x, check_finite=False)
    Q.quantize_2d(x, per_row=True, check_finite=False)
    Q.quantize_2d(x, scale_rule="4/6", check_finite=False)
torch.cuda.synchronize()
