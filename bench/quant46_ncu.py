"""ncu target (twenty-sixth session): one launch of the row quantize kernel per variant, rule 4/6 MSE on a
32768x4096 bfloat16 tensor, in this order: 4 then 2 blocks per thread, each with FAST46 2, 1, 0 (decide46 with
the codes in its pass, decide46 with a codes pass, exact); with arguments, those FAST46 levels with the
launcher's own blocks a thread (2 held in registers, or 8 read twice with RELOAD, its default since the
twenty-seventh session's last calls), and with "flat" among them per-tensor scales (nvfp4_amax, then the flat
kernel) instead. Usage (device):
ncu --kernel-name nvfp4_quant_rows ... python3 bench/quant46_ncu.py [FAST46 levels] [flat]"""

import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402
from fp4rl.kernels.quantize import quantize_2d  # noqa: E402

x = (torch.randn(32768, 4096, device="cuda") * torch.logspace(-2, 2, 4096, device="cuda")).to(torch.bfloat16)
levels = [int(a) for a in sys.argv[1:] if a != "flat"]
per_row = "flat" not in sys.argv[1:]
for bpt in ((2,) if levels else (4, 2)):
    for fast in (levels or (2, 1, 0)):
        qc.FAST46 = fast
        if not levels:
            qc.ROWS_BPT["4/6"] = bpt
        quantize_2d(x, scale_rule="4/6", per_row=per_row, check_finite=False)
        torch.cuda.synchronize()
        print(f"launched: bpt {bpt} FAST46 {fast}", flush=True)
