"""One decode token's K/V into the decode engine's static FP8 / NVFP4 cache, and attention over it.

The engine (fp4rl.gpu_decode) calls these where the fused q/k-norm + RoPE kernel does not write the cache
itself: `store_kv` quantizes and writes one slot as the cache's own `update` would, `attend_quantized`
writes and attends, `attend_nvfp4` / `attend_fp8` attend over an NVFP4 / FP8 cache whose slot is already
written. Every call runs on the engine's first bb rows, with the step's context (`ctx`: lengths, starts,
slot).
"""

from __future__ import annotations

import torch

from fp4rl.kvcache import _write


def attend_nvfp4(c, i: int, q, ctx, bb: int) -> torch.Tensor:
    """q [bb, H, 1, D] over layer i of an NVFP4 cache (its slot already written) -> [bb, H, D]."""
    from fp4rl.kernels.attention import decode_attention

    return decode_attention(q[:, :, 0], ctx.lengths, c.k_data[i][:bb], c.v_data[i][:bb],
                            c.k_global_scale[i][:bb, :, :, 0], c.v_global_scale[i][:bb, :, :, 0],
                            k_scale=c.k_block_scale[i][:bb], v_scale=c.v_block_scale[i][:bb],
                            starts=ctx.starts)


def attend_fp8(c, i: int, q, ctx, bb: int) -> torch.Tensor:
    """q [bb, H, 1, D] over layer i of an FP8 cache (its slot already written) -> [bb, H, D]."""
    from fp4rl.kernels.attention import decode_attention

    return decode_attention(q[:, :, 0], ctx.lengths, c.k[i][:bb], c.v[i][:bb],
                            c.k_scale[i][:bb, :, :, 0], c.v_scale[i][:bb, :, :, 0], starts=ctx.starts)


def attend_quantized(c, i: int, q, k, v, ctx, bb: int) -> torch.Tensor:
    """Write k/v [bb, H_kv, 1, D] into an FP8 / NVFP4 cache, attend with q [bb, H, 1, D] -> [bb, H, D]."""
    store_kv(c, i, k, v, ctx.slot, bb)
    if c.kind == "nvfp4":
        return attend_nvfp4(c, i, q, ctx, bb)
    return attend_fp8(c, i, q, ctx, bb)


def store_kv(cache, layer: int, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, bb: int) -> None:
    """Write one token's K/V [bb, H_kv, 1, D] at `slot` ([1] long) of an FP8 or NVFP4 cache's first
    bb rows, quantized as the cache's own `update` quantizes (NVFP4: the Triton quantizer, byte-
    identical to the reference; FP8: the cache's torch quantizer). No host sync."""
    if hasattr(cache, "k_data"):
        from fp4rl.kernels.quantize import quantize_2d

        kw = cache.quantize_kwargs
        for name, t in (("k", k), ("v", v)):
            b, h, _, d = t.shape
            data, scale, g = quantize_2d(t.reshape(-1, d), per_row=True, scale_rule=kw["scale_rule"],
                                         err=kw["err"], check_finite=False)
            _write(getattr(cache, f"{name}_data")[layer][:bb], slot, data.view(b, h, 1, d // 2))
            _write(getattr(cache, f"{name}_block_scale")[layer][:bb], slot, scale.view(b, h, 1, d // 16))
            _write(getattr(cache, f"{name}_global_scale")[layer][:bb], slot, g.view(b, h, 1, 1))
    else:
        for codes, scales, t in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
            q, s = cache.quantize(t)
            _write(codes[layer][:bb], slot, q)
            _write(scales[layer][:bb], slot, s)
