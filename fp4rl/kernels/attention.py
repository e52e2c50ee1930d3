"""Decode attention (one query token per sequence) over an NVFP4 or FP8 KV cache, in Triton.

At long context, decode attention is a pure stream over the KV cache, so its time is the
cache's bytes over memory bandwidth. Per token and KV head (d = 128) BF16 stores 512 B; FP8
with a per-token FP32 scale 132 B; NVFP4 152 B: 64 B of E2M1 codes, 8 E4M3 block scales (one
per 16 along head_dim) and one FP32 per-token global scale, for K and V alike (the cache is
fp4rl.kernels.quantize with per-row scales, a row being one token of one head).

Layouts (the kernel takes strides; the last dim must be contiguous):
    q        [B, Hq, D] bfloat16              lengths int32 [B] (valid tokens per sequence)
    starts   optional int32 [B]: sequence b's valid tokens are [starts[b], lengths[b]) (left padding)
    NVFP4:   k_data, v_data uint8 [B, Hkv, T, D/2]; k_scale, v_scale float8_e4m3fn
             [B, Hkv, T, D/16]; k_global, v_global float32 [B, Hkv, T]
    FP8:     k_data, v_data float8_e4m3fn [B, Hkv, T, D]; k_global, v_global float32 [B, Hkv, T]
    out      [B, Hq, D] bfloat16

Flash-decoding: program (b, kv head, split) handles the Hq/Hkv query heads that share the KV
head (GQA: each KV byte is read once for all of them) over 1/NUM_SPLITS of sequence b's
tokens, with an online softmax; the last split to finish (atomic counter per (b, kv head))
merges the partial results, so one launch does it all.

Arithmetic: scores = (q . (e2m1 * s_blk)) * (g_tok * sm_scale): the exact bfloat16 products
e2m1 * s_blk enter the MMA, the per-token scale is applied to the FP32 scores, not to every
element. For V the per-token scale is folded into the probabilities before their bfloat16
rounding (p * g_tok), again one multiply per token rather than per element. The FP8 cache is
computed in FP16 (q converted once; |q| must stay below 65504), because Hopper converts FP8
to FP16 in one instruction per two values and to BF16 only through FP32; its probabilities
are scaled by g_tok / max(g_tok over the tile) so that small scales do not fall into FP16
subnormals.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp4rl.kernels._common import ASM, COMPILED, INTERPRET, dot_acc, load_unpacked, with_asm_fallback


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, len_ptr, start_ptr, out_ptr,
    part_ptr, ml_ptr, lock_ptr,
    Hkv, sm_scale_log2,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_ksb, stride_ksh, stride_kst,
    stride_kgb, stride_kgh, stride_vb, stride_vh, stride_vt, stride_vsb, stride_vsh, stride_vst,
    stride_vgb, stride_vgh, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BT: tl.constexpr, USE_ASM: tl.constexpr, INTERP: tl.constexpr, HAS_START: tl.constexpr = False,
):
    DH: tl.constexpr = D // 2
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    length = tl.load(len_ptr + b)
    if HAS_START:  # tokens [start, length) are valid (a left-padded sequence)
        start = tl.minimum(tl.load(start_ptr + b), length)
        chunk = tl.cdiv(tl.cdiv(length - start, NUM_SPLITS), BT) * BT
        t_lo = start + split * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BT) * BT
        t_lo = split * chunk
    t_hi = tl.minimum(length, t_lo + chunk)

    heads = hk * G + tl.arange(0, GP)  # [GP] query heads sharing this KV head
    hmask = tl.arange(0, GP) < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=hmask[:, None], other=0.0)  # [GP, D]
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    kg_base = kg_ptr + b.to(tl.int64) * stride_kgb + hk.to(tl.int64) * stride_kgh
    vg_base = vg_ptr + b.to(tl.int64) * stride_vgb + hk.to(tl.int64) * stride_vgh

    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    if FP4:
        q_lo, q_hi = tl.split(tl.reshape(q, (GP, DH, 2)))  # even / odd head dims
        ks_base = ks_ptr + b.to(tl.int64) * stride_ksb + hk.to(tl.int64) * stride_ksh
        vs_base = vs_ptr + b.to(tl.int64) * stride_vsb + hk.to(tl.int64) * stride_vsh
        acc_lo = tl.zeros((GP, DH), tl.float32)
        acc_hi = tl.zeros((GP, DH), tl.float32)
    else:
        q16 = q.to(tl.float16)  # FP8 -> FP16 is one hardware conversion per 2 values; FP8 -> BF16 is not
        acc = tl.zeros((GP, D), tl.float32)

    for t0 in range(t_lo, t_hi, BT):
        t = t0 + tl.arange(0, BT)  # [BT]
        tmask = t < t_hi
        kg = tl.load(kg_base + t, mask=tmask, other=0.0)  # [BT] per-token scales
        vg = tl.load(vg_base + t, mask=tmask, other=0.0)
        if FP4:
            k_lo, k_hi = load_unpacked(k_base, ks_base, t, tmask, 0, DH, stride_kt, stride_kst,
                                       BT, DH, USE_ASM)  # [BT, D/2] each
            s = dot_acc(q_lo, tl.trans(k_lo), tl.zeros((GP, BT), tl.float32), INTERP)
            s = dot_acc(q_hi, tl.trans(k_hi), s, INTERP)  # [GP, BT]
        else:
            kt = tl.load(k_base + t[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=tmask[:, None],
                         other=0.0).to(tl.float16)  # [BT, D], exact
            s = dot_acc(q16, tl.trans(kt), tl.zeros((GP, BT), tl.float32), INTERP)
        s = s * (kg * sm_scale_log2)[None, :]  # log2-domain scores
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [GP, BT]
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP4:
            pv = (p * vg[None, :]).to(tl.bfloat16)
            v_lo, v_hi = load_unpacked(v_base, vs_base, t, tmask, 0, DH, stride_vt, stride_vst,
                                       BT, DH, USE_ASM)
            acc_lo = dot_acc(pv, v_lo, acc_lo * alpha[:, None], INTERP)
            acc_hi = dot_acc(pv, v_hi, acc_hi * alpha[:, None], INTERP)
        else:
            vt = tl.load(v_base + t[:, None] * stride_vt + tl.arange(0, D)[None, :], mask=tmask[:, None],
                         other=0.0).to(tl.float16)
            # p * g_tok in FP16 would lose tiny scales to subnormals: divide by the tile's largest g
            v_max = tl.max(vg, 0)
            v_max = tl.where(v_max > 0.0, v_max, 1.0)
            pv = (p * (vg / v_max)[None, :]).to(tl.float16)
            pv_acc = dot_acc(pv, vt, tl.zeros((GP, D), tl.float32), INTERP)
            acc = acc * alpha[:, None] + pv_acc * v_max
        m_i = m_new

    # ---- publish this split, the last one merges: o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
    r = tl.arange(0, GP)
    if FP4:
        acc = tl.reshape(tl.join(acc_lo, acc_hi), (GP, D))  # back to natural head-dim order
    slot = bh * NUM_SPLITS + split
    tl.store(part_ptr + slot * (GP * D) + r[:, None] * D + tl.arange(0, D)[None, :], acc,
             cache_modifier=".cg")
    tl.store(ml_ptr + slot * (2 * GP) + r, m_i, cache_modifier=".cg")
    tl.store(ml_ptr + slot * (2 * GP) + GP + r, l_i, cache_modifier=".cg")
    tl.debug_barrier()
    done = tl.atomic_add(lock_ptr + bh, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        m_all = tl.full((GP,), float("-inf"), tl.float32)
        for s_ in range(NUM_SPLITS):
            m_s = tl.load(ml_ptr + (bh * NUM_SPLITS + s_) * (2 * GP) + r, cache_modifier=".cg")
            m_all = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        num = tl.zeros((GP, D), tl.float32)
        den = tl.zeros((GP,), tl.float32)
        for s_ in range(NUM_SPLITS):
            base = (bh * NUM_SPLITS + s_)
            m_s = tl.load(ml_ptr + base * (2 * GP) + r, cache_modifier=".cg")
            l_s = tl.load(ml_ptr + base * (2 * GP) + GP + r, cache_modifier=".cg")
            w = tl.exp2(m_s - m_safe)  # 0 for an empty split
            o_s = tl.load(part_ptr + base * (GP * D) + r[:, None] * D + tl.arange(0, D)[None, :],
                          cache_modifier=".cg")
            num += o_s * w[:, None]
            den += l_s * w
        o = num / tl.where(den == 0.0, 1.0, den)[:, None]  # an empty sequence gives 0
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + tl.arange(0, D)[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.atomic_xchg(lock_ptr + bh, 0)


class _Workspace:
    def __init__(self):
        self.bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device, n_slots: int, gp: int, d: int, n_lock: int):
        key = (device, gp, d)
        cur = self.bufs.get(key)
        if cur is None or cur[0].shape[0] < n_slots or cur[2].numel() < n_lock:
            n_slots, n_lock = max(n_slots, 1024), max(n_lock, 1024)
            cur = self.bufs[key] = (
                torch.empty(n_slots, gp * d, dtype=torch.float32, device=device),
                torch.empty(n_slots, 2 * gp, dtype=torch.float32, device=device),
                torch.zeros(n_lock, dtype=torch.int32, device=device),
            )
        return cur


_WORKSPACE = _Workspace()


def _check_cache(q, lengths, k, v, kg, vg, fp4: bool):
    b, hq, d = q.shape
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16 [B, Hq, D], got {q.dtype}")
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b:
        raise ValueError(f"k/v cache must be [B, Hkv, T, {'D/2' if fp4 else 'D'}] and equal; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}")
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k.shape[3] * (2 if fp4 else 1) != d or d % 32:
        raise ValueError(f"head_dim mismatch: q has D={d}, the cache last dim is {k.shape[3]}")
    if kg.shape != k.shape[:3] or vg.shape != k.shape[:3]:
        raise ValueError(f"per-token scales must be [B, Hkv, T] = {tuple(k.shape[:3])}, got "
                         f"{tuple(kg.shape)}, {tuple(vg.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be int32 [B={b}], got {tuple(lengths.shape)}")
    for name, t in (("k", k), ("v", v), ("q", q), ("k_global", kg), ("v_global", vg)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")


def _splits(b: int, hkv: int, t: int, device) -> int:
    """Splits of the context so that ~4 programs per multiprocessor stream the cache."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n = 1
    while n < 64 and b * hkv * n < 4 * sms and t // (2 * n) >= 128:
        n *= 2
    return n


@with_asm_fallback
def decode_attention(q, lengths, k, v, k_global, v_global, *, k_scale=None, v_scale=None, sm_scale=None,
                     num_splits=None, block_t=None, num_warps=4, num_stages=3, starts=None):
    """One decode step of attention: out [B, Hq, D] bfloat16.

    NVFP4 cache when k_scale/v_scale (E4M3 block scales) are given, else FP8 (e4m3) cache.
    See the module docstring for the layouts. lengths: valid tokens per sequence (<= T).
    starts: optional int32 [B], the first valid token of each sequence (left padding); tokens
    before it are skipped. No host sync: safe inside CUDA graphs.
    """
    fp4 = k_scale is not None
    if fp4 != (v_scale is not None):
        raise ValueError("pass both k_scale and v_scale (NVFP4 cache) or neither (FP8 cache)")
    _check_cache(q, lengths, k, v, k_global, v_global, fp4)
    b, hq, d = q.shape
    hkv, t_cap = k.shape[1], k.shape[2]
    g = hq // hkv
    gp = max(16, triton.next_power_of_2(g))
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if INTERPRET:
        num_splits, block_t = num_splits or 2, block_t or 16
    num_splits = num_splits or _splits(b, hkv, t_cap, q.device)
    block_t = block_t or 128  # measured best at 4K and 32K context on the H200 (bench/gpu_kernels.md)
    if fp4:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        ks, vs = k_scale.view(torch.uint8), v_scale.view(torch.uint8)
    else:
        ks, vs = k, v  # unused
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
    part, ml, lock = _WORKSPACE.get(q.device, b * hkv * num_splits, gp, d, b * hkv)
    lengths = lengths.to(device=q.device, dtype=torch.int32)
    if starts is not None:
        if starts.shape != (b,):
            raise ValueError(f"starts must be int32 [B={b}], got {tuple(starts.shape)}")
        starts = starts.to(device=q.device, dtype=torch.int32)
    COMPILED["decode_attn " + ("nvfp4" if fp4 else "fp8")] = _decode_attn_kernel[(b * hkv, num_splits)](
        q, k, ks, k_global, v, vs, v_global, lengths, starts if starts is not None else lengths, out,
        part, ml, lock,
        hkv, sm_scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        k_global.stride(0), k_global.stride(1), v.stride(0), v.stride(1), v.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2), v_global.stride(0), v_global.stride(1),
        out.stride(0), out.stride(1),
        G=g, GP=gp, D=d, FP4=fp4, NUM_SPLITS=num_splits, BT=block_t,
        USE_ASM=ASM["on"], INTERP=INTERPRET, HAS_START=starts is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


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
    enc = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    data = (xf * enc[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, 1.0 / enc
