"""The wgmma configuration of the mma16 kernel under ncu (bench/device_run23.sh): 14336x4096 at 128 rows
(split 2) and 256 rows (split 1), a few launches each."""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import gemv_cuda  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

n, k = 14336, 4096
w = reference.quantize(torch.randn(n, k, device="cuda") * 0.02)
wc = gemv_cuda.relayout(w.data, w.block_scale)
g = w.global_scale.float().reshape(-1)
for m in (128, 256):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        gemv_cuda.launch_wide(x, wc, g, y)
torch.cuda.synchronize()
