"""Kernel durations of the Gluon attention under ncu (bench/device_run9.sh NCU=1): normal, no streaming."""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import attention as A  # noqa: E402

b, hq, hkv, d = 8, 32, 8, 128
for t in (32768, 4096):
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((b,), t, dtype=torch.int32, device="cuda")
    kq, vq = A.quantize_kv_nvfp4(k), A.quantize_kv_nvfp4(v)
    for dbg in (0, 3, 7, 4, 3, 7, 4):
        A.decode_attention(q, lengths, kq[0], vq[0], kq[2], vq[2], k_scale=kq[1], v_scale=vq[1],
                           kernel="gluon",
                           _dbg=dbg)
    torch.cuda.synchronize()
