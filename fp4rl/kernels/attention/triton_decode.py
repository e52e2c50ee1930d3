"""The Triton decode-attention kernel, for every cache: NVFP4 (``FP4=True``), BF16 (``BF16=True``) and FP8.

Flash-decoding: program (b, kv head, split) handles the Hq/Hkv query heads that share the KV
head (GQA: each KV byte is read once for all of them) over one chunk of sequence b's tokens,
with an online softmax. The chunk is ceil(n / NUM_SPLITS) rounded up to BT tokens, at least
MIN_CHUNK, where n = lengths[b] - starts[b] is read on the device; so a short sequence in a cache
split for long ones has fewer active splits (the others return at once), and when only one split
holds tokens it writes the output itself. Otherwise the last active split to finish (atomic
counter per (b, kv head)) merges the partial results, so one launch does it all.

Arithmetic: scores = (q . (e2m1 * s_blk)) * (g_tok * sm_scale): the exact bfloat16 products
e2m1 * s_blk enter the MMA, the per-token scale is applied to the FP32 scores, not to every
element. For V the per-token scale is folded into the probabilities before their bfloat16
rounding (p * g_tok), again one multiply per token rather than per element. The FP8 cache is
computed in FP16 (q converted once; |q| must stay below 65504), because Hopper converts FP8
to FP16 in one instruction per two values and to BF16 only through FP32; its probabilities
are scaled by g_tok / max(g_tok over the tile) so that small scales do not fall into FP16
subnormals. Its limit: a token whose V scale is below ~6e-8 of the largest in its tile (FP16's smallest
subnormal) contributes nothing, and near it little precision (measured in the forty-ninth session: a token
holding nearly all of a head's attention at a V scale 1e-7 of its tile's largest, 9.9% error; at 3e-8, the
head's output 0; NVFP4 keeps 0.5% there), which real caches' per-token V ranges do not approach.
The BF16 cache (no scales) feeds q and K, then the bfloat16 probabilities and V,
straight to the MMA, as flash attention does.

With ``ROPE`` (BF16 cache only; ``decode_attention_rope``) the kernel also does the decode step's q/k-norm +
RoPE of the new token, reading the fused q|k|v projection instead of q: each program normalises and rotates
its query heads (`_rope_rows`, qk_norm_rope's arithmetic: bit-equal without the norm, within its one-ulp
norm-order claim with it), split 0 writes the new token's k and v into the cache slot, and the split that
owns the slot attends to the cache before it and adds the new token from registers (one more online-softmax
step, its score summed in fp32 rather than by the MMA), so no program reads the slot another one writes and
one launch does what qk_norm_rope and the attention did in two.

The FP8 and BF16 caches are constexpr branches of the same kernel (their loops share the split, the
online softmax and the merge), not kernels of their own. On CUDA the NVFP4 cache goes to the Gluon
kernel (fp4rl.kernels.attention.gluon_decode) when it applies; this one is its fallback and the one
the CPU interpreter runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4rl.kernels._common import dot_acc, load_unpacked
from fp4rl.kernels.fused import _bf16 as _bf

try:  # griddepcontrol (programmatic dependent launch); traced only when the kernel's PDL constexpr is on
    from triton.language.extra import cuda as tlcuda
except ImportError:
    tlcuda = None


@triton.jit
def _rope_rows(src, rows, rmask, cs, sn, w_ptr, inv_d, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """q/k-norm (HAS_NORM: rstd over the head, times w_ptr's [D] weight) and RoPE of head rows `rows` of one
    token's q|k|v row `src` (head h at src + h D), cos / sin rows cs / sn: [R, D] float32 holding bfloat16
    values, as fused.qk_norm_rope computes them. rotate_half is the partner column (d + D/2) mod D, negated
    in the first half, so the full-width tile needs no concatenation."""
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    p = (d + half) % D
    xa = tl.load(src + rows[:, None] * D + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    xb = tl.load(src + rows[:, None] * D + p[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(xa * xa, 1) * inv_d + eps)
        wa = tl.load(w_ptr + d).to(tl.float32)
        wb = tl.load(w_ptr + p).to(tl.float32)
        xa = _bf(wa[None, :] * _bf(xa * rstd[:, None]))
        xb = _bf(wb[None, :] * _bf(xb * rstd[:, None]))
    c = tl.load(cs + d).to(tl.float32)
    s = tl.load(sn + d).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    return _bf(_bf(xa * c[None, :]) + _bf((xb * sign[None, :]) * s[None, :]))


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, ks_ptr, kg_ptr, v_ptr, vs_ptr, vg_ptr, len_ptr, start_ptr, out_ptr,
    part_ptr, ml_ptr, lock_ptr,
    Hkv, sm_scale_log2,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_ksb, stride_ksh, stride_kst,
    stride_kgb, stride_kgh, stride_vb, stride_vh, stride_vt, stride_vsb, stride_vsh, stride_vst,
    stride_vgb, stride_vgh, stride_ob, stride_oh,
    cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, stride_cs, inv_d, eps,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BT: tl.constexpr, USE_ASM: tl.constexpr, INTERP: tl.constexpr, HAS_START: tl.constexpr = False,
    BF16: tl.constexpr = False, MIN_CHUNK: tl.constexpr = 0, NSP: tl.constexpr = 1, PDL: tl.constexpr = False,
    ROPE: tl.constexpr = False, HAS_NORM: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch (fp4rl.kernels.pdl, kind "attn"): the next kernel may launch now;
        tlcuda.gdc_launch_dependents()  # wait for q, the lengths and the new token's K / V before any read
        tlcuda.gdc_wait()
    DH: tl.constexpr = D // 2
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    if ROPE:  # the new token sits at the slot, the last one attended: length = slot + 1 for every row
        slot = tl.load(slot_ptr).to(tl.int32)
        length = slot + 1
    else:
        length = tl.load(len_ptr + b)
    if HAS_START:  # tokens [start, length) are valid (a left-padded sequence)
        start = tl.minimum(tl.load(start_ptr + b), length)
    else:
        start = length * 0
    n_tok = length - start
    # splits of >= MIN_CHUNK tokens (a multiple of BT): a short sequence in a cache sized (and split) for long
    # ones keeps few active splits, the others return at once
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n_tok, NUM_SPLITS), BT) * BT, MIN_CHUNK)
    n_act = tl.maximum(tl.cdiv(n_tok, tl.maximum(chunk, 1)), 1)  # splits holding tokens (1 if none does)
    t_lo = start + split * chunk
    t_hi = tl.minimum(length, t_lo + chunk)

    heads = hk * G + tl.arange(0, GP)  # [GP] query heads sharing this KV head
    hmask = tl.arange(0, GP) < G
    if ROPE:  # q_ptr: the q|k|v row of each token (H = Hkv G query heads, then Hkv k heads, Hkv v heads)
        row = q_ptr + b.to(tl.int64) * stride_qb
        cs = cos_ptr + b.to(tl.int64) * stride_cs
        sn = sin_ptr + b.to(tl.int64) * stride_cs
        q = _rope_rows(row, heads, hmask, cs, sn, qw_ptr, inv_d, eps, D, HAS_NORM).to(tl.bfloat16)  # [GP, D]
        one = tl.arange(0, 1)
        dnew = one[:, None] * 0 + tl.arange(0, D)[None, :]  # [1, D]: the new token's k and v of this KV head
        k_new = _rope_rows(row, Hkv * G + hk + one, one == 0, cs, sn, kw_ptr, inv_d, eps, D, HAS_NORM)
        v_new = tl.load(row + (Hkv * G + Hkv + hk) * D + dnew)
        t_end = tl.minimum(t_hi, slot)  # the loop reads the cache before the slot; the new token: below
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + tl.arange(0, D)[None, :],
                    mask=hmask[:, None], other=0.0)  # [GP, D]
        t_end = t_hi
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
    elif BF16:
        acc = tl.zeros((GP, D), tl.float32)
    else:
        q16 = q.to(tl.float16)  # FP8 -> FP16 is one hardware conversion per 2 values; FP8 -> BF16 is not
        acc = tl.zeros((GP, D), tl.float32)

    for t0 in range(t_lo, t_end, BT):
        t = t0 + tl.arange(0, BT)  # [BT]
        tmask = t < t_end
        if BF16:  # K and V tiles (the compiler pipelines both: cp.async, num_stages - 1 tiles ahead)
            kt = tl.load(k_base + t[:, None] * stride_kt + tl.arange(0, D)[None, :], mask=tmask[:, None],
                         other=0.0)  # [BT, D] bfloat16
            vt = tl.load(v_base + t[:, None] * stride_vt + tl.arange(0, D)[None, :], mask=tmask[:, None],
                         other=0.0)
            s = dot_acc(q, tl.trans(kt), tl.zeros((GP, BT), tl.float32), INTERP) * sm_scale_log2
        else:
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
        if BF16:
            acc = dot_acc(p.to(tl.bfloat16), vt, acc * alpha[:, None], INTERP)
        elif FP4:
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

    if ROPE:
        if split == 0:  # the new token's k and v into the cache slot (read from here on by later steps)
            tl.store(k_base + slot.to(tl.int64) * stride_kt + dnew, k_new.to(k_ptr.dtype.element_ty))
            tl.store(v_base + slot.to(tl.int64) * stride_vt + dnew, v_new)
        if (t_lo <= slot) & (slot < t_hi):  # this split owns the slot: the new token, one online-softmax step
            s_new = tl.sum(q.to(tl.float32) * k_new, 1) * sm_scale_log2  # [GP]
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new.to(tl.bfloat16).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m_i = m_new

    r = tl.arange(0, GP)
    dcol = tl.arange(0, D)
    if FP4:
        acc = tl.reshape(tl.join(acc_lo, acc_hi), (GP, D))  # back to natural head-dim order
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dcol[None, :]
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty sequence gives 0
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    elif n_act == 1:  # one split holds every token (or there is none): it writes the output itself
        if split == 0:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    elif split < n_act:
        # ---- publish this split, the last one merges: o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
        slot = bh * NUM_SPLITS + split
        tl.store(part_ptr + slot * (GP * D) + r[:, None] * D + dcol[None, :], acc, mask=hmask[:, None],
                 cache_modifier=".cg")
        tl.store(ml_ptr + slot * (2 * GP) + r, m_i, mask=hmask, cache_modifier=".cg")
        tl.store(ml_ptr + slot * (2 * GP) + GP + r, l_i, mask=hmask, cache_modifier=".cg")
        tl.debug_barrier()
        done = tl.atomic_add(lock_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == n_act - 1:
            # the splits' statistics as one [NSP, GP] tile, then their partials as [GP, D] tiles, four a step
            # (unrolled: their loads are in flight together; the merge's time grows with the splits). One
            # [4, GP, D] tile a step instead was 2-3x slower on the H200.
            srow = tl.arange(0, NSP)
            sm_ = (srow < n_act)[:, None] & hmask[None, :]
            ml_s = ml_ptr + (bh * NUM_SPLITS + srow)[:, None] * (2 * GP) + r[None, :]
            m_s = tl.load(ml_s, mask=sm_, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(ml_s + GP, mask=sm_, other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_s, 0)  # [GP]
            m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            den = tl.sum(l_s * tl.exp2(m_s - m_safe[None, :]), 0)
            num = tl.zeros((GP, D), tl.float32)
            for s0 in range(0, n_act, 4):
                for j in tl.static_range(4):
                    base = bh * NUM_SPLITS + s0 + j
                    ok = hmask & (r * 0 + (s0 + j) < n_act)  # [GP] (a [GP] tensor on both sides)
                    m_b = tl.load(ml_ptr + base * (2 * GP) + r, mask=ok, other=float("-inf"),
                                  cache_modifier=".cg")
                    o_b = tl.load(part_ptr + base * (GP * D) + r[:, None] * D + dcol[None, :],
                                  mask=ok[:, None], other=0.0, cache_modifier=".cg")
                    num += o_b * tl.exp2(m_b - m_safe)[:, None]  # 0 past the active splits
            o = num / tl.where(den == 0.0, 1.0, den)[:, None]
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.atomic_xchg(lock_ptr + bh, 0)
