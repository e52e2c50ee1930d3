"""ncu target (twenty-sixth session): one launch of the row quantize kernel per variant, rule 4/6 MSE on a
32768x4096 bfloat16 tensor, in this order: (decide46 | exact) x (4, 2, 1 blocks per thread). Usage (device):
ncu --kernel-name nvfp4_quant_rows ... python3 bench/quant46_ncu.py"""

import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402
from fp4rl.kernels.quantize import quantize_2d  # noqa: E402

x = (torch.randn(32768, 4096, device="cuda") * torch.logspace(-2, 2, 4096, device="cuda")).to(torch.bfloat16)
for bpt in (4, 2, 1):
    for fast in (True, False):
        qc.FAST46 = fast
        qc.ROWS_BPT["4/6"] = bpt
        quantize_2d(x, scale_rule="4/6", per_row=True, check_finite=False)
        torch.cuda.synchronize()
        print(f"launched: bpt {bpt} {'decide46' if fast else 'exact'}", flush=True)
