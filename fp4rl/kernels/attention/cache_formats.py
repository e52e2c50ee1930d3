"""The two KV-cache formats the decode-attention kernels read, and their quantizers.

At long context, decode attention is a pure stream over the KV cache, so its time is the
cache's bytes over memory bandwidth. Per token and KV head (d = 128) BF16 stores 512 B; FP8
with a per-token FP32 scale 132 B; NVFP4 152 B: 64 B of E2M1 codes, 8 E4M3 block scales (one
per 16 along head_dim) and one FP32 per-token global scale, for K and V alike (the cache is
fp4rl.kernels.quantize with per-row scales, a row being one token of one head).
"""

from __future__ import annotations

import torch


def quantize_kv_nvfp4(x: torch.Tensor, *, scale_rule: str = "6"):
    """K or V [B, Hkv, T, D] -> (data uint8 [B, Hkv, T, D/2], block_scale e4m3 [B, Hkv, T, D/16],
    global_scale float32 [B, Hkv, T]): NVFP4 with one global scale per token and head."""
    from fp4rl.kernels.quantize import quantize_2d

    lead, d = x.shape[:-1], x.shape[-1]
    data, scale, g = quantize_2d(x.reshape(-1, d), per_row=True, scale_rule=scale_rule, check_finite=False)
    return data.reshape(*lead, d // 2), scale.reshape(*lead, d // 16), g.reshape(lead)



def quantize_kv_fp8(x: torch.Tensor):
    """K or V [B, Hkv, T, D] -> (data float8_e4m3fn [B, Hkv, T, D], global_scale float32
    [B, Hkv, T]) with x ~= data * global_scale; global_scale = amax / 448 per token and head."""
    xf = x.float()
    amax = xf.abs().amax(-1)  # [B, Hkv, T]
    # enc <= 2^126 (global_scale >= the smallest normal float32): for amax below 448 * 2^-126, 448 / amax
    # would overflow to inf and the token's zeros become 0 * inf = NaN
    enc = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax)).clamp(max=2.0 ** 126)
    data = (xf * enc[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, 1.0 / enc

