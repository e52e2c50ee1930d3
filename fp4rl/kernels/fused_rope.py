"""The decode step's q/k-norm + RoPE kernel and its KV write (part of fp4rl.kernels.fused, which re-exports
`qk_norm_rope` and `fp4_cache_fits`; the arithmetic and its claims are described there): one program per
(row, head), q heads then k heads; a k head also moves its v head into the cache slot of a BF16 cache;
an NVFP4 cache's k and v heads (v heads in programs of their own) are quantized per (row, head) with the
shared quantizer's helpers (the bytes of `quantize_2d(per_row=True)`, i.e. of the cache's own quantizer
and of `decode_kv.store_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import COMPILED
from fp4rl.kernels.fused import (
    _bf16,
    _bits_max,
    _launch_opts,
    _quant_flags,
    _quantize_chunk,
    _row_globals,
    _rows,
    tlcuda,
)


@triton.jit
def _kv_fp4_store(x1, x2, r_flat, D, d_ptr, s_ptr, g_ptr, BH: tl.constexpr, RULE46: tl.constexpr,
                  MAE: tl.constexpr):
    """Q(x) of one head vector x = (x1 | x2) (float32 [BH] halves, BH = D / 2) with its own global scale
    (the NVFP4 KV cache's per (row, head, slot) scale) into row r_flat of the cache's flat [.., D / 2] data,
    [.., D / 16] block scales and [..] global scales: quantize_2d(x, per_row=True)'s bytes."""
    zero = tl.zeros((BH,), tl.int32)
    amax_bits = tl.max(tl.maximum(_bits_max(zero, x1), _bits_max(zero, x2)), 0)
    s_enc, s_dec, g, amax = _row_globals(amax_bits, BH // 16, RULE46)
    _quantize_chunk(x1, r_flat, 0, D, d_ptr, s_ptr, s_enc, s_dec, g, amax, BH, RULE46, MAE)
    _quantize_chunk(x2, r_flat, BH, D, d_ptr, s_ptr, s_enc, s_dec, g, amax, BH, RULE46, MAE)
    j = tl.arange(0, BH // 16)
    tl.store(g_ptr + r_flat + j * 0, g, mask=j == 0)


@triton.jit
def _e4m3_bits(v):
    """The E4M3 (fn) codes of float32 v, |v| <= 448, rounded to nearest even, as int32: the bytes of torch's
    v.to(torch.float8_e4m3fn). Integer arithmetic (and one exact float add for the subnormals), so Triton's
    interpreter gives the GPU's bits (its own float8 conversion rounds ties away, and misrounds others)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    # normal range (|v| >= 2^-6): the top 3 mantissa bits rounded to nearest even, exponent rebiased 127 -> 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - 960
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # subnormals: multiples of 2^-9, RNE
    return tl.where(a < 0.015625, sub, normal) | sign


@triton.jit
def _kv_fp8_store(x1, x2, m, i, half, c_ptr, c_off, s_ptr, s_off):
    """One head vector x = (x1 | x2) (float32 halves) into an FP8 cache slot as fp4rl.kvcache.FP8KVCache's
    quantize writes it: scale = max(amax / 448, 2^-126) (1 for a zero vector), codes = E4M3(clamp(x / scale,
    +-448)) at c_ptr + c_off (uint8 view of the codes), the scale at s_ptr + s_off (IEEE divisions)."""
    amax = tl.max(tl.maximum(tl.abs(x1), tl.abs(x2)), 0)
    # a NaN makes torch's amax NaN, so its scale 1 (NaN > 0 is false); Triton's max may skip NaNs: found apart
    has_nan = tl.max(((x1 != x1) | (x2 != x2)).to(tl.int32), 0) > 0
    scale = tl.math.div_rn(tl.zeros_like(x1) + amax, tl.zeros_like(x1) + 448.0)
    scale = tl.where(amax > 0, tl.maximum(scale, 1.1754943508222875e-38), 1.0)
    scale = tl.where(has_nan, 1.0, scale)
    r1, r2 = tl.math.div_rn(x1, scale), tl.math.div_rn(x2, scale)
    tl.store(c_ptr + c_off + i, _e4m3_code(r1).to(tl.uint8), mask=m)
    tl.store(c_ptr + c_off + half + i, _e4m3_code(r2).to(tl.uint8), mask=m)
    tl.store(s_ptr + s_off + i * 0, scale, mask=i == 0)


@triton.jit
def _e4m3_code(r):
    """torch's clamp(r, -448, 448).to(float8_e4m3fn) as int32 codes: a NaN (a NaN input, or inf / inf under
    an infinite scale) keeps its sign bit over 0x7F, as torch's conversion does (the sign the device's
    division gave it); Triton's maximum / minimum may not propagate NaNs, so they are picked out first."""
    code = _e4m3_bits(tl.minimum(tl.maximum(r, -448.0), 448.0))
    return tl.where(r != r, ((r.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F, code)


@triton.jit
def _kv_quant_store(x1, x2, m, i, half, row, j, slot, HKV, T, D, d_ptr, s_ptr, g_ptr, stride_b, stride_h,
                    stride_t, BH: tl.constexpr, RULE46: tl.constexpr, MAE: tl.constexpr,
                    TO_FP8: tl.constexpr):
    """Head j of row `row` (x = (x1 | x2), float32 halves) into slot `slot` of an FP8 cache (codes at the
    strides stride_*, scales contiguous [B, H_kv, T, 1]) or an NVFP4 one (one flat row per (row, head, slot);
    s_ptr: its block scales)."""
    if TO_FP8:
        _kv_fp8_store(x1, x2, m, i, half, d_ptr, row * stride_b + j * stride_h + slot * stride_t, g_ptr,
                      (row * HKV + j) * T + slot)
    else:
        _kv_fp4_store(x1, x2, (row * HKV + j) * T + slot, D, d_ptr, s_ptr, g_ptr, BH, RULE46, MAE)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
    kd_ptr, ks_ptr, kg_ptr, vd_ptr, vs_ptr, vg_ptr,
    H, HKV, D, T, stride_qkv, stride_cs, stride_qb, stride_kb, stride_kh, stride_kt, inv_d, eps,
    HAS_NORM: tl.constexpr, TO_CACHE: tl.constexpr, TO_FP4: tl.constexpr, RULE46: tl.constexpr,
    MAE: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr, TO_FP8: tl.constexpr = False,
):
    """Program (row, head): q heads 0..H-1, then k heads (each also moves its v head into a BF16 cache or
    output). The head's two halves x1 = x[:D/2], x2 = x[D/2:] are loaded apart, so rotate_half is (-x2, x1).
    TO_FP4: k and v go into an NVFP4 cache [B, H_kv, T, ...] at the slot, quantized per (row, head) (BH =
    D / 2); there the v heads are programs H + H_kv .. H + 2 H_kv - 1 (two quantizations one after another
    in the k programs made them the step's longest: 4.0 vs 2.0 us a call at one row on the H200).
    TO_FP8: k and v go into an FP8 cache at the slot (codes through kd_ptr / vd_ptr, uint8 views with the
    strides stride_k*, per-token scales through kg_ptr / vg_ptr, contiguous [B, H_kv, T, 1]); the v heads are
    programs of their own as for NVFP4."""
    if PDL:  # programmatic dependent launch: let the next kernel launch, then wait for our inputs
        tlcuda.gdc_launch_dependents()
        tlcuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = D // 2
    i = tl.arange(0, BH)
    m = i < half
    if (TO_FP4 or TO_FP8) and head >= H + HKV:  # a v head of a quantized cache: as it is (no norm, no RoPE)
        vsrc = qkv_ptr + row * stride_qkv + head * D
        v1 = tl.load(vsrc + i, mask=m, other=0.0).to(tl.float32)
        v2 = tl.load(vsrc + half + i, mask=m, other=0.0).to(tl.float32)
        _kv_quant_store(v1, v2, m, i, half, row, head - H - HKV, tl.load(slot_ptr), HKV, T, D, vd_ptr, vs_ptr,
                        vg_ptr, stride_kb, stride_kh, stride_kt, BH, RULE46, MAE, TO_FP8)
    else:
        is_q = head < H
        src = qkv_ptr + row * stride_qkv + head * D
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + i, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.math.rsqrt(tl.sum(x1 * x1 + x2 * x2, 0) * inv_d + eps)
            if is_q:
                w1 = tl.load(qw_ptr + i, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(qw_ptr + half + i, mask=m, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + i, mask=m, other=0.0).to(tl.float32)
                w2 = tl.load(kw_ptr + half + i, mask=m, other=0.0).to(tl.float32)
            x1 = _bf16(w1 * _bf16(x1 * rstd))
            x2 = _bf16(w2 * _bf16(x2 * rstd))
        cs = cos_ptr + row * stride_cs
        sn = sin_ptr + row * stride_cs
        c1 = tl.load(cs + i, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cs + half + i, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sn + i, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sn + half + i, mask=m, other=0.0).to(tl.float32)
        o1 = _bf16(_bf16(x1 * c1) + _bf16(-x2 * s1))
        o2 = _bf16(_bf16(x2 * c2) + _bf16(x1 * s2))
        if is_q:
            dst = q_ptr + row * stride_qb + head * D
            tl.store(dst + i, o1.to(q_ptr.dtype.element_ty), mask=m)
            tl.store(dst + half + i, o2.to(q_ptr.dtype.element_ty), mask=m)
        elif TO_FP4 or TO_FP8:  # k into the quantized cache's slot; v heads: programs of their own
            _kv_quant_store(o1, o2, m, i, half, row, head - H, tl.load(slot_ptr), HKV, T, D, kd_ptr, ks_ptr,
                            kg_ptr, stride_kb, stride_kh, stride_kt, BH, RULE46, MAE, TO_FP8)
        else:
            j = head - H
            if TO_CACHE:  # the bf16 cache [B, H_kv, T, D]: slot `slot` of this row and head
                off = row * stride_kb + j * stride_kh + tl.load(slot_ptr) * stride_kt
            else:  # k out [B, H_kv, 1, D]
                off = row * stride_kb + j * stride_kh
            tl.store(k_ptr + off + i, o1.to(k_ptr.dtype.element_ty), mask=m)
            tl.store(k_ptr + off + half + i, o2.to(k_ptr.dtype.element_ty), mask=m)
            if TO_CACHE:
                vsrc = qkv_ptr + row * stride_qkv + (H + HKV + j) * D
                v1 = tl.load(vsrc + i, mask=m, other=0.0)
                v2 = tl.load(vsrc + half + i, mask=m, other=0.0)
                tl.store(v_ptr + off + i, v1.to(v_ptr.dtype.element_ty), mask=m)
                tl.store(v_ptr + off + half + i, v2.to(v_ptr.dtype.element_ty), mask=m)


def fp4_cache_fits(head_dim: int) -> bool:
    """Whether qk_norm_rope can write an NVFP4 KV cache itself: each half of a head a power of two >= 16."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
                 head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot: torch.Tensor | None = None, fp4_cache: tuple | None = None,
                 fp4_quant: dict | None = None, fp8_cache: tuple | None = None):
    """q/k-norm (when weights are given; eps: the norms' epsilon, required since it is per model: Qwen3 1e-6,
    Llama 1e-5) and RoPE of one token per row, qkv [R, (H + 2 H_kv) D] = the fused q|k|v projection, cos/sin
    [R, D] of qkv's dtype (bf16, the step's tables). With k_cache/v_cache ([B >= R, H_kv, T, D] bf16) and
    slot ([1] long on the device) k and v are written at that slot and (q, None) is returned; with fp4_cache
    = (k_data, k_block_scale, k_global_scale, v_data, v_block_scale, v_global_scale), one layer of an NVFP4
    KV cache ([B >= R, H_kv, T, D/2] uint8, [.., D/16] float8_e4m3fn, [.., 1] float32, contiguous) and
    slot, k (after the norm and RoPE) and v are quantized per (row, head) with fp4_quant's scale_rule / err
    (quantize_2d(per_row=True)'s bytes, i.e. the cache's own quantizer) into that slot and (q, None) is
    returned (head_dim: ``fp4_cache_fits``); with fp8_cache = (k_codes, k_scale, v_codes, v_scale), one layer
    of an FP8 KV cache ([B >= R, H_kv, T, D] float8_e4m3fn with a contiguous last dim, k's and v's strides
    equal; [B, H_kv, T, 1] float32, contiguous) and slot, k and v are quantized per (row, head) as
    fp4rl.kvcache.FP8KVCache.quantize does (its bytes and scales, as decode_kv.store_kv writes them) into
    that slot and (q, None) is returned; otherwise (q, k) with q [R, H, 1, D], k [R, H_kv, 1, D]."""
    _rows(qkv, "qkv")
    r = qkv.shape[0]
    d = head_dim
    if qkv.shape[1] != (n_heads + 2 * n_kv_heads) * d or d % 2:
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} does not fit {n_heads}+2x{n_kv_heads} heads "
                         f"of {d} (an even head_dim); pass the fused q|k|v projection of one token per row")
    for name, t in (("cos", cos), ("sin", sin)):
        _rows(t, name)
        if tuple(t.shape) != (r, d) or t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"qk_norm_rope: {name} must be [{r}, {d}] {qkv.dtype} on {qkv.device} (one RoPE "
                             f"row per qkv row, qkv's dtype: model.rope_tables(..., dtype=qkv.dtype)), got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if cos.stride() != sin.stride():
        raise ValueError(f"qk_norm_rope: cos and sin need one layout, got strides {cos.stride()} and "
                         f"{sin.stride()}; pass .contiguous() tables")
    has_norm = q_weight is not None
    if (k_weight is not None) != has_norm:
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight (q/k-norm) or neither")
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            if w.numel() != d or not w.is_contiguous() or w.device != qkv.device:
                raise ValueError(f"qk_norm_rope: {name} must be the {name[0]}_norm's contiguous [{d}] weight "
                                 f"(head_dim) on {qkv.device}, got {tuple(w.shape)} on {w.device}")
    q = torch.empty(r, n_heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    to_cache = k_cache is not None
    to_fp4 = fp4_cache is not None
    to_fp8 = fp8_cache is not None
    rule46 = mae = False
    cache_args = (q,) * 6
    t_cap = 0
    if to_fp4:
        if to_cache or slot is None:
            raise ValueError("qk_norm_rope: an NVFP4 cache write takes fp4_cache and slot (no k_cache / "
                             "v_cache)")
        if not fp4_cache_fits(d):
            raise ValueError(f"qk_norm_rope: an NVFP4 cache write needs head_dim / 2 a power of two >= 16, "
                             f"got head_dim {d}; write the cache with decode_kv.store_kv")
        rule46, mae = _quant_flags(fp4_quant or {})
        if len(fp4_cache) != 6:
            raise ValueError("qk_norm_rope: fp4_cache is (k_data, k_block_scale, k_global_scale, v_data, "
                             "v_block_scale, v_global_scale) of one layer")
        lead = tuple(fp4_cache[0].shape[:3])
        want = [((d // 2,), torch.uint8), ((d // 16,), torch.float8_e4m3fn), ((1,), torch.float32)] * 2
        for t, (tail, dtype) in zip(fp4_cache, want):
            if (t.ndim != 4 or tuple(t.shape[:3]) != lead or tuple(t.shape[3:]) != tail or t.dtype != dtype
                    or not t.is_contiguous() or t.device != qkv.device or lead[0] < r
                    or lead[1] != n_kv_heads):
                raise ValueError(f"qk_norm_rope: fp4_cache tensors must be contiguous [B >= {r}, "
                                 f"{n_kv_heads}, T, D/2 | D/16 | 1] uint8 / float8_e4m3fn / float32 on "
                                 f"{qkv.device}, got {tuple(t.shape)} {t.dtype}")
        t_cap = lead[2]
        cache_args = tuple(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in fp4_cache)
    if to_fp8:
        if to_cache or to_fp4 or slot is None:
            raise ValueError("qk_norm_rope: an FP8 cache write takes fp8_cache and slot (no k_cache / "
                             "v_cache / fp4_cache)")
        if len(fp8_cache) != 4:
            raise ValueError("qk_norm_rope: fp8_cache is (k_codes, k_scale, v_codes, v_scale) of one layer")
        kc, ksc, vc, vsc = fp8_cache
        lead = tuple(kc.shape[:3])
        ok = (kc.ndim == 4 and kc.shape == vc.shape and kc.stride() == vc.stride() and kc.stride(-1) == 1
              and tuple(kc.shape[1:2]) + tuple(kc.shape[3:]) == (n_kv_heads, d) and lead[0] >= r
              and kc.dtype == vc.dtype == torch.float8_e4m3fn)
        for t in (ksc, vsc):
            ok = ok and tuple(t.shape) == (*lead, 1) and t.dtype == torch.float32 and t.is_contiguous()
        if not ok or any(t.device != qkv.device for t in fp8_cache):
            raise ValueError(f"qk_norm_rope: fp8_cache must be k / v codes float8_e4m3fn [B >= {r}, "
                             f"{n_kv_heads}, T, {d}] (one layout, contiguous last dim) and their float32 "
                             f"scales [B, {n_kv_heads}, T, 1] (contiguous) on {qkv.device}, got "
                             f"{[(tuple(t.shape), t.dtype) for t in fp8_cache]}")
        t_cap = lead[2]
        cache_args = (kc.view(torch.uint8), q, ksc, vc.view(torch.uint8), q, vsc)
    if (to_cache or to_fp4 or to_fp8) and slot is not None and (slot.dtype != torch.long or slot.numel() != 1
                                                                or slot.device != qkv.device):
        raise ValueError(f"qk_norm_rope: slot must be a [1] torch.long tensor on {qkv.device} (the cache "
                         f"slot to write), got {slot.dtype} {tuple(slot.shape)} on {slot.device}")
    if to_cache:
        if v_cache is None or slot is None or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("qk_norm_rope: a cache write needs k_cache and v_cache of one layout and slot")
        if k_cache.ndim != 4 or k_cache.shape[0] < r or tuple(k_cache.shape[1:2]) + tuple(k_cache.shape[3:]) \
                != (n_kv_heads, d) or k_cache.shape != v_cache.shape or k_cache.device != qkv.device:
            raise ValueError(f"qk_norm_rope: k_cache/v_cache must be [B >= {r}, {n_kv_heads}, T, {d}] on "
                             f"{qkv.device}, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
        k_out, v_out = k_cache, v_cache
        kb, kh, kt = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    elif to_fp4:
        k_out = v_out = q  # unused
        kb = kh = kt = 0
    elif to_fp8:
        k_out = v_out = q  # unused
        kb, kh, kt = fp8_cache[0].stride(0), fp8_cache[0].stride(1), fp8_cache[0].stride(2)
    else:
        k_out = torch.empty(r, n_kv_heads, 1, d, dtype=qkv.dtype, device=qkv.device)
        v_out = k_out
        kb, kh, kt = k_out.stride(0), k_out.stride(1), 0
    if r:
        grid = (r, n_heads + (2 if to_fp4 or to_fp8 else 1) * n_kv_heads)
        COMPILED["fused qk_norm_rope"] = _qk_norm_rope_kernel[grid](
            qkv, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos, q, k_out, v_out,
            slot if slot is not None else q, *cache_args, n_heads, n_kv_heads, d, t_cap, qkv.stride(0),
            cos.stride(0), q.stride(0),
            kb, kh, kt, 1.0 / d, eps, HAS_NORM=has_norm, TO_CACHE=to_cache, TO_FP4=to_fp4, RULE46=rule46,
            MAE=mae, BH=max(16, triton.next_power_of_2(d // 2)), TO_FP8=to_fp8, num_warps=1,
            enable_fp_fusion=False, **_launch_opts(qkv.device))
    return q, (None if to_cache or to_fp4 or to_fp8 else k_out)
