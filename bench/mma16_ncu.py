"""The mma16 kernel under ncu (bench/device_run11.sh NCU=1): a few launches of two shapes at 1 row."""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import gemv_cuda  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

for n, k in ((4096, 14336), (14336, 4096)):
    w = reference.quantize(torch.randn(n, k, device="cuda") * 0.02)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        gemv_cuda.launch(x, wc, w.global_scale.float().reshape(-1), y)
torch.cuda.synchronize()
