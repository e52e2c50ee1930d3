"""The PRENORM mma16 GEMM under ncu against the plain launch (bench/device_run120.sh): Qwen3-8B's gate/up
(24576 x 4096) and q/k/v (6144 x 4096) at one row, a few launches each: plain, then PRENORM (the residual add
+ RMSNorm in the x staging). Isolated launches (no graph, no PDL chain): what the kernel itself costs."""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import gemv_cuda, gemv_cuda_prenorm  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

for n, k in ((24576, 4096), (6144, 4096)):
    w = reference.quantize(torch.randn(n, k, device="cuda") * 0.02)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    g = w.global_scale.float().reshape(-1)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nw = torch.rand(k, device="cuda").bfloat16() + 0.5
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        gemv_cuda.launch(x, wc, g, y)
    for _ in range(3):
        assert gemv_cuda_prenorm.launch_prenorm(x, h, nw, 1e-6, wc, g, y) is not None
torch.cuda.synchronize()
