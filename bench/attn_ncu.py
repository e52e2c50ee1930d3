"""One call of the Gluon NVFP4 decode attention (batch 8, 32/8 heads, d 128, context argv[1], mode argv[2])
for Nsight Compute: ncu --clock-control none -k regex:decode_attn python3 bench/attn_ncu.py 32768"""
import sys

import torch

sys.path.insert(0, ".")
from fp4rl.kernels import attention as A  # noqa: E402

t = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
mode = int(sys.argv[2]) if len(sys.argv) > 2 else 4
b, hq, hkv, d = 8, 32, 8, 128
q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
kq = A.quantize_kv_nvfp4(torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16))
vq = A.quantize_kv_nvfp4(torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16))
lengths = torch.full((b,), t, dtype=torch.int32, device="cuda")
for _ in range(2):
    A.decode_attention(q, lengths, kq[0], vq[0], kq[2], vq[2], k_scale=kq[1], v_scale=vq[1], kernel="gluon",
                       _mode=mode)
torch.cuda.synchronize()
