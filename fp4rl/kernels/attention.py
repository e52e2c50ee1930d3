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

try:  # Gluon (Triton's explicit-layout dialect) is experimental: its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None


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



# ============================================================================ Gluon NVFP4 kernel (sm_90)
# A decode-attention kernel for the NVFP4 cache written per lane in Gluon, with the tensor cores fed
# straight from registers (mma.sync.m16n8k16, FP16 operands), no shared memory and no barrier in its
# loop. One warp streams 16 tokens per step; a CTA's warps take interleaved steps of one split and each
# publishes its own partial result (merged by the last program of the (b, kv head), as above).
#
# Unpack: an E2M1 code s|e1 e0 m placed at FP16 bits 15 | 11 10 9 is the FP16 number e2m1 * 2^-14
# (code 1 = 0.5 becomes the subnormal 2^-15): exact, no table. In a standard NVFP4 word (8 codes, code
# k at bits 4k) the sign sits 3 bits above the magnitude, in FP16 6 bits above, so one word is first
# rewritten (two lop3 bit-selects and three shifts) into E (even codes: magnitude at 8j + 0..2, sign at
# 8j + 6) and O (odd codes, the same); then each FP16 pair is one shift and one mask:
# (E << 9) & 0x8E008E00 = codes (0, 4), (E << 1) & .. = (2, 6), (O << 9) = (1, 5), (O << 1) = (3, 7):
# 13 integer instructions per 8 codes (the bfloat16 table unpack: 17), then one mul.rn.f16x2 per
# pair by the E4M3 block scale (exact: e2m1 * s * 2^-14 is a multiple of 2^-24 with <= 6 significant
# bits, in FP16 range).
#
# S = Q K^T: A = Q (rows = the G <= 8 query heads of the KV head, scaled per head by a power of two
# into FP16 range; rows 8-15 zero), B = K^T (8 tokens x 16 head dims per MMA): lane (g, c) loads token
# g's 16 bytes at 16c (one 16-byte load), the head dims of each MMA are the code pairs above (Q's
# fragments are gathered once in the same order). D = 8 tokens x query heads: lane (g, c) holds query
# g's scores for tokens 2c, 2c+1 (and 8+2c, 9+2c from the second 8-token MMA), which is the A operand
# layout of the next product, so P never leaves the registers (flash-attention-2's reuse).
# O^T += P V: B = V (16 tokens x 8 head dims): lane (g, c) loads bytes 8g..8g+7 (block g) of tokens
# 2c, 2c+1, 8+2c, 9+2c; one prmt per two words interleaves two tokens' bytes so that the same unpack
# yields (token 2c, token 2c+1) pairs of one head dim; the block scale pair is the two tokens' E4M3 bytes
# (one cvt.f16x2.e4m3x2). 16 MMAs (one per head dim d = 16n + i) accumulate in FP32.
# Scales: the K per-token scale multiplies the FP32 score. The V per-token scale g_v enters the
# probabilities in the exponent: P' = 2^(s + log2 g_v - M) with its own running max M, so P' <= 1 is
# always FP16-safe; the softmax denominator keeps its usual max m; o = acc * 2^14 * 2^(M - m) / l.

_ATTN_MSK = 0x8E008E00


def _attn_unpack(w, r):
    """PTX: standard NVFP4 word w -> FP16 pairs r[0..3] = codes (0,4), (2,6), (1,5), (3,7) (x 2^-14).
    t = w rotated left by 3 (sign of code k at 4k+6); E = w's even codes' magnitudes (bits 8j+0..2) with
    t elsewhere, O = the odd ones (8j+4..6) with t elsewhere: each code's sign then sits 6 bits above its
    magnitude, as in FP16. 11 integer instructions per 8 codes."""
    return (f"shf.l.wrap.b32 ut, {w}, {w}, 3;\nlop3.b32 uE, {w}, ut, k7, 0xE4;\n"
            f"lop3.b32 uO, {w}, ut, k70, 0xE4;\n"
            f"shl.b32 {r[0]}, uE, 9;\nand.b32 {r[0]}, {r[0]}, msk;\n"
            f"shl.b32 {r[1]}, uE, 1;\nand.b32 {r[1]}, {r[1]}, msk;\n"
            f"shl.b32 {r[2]}, uO, 5;\nand.b32 {r[2]}, {r[2]}, msk;\n"
            f"shf.r.wrap.b32 {r[3]}, uO, uO, 3;\nand.b32 {r[3]}, {r[3]}, msk;\n")


def _attn_asm(mode: int = 0) -> str:
    """One 16-token step of one warp, per lane (pack = 8). Operands: out acc0..3 (8 each), st (m, l, M
    for queries 2c, 2c+1); in kw, vw, ks, vs, kq, bias, vg, qa, qb, st, acc0..3 (8 each).
    mode bits (experiments): 1 no unpack (wrong values; timing only), 2 rescale the accumulators
    every step (no warp vote and branch), 4 S in two independent MMA chains."""
    OACC, OST = 0, 32
    KW, VW, KS, VS, KQ, BIAS, VG, QA, QB, ST, ACC = (40 + 8 * i for i in range(11))
    a = ["{\n.reg .b32 ut, uE, uO, k7, k70, msk, r<4>, rb<4>, sk, sA, sB, sC, sD, mx, mxb, X0, X1, Y0, Y1;\n"
         ".reg .b16 h0, h1;\n.reg .f32 d<4>, e<4>, s<4>, u<4>, lv0, lv1, tm, tt, m<2>, mn<2>, mu<2>, al<2>, "
         "M<2>, "
         "Mn<2>, Mu<2>, Al<2>, pp<4>, l<2>, o<32>;\n.reg .pred pz;\n"
         f"mov.b32 k7, 0x07070707;\nmov.b32 k70, 0x70707070;\nmov.b32 msk, {_ATTN_MSK:#x};\n"]
    a.append("".join(f"mov.f32 o{i}, ${ACC + i};\n" for i in range(32)))
    a.append(f"mov.f32 m0, ${ST};\nmov.f32 m1, ${ST + 1};\nmov.f32 l0, ${ST + 2};\nmov.f32 l1, ${ST + 3};\n"
             f"mov.f32 M0, ${ST + 4};\nmov.f32 M1, ${ST + 5};\n")

    def unpack(w, r):
        if mode & 1:
            return "".join(f"and.b32 {x}, {w}, msk;\n" for x in r)
        return _attn_unpack(w, r)

    # ---- S^T = K Q^T: A = K (rows: tokens g, g+8 of this lane), B = Q^T; D: s(t = g | g+8, q = 2c | 2c+1)
    a.append(f"mov.b32 {{h0, h1}}, ${KS};\ncvt.rn.f16x2.e4m3x2 sk, h0;\n"
             "mov.b32 {h0, h1}, sk;\nmov.b32 sA, {h0, h0};\nmov.b32 sB, {h1, h1};\n"
             f"mov.b32 {{h0, h1}}, ${KS + 4};\ncvt.rn.f16x2.e4m3x2 sk, h0;\n"
             "mov.b32 {h0, h1}, sk;\nmov.b32 sC, {h0, h0};\nmov.b32 sD, {h1, h1};\n"
             + "".join(f"mov.f32 d{i}, 0f00000000;\n" for i in range(4))
             + "".join(f"mov.f32 e{i}, 0f00000000;\n" for i in range(4 if mode & 4 else 0)))
    for m in range(4):
        ra, rb = ["r0", "r1", "r2", "r3"], ["rb0", "rb1", "rb2", "rb3"]
        a.append(unpack(f"${KW + m}", ra) + unpack(f"${KW + 4 + m}", rb))
        a.append("".join(f"mul.rn.f16x2 {x}, {x}, {'sA' if m < 2 else 'sB'};\n" for x in ra))
        a.append("".join(f"mul.rn.f16x2 {x}, {x}, {'sC' if m < 2 else 'sD'};\n" for x in rb))
        qb = (QA if m < 2 else QB) + 4 * (m % 2)
        acc = "e" if (mode & 4) and m % 2 else "d"
        for h in range(2):
            a.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{acc}0, {acc}1, {acc}2, {acc}3}}, "
                     f"{{{ra[2 * h]}, {rb[2 * h]}, {ra[2 * h + 1]}, {rb[2 * h + 1]}}}, "
                     f"{{${qb + h}, ${qb + h + 2}}}, {{{acc}0, {acc}1, {acc}2, {acc}3}};\n")
    if mode & 4:
        a.append("".join(f"add.f32 d{i}, d{i}, e{i};\n" for i in range(4)))
    # ---- online softmax per query (2c: scores s0, s2; 2c+1: s1, s3); u = s + log2 g_v with max M
    a.append(f"lg2.approx.f32 lv0, ${VG};\nlg2.approx.f32 lv1, ${VG + 4};\n")
    for t in range(4):
        e = 4 * (t // 2)  # token g (t = 0, 1) or g + 8 (t = 2, 3)
        a.append(f"fma.rn.f32 s{t}, d{t}, ${KQ + e}, ${BIAS + e};\nadd.f32 u{t}, s{t}, lv{t // 2};\n")
    for v, old, new_, use, alpha in (("s", "m", "mn", "mu", "al"), ("u", "M", "Mn", "Mu", "Al")):
        for q in range(2):  # reference max: moved only when the tile exceeds it by more than 2^8
            a.append(f"max.f32 tm, {v}{q}, {v}{q + 2};\n"
                     + "".join(f"shfl.sync.bfly.b32 tt, tm, {x}, 0x1f, 0xffffffff;\nmax.f32 tm, tm, tt;\n"
                               for x in (4, 8, 16))
                     + f"add.f32 tt, {old}{q}, 0f41000000;\nsetp.gt.f32 pz, tm, tt;\n"
                     f"selp.f32 {new_}{q}, tm, {old}{q}, pz;\nsetp.eq.f32 pz, {new_}{q}, 0fFF800000;\n"
                     f"selp.f32 {use}{q}, 0f00000000, {new_}{q}, pz;\nsub.f32 tm, {old}{q}, {use}{q};\n"
                     f"ex2.approx.ftz.f32 {alpha}{q}, tm;\n")
    a.append("".join(f"sub.f32 tm, s{t}, mu{t % 2};\nex2.approx.ftz.f32 pp{t}, tm;\n" for t in range(4)))
    a.append("add.f32 tm, pp0, pp2;\nfma.rn.f32 l0, l0, al0, tm;\n"
             "add.f32 tm, pp1, pp3;\nfma.rn.f32 l1, l1, al1, tm;\n")
    a.append("".join(f"sub.f32 tm, u{t}, Mu{t % 2};\nex2.approx.ftz.f32 pp{t}, tm;\n" for t in range(4)))
    # P'^T fragments (t = g | g+8, q = 2c, 2c+1) -> transposed: P'(q = g, t = 2c, 2c+1 | 8+2c, 9+2c)
    a.append("cvt.rn.f16x2.f32 X0, pp1, pp0;\ncvt.rn.f16x2.f32 X1, pp3, pp2;\n"
             "movmatrix.sync.aligned.m8n8.trans.b16 Y0, X0;\nmovmatrix.sync.aligned.m8n8.trans.b16 Y1, X1;\n")
    rescale = "".join(f"mul.f32 o{i}, o{i}, Al{i % 2};\n" for i in range(32))
    if mode & 2:
        a.append(rescale)
    else:  # the references rarely move: skip the 32 multiplies unless a lane's did (warp-uniform branch)
        a.append("setp.neu.f32 pz, Al0, 0f3F800000;\nsetp.neu.or.f32 pz, Al1, 0f3F800000, pz;\n"
                 "vote.sync.any.pred pz, pz, 0xffffffff;\n@!pz bra SKIP${:uid};\n" + rescale
                 + "SKIP${:uid}:\n")
    # ---- O^T += V^T P'^T: A = V^T (rows: head dims of block g; k: tokens 2c, 2c+1 | 8+2c, 9+2c)
    a.append(f"prmt.b32 mx, ${VS}, ${VS + 2}, 0x40;\nmov.b32 {{h0, h1}}, mx;\ncvt.rn.f16x2.e4m3x2 sA, h0;\n"
             f"prmt.b32 mx, ${VS + 4}, ${VS + 6}, 0x40;\nmov.b32 {{h0, h1}}, mx;\n"
             "cvt.rn.f16x2.e4m3x2 sB, h0;\n")
    for wi in range(2):
        for hl, sel in ((0, "0x5410"), (1, "0x7632")):
            ra, rb = ["r0", "r1", "r2", "r3"], ["rb0", "rb1", "rb2", "rb3"]
            a.append(f"prmt.b32 mx, ${VW + wi}, ${VW + 2 + wi}, {sel};\n" + unpack("mx", ra))
            a.append(f"prmt.b32 mxb, ${VW + 4 + wi}, ${VW + 6 + wi}, {sel};\n" + unpack("mxb", rb))
            a.append("".join(f"mul.rn.f16x2 {x}, {x}, sA;\n" for x in ra))
            a.append("".join(f"mul.rn.f16x2 {x}, {x}, sB;\n" for x in rb))
            for h in range(2):
                k = 4 * wi + 2 * hl + h
                o = ", ".join(f"o{4 * k + r}" for r in range(4))
                a.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{o}}}, "
                         f"{{{ra[2 * h]}, {ra[2 * h + 1]}, {rb[2 * h]}, {rb[2 * h + 1]}}}, "
                         f"{{Y0, Y1}}, {{{o}}};\n")
    a.append("".join(f"mov.f32 ${OACC + i}, o{i};\n" for i in range(32)))
    outs = ("mn0", "mn1", "l0", "l1", "Mn0", "Mn1", "l0", "l1")
    a.append("".join(f"mov.f32 ${OST + i}, {r};\n" for i, r in enumerate(outs)))
    a.append("}\n")
    return "".join(a)


_ATTN_ASM = {m: _attn_asm(m) for m in range(8)}
_ATTN_CON = ",".join(["=f"] * 40 + ["r"] * 32 + ["f"] * 24 + ["r"] * 16 + ["f"] * 40)

if gluon is not None:

    @gluon.jit
    def _ax(n: gl.constexpr, dim: gl.constexpr, L5: gl.constexpr):
        """arange(0, n) along dim of the 5-D layout L5, expanded to 5 dims."""
        S4: gl.constexpr = gl.SliceLayout(4, L5)
        if dim == 0:
            x = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, S4))))
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 1), 2), 3), 4)
        elif dim == 1:
            x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, S4))))
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 2), 3), 4)
        elif dim == 2:
            x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, S4))))
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 0), 3), 4)
        elif dim == 3:
            x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, S4))))
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 0), 0), 4)
        else:
            S0: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L5))))
            x = gl.arange(0, n, layout=S0)
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 0), 0), 0)
        return x

    @gluon.jit
    def _step_loads(kw_base, vw_base, ks_base, vs_base, kg_base, vg_base, tb, t_hi,
                    kw_off, vw_off, ks_off, vs_off, tk_k, tk_v, stride_kt, stride_vt,
                    stride_kst, stride_vst, kqs, big):
        """The operands of one 16-token step of each warp (tb [R, 1, 1, 1, 1]: its first token)."""
        tk = tb + tk_k  # [R, 1, 2, 1, 1]: tokens g, 8 + g (K rows this lane loads, its scores)
        tv = tb + tk_v  # [R, 4, 2, 2, 1]: tokens 2c + e3 + 8 e2 (V rows this lane loads)
        mk = tk < t_hi
        mv = tv < t_hi
        kw = gl.load(kw_base + tk * stride_kt + kw_off, mask=mk, other=0)
        vw = gl.load(vw_base + tv * stride_vt + vw_off, mask=mv, other=0)
        ks = gl.load(ks_base + tk * stride_kst + ks_off, mask=mk, other=0)
        vs = gl.load(vs_base + tv * stride_vst + vs_off, mask=mv, other=0)
        kq = gl.load(kg_base + tk, mask=mk, other=0.0) * kqs
        vg = gl.load(vg_base + tk, mask=mk, other=0.0)
        bias = gl.where(mk, 0.0, float("-inf"))
        return (kw, vw, gl.broadcast(ks.to(gl.int32), big)[0], gl.broadcast(vs.to(gl.int32), big)[0],
                gl.broadcast(kq, big)[0], gl.broadcast(bias, big)[0], gl.broadcast(vg, big)[0])

    @gluon.jit
    def _prefetch(addr, pred):
        """prefetch.global.L2 of one line per thread (addr int64, pred: whether to)."""
        gl.inline_asm_elementwise("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p prefetch.global.L2 [$1];\n"
                                  "mov.b32 $0, 0;\n}\n", "=r,l,r", [addr, pred.to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _step(ASM: gl.constexpr, CON: gl.constexpr, kw, vw, ks, vs, kq, bias, vg, qa, qb, st,
              acc0, acc1, acc2, acc3):
        return gl.inline_asm_elementwise(
            ASM, CON, [kw, vw, ks, vs, kq, bias, vg, qa, qb, st, acc0, acc1, acc2, acc3],
            dtype=(gl.float32, gl.float32, gl.float32, gl.float32, gl.float32), is_pure=False, pack=8)

    @gluon.jit
    def _decode_attn_fp4_gluon(
        q_ptr, kw_ptr, ks_ptr, kg_ptr, vw_ptr, vs_ptr, vg_ptr, len_ptr, start_ptr, out_ptr,
        part_ptr, ml_ptr, lock_ptr,
        Hkv, qk_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kt: gl.constexpr, stride_ksb, stride_ksh,
        stride_kst: gl.constexpr, stride_kgb, stride_kgh, stride_vb, stride_vh, stride_vt: gl.constexpr,
        stride_vsb, stride_vsh, stride_vst: gl.constexpr, stride_vgb, stride_vgh, stride_ob, stride_oh,
        G: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_START: gl.constexpr, ASM: gl.constexpr,
        CON: gl.constexpr, PF: gl.constexpr = 3, DBG: gl.constexpr = 0,
    ):
        """kw/vw: int32 words [B, Hkv, T, 16] (D = 128); ks int16 [B, Hkv, T, 4] (scale byte pairs),
        vs uint8 [B, Hkv, T, 8]. Partials: one slot per (b, kv head, split, warp): acc [8 queries, 128]
        in part, (m [8], M [8], l [8 lanes, 8 queries]) in ml."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = 8 * NW
        L5: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2, 2], [8, 4, 1, 1, 1], [NW, 1, 1, 1, 1],
                                            [4, 3, 2, 1, 0])
        bh = gl.program_id(0)
        split = gl.program_id(1)
        b = bh // Hkv
        hk = bh % Hkv
        length = gl.load(len_ptr + b)
        STEP: gl.constexpr = 16 * NW
        if HAS_START:
            start = gl.minimum(gl.load(start_ptr + b), length)
            chunk = gl.cdiv(gl.cdiv(length - start, NUM_SPLITS), 2 * STEP) * (2 * STEP)
            t_lo = start + split * chunk
        else:
            chunk = gl.cdiv(gl.cdiv(length, NUM_SPLITS), 2 * STEP) * (2 * STEP)
            t_lo = split * chunk
        t_hi = gl.minimum(length, t_lo + chunk)

        r5 = _ax(R, 0, L5)
        c5 = _ax(4, 1, L5)
        e2 = _ax(2, 2, L5)
        e3 = _ax(2, 3, L5)
        e1 = _ax(2, 4, L5)
        g5 = r5 % 8
        w5 = r5 // 8
        big = gl.full([R, 4, 2, 2, 2], 0, gl.int32, L5)
        # ---- Q^T fragments: lane (g, c), word m, pair i: (q[g][32c + 8m + i], q[g][32c + 8m + i + 4]),
        # times one power of two per (b, kv head) that puts max |q| in [2^14, 2^15) (FP16 range, exact)
        qrow = q_ptr + b * stride_qb + (hk * G + g5) * stride_qh
        i4 = e3 * 2 + e1  # pair index 0..3
        dA = c5 * 32 + e2 * 8 + i4  # words m = 0, 1 (e2 = m); + 16: words 2, 3
        qm = (g5 < G) & (dA >= 0)  # [R, 4, 2, 2, 2]
        qa_lo = gl.load(qrow + dA, mask=qm, other=0.0).to(gl.float32)
        qa_hi = gl.load(qrow + dA + 4, mask=qm, other=0.0).to(gl.float32)
        qb_lo = gl.load(qrow + dA + 16, mask=qm, other=0.0).to(gl.float32)
        qb_hi = gl.load(qrow + dA + 20, mask=qm, other=0.0).to(gl.float32)
        amax = gl.maximum(gl.maximum(gl.abs(qa_lo), gl.abs(qa_hi)), gl.maximum(gl.abs(qb_lo), gl.abs(qb_hi)))
        amax = gl.max(gl.max(gl.max(gl.max(gl.max(amax, 4), 3), 2), 1), 0)  # scalar
        ex = (amax.to(gl.int32, bitcast=True) >> 23) & 255
        fe = gl.minimum(gl.maximum(268 - ex, 1), 253)
        fq = (fe << 23).to(gl.float32, bitcast=True)
        kqs = ((254 - fe) << 23).to(gl.float32, bitcast=True) * qk_scale  # exact 1 / fq, times the scale
        qa = ((qa_lo * fq).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 65535) | \
            ((qa_hi * fq).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) << 16)
        qb = ((qb_lo * fq).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 65535) | \
            ((qb_hi * fq).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) << 16)

        # ---- per-lane operand offsets
        kw_base = kw_ptr + b.to(gl.int64) * stride_kb + hk.to(gl.int64) * stride_kh
        vw_base = vw_ptr + b.to(gl.int64) * stride_vb + hk.to(gl.int64) * stride_vh
        ks_base = ks_ptr + b.to(gl.int64) * stride_ksb + hk.to(gl.int64) * stride_ksh
        vs_base = vs_ptr + b.to(gl.int64) * stride_vsb + hk.to(gl.int64) * stride_vsh
        kg_base = kg_ptr + b.to(gl.int64) * stride_kgb + hk.to(gl.int64) * stride_kgh
        vg_base = vg_ptr + b.to(gl.int64) * stride_vgb + hk.to(gl.int64) * stride_vgh
        tk_k = g5 + 8 * e2  # [R, 1, 2, 1, 1]
        tk_v = 2 * c5 + e3 + 8 * e2 + 0 * g5  # [R, 4, 2, 2, 1]
        kw_off = 4 * c5 + 2 * e3 + e1  # words 4c .. 4c+3
        vw_off = 2 * g5 + e1  # words 2g, 2g+1 (block g)
        ks_off = c5  # scale bytes 2c, 2c+1 of the token, one int16
        vs_off = g5

        # state per lane (queries 2c + e1): m at (e2, e3) = (0, 0), l at (0, 1) and (1, 1), M at (1, 0)
        st = gl.where(e2 == e3, float("-inf"), 0.0) + gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        st = gl.where((e2 == 1) & (e3 == 1), 0.0, st)
        acc0 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc1 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc2 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc3 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        tb0 = t_lo + 16 * w5
        n_steps = gl.cdiv(t_hi - t_lo, STEP)
        if DBG & 1:  # timing experiment: no streaming
            n_steps = 0
        # L2 prefetch of the step PF steps ahead: lane 4g + c of each warp takes one 128-byte line of its
        # warp's step (K words 0-7, V words 8-15, then scales and per-token scales)
        L2D: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5)))
        lane = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, L2D)) % 8, 1) * 4 + \
            gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L2D)), 0)  # [R, 4]
        w2 = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, L2D)) // 8, 1)
        li = lane % 8
        pf_off = gl.where(lane < 8, kw_base.to(gl.int64, bitcast=True) + 8 * li * stride_kt,
                          gl.where(lane < 16, vw_base.to(gl.int64, bitcast=True) + 8 * li * stride_vt,
                                   gl.where(lane == 16, ks_base.to(gl.int64, bitcast=True),
                                            gl.where(lane == 17, vs_base.to(gl.int64, bitcast=True),
                                                     gl.where(lane == 18, kg_base.to(gl.int64, bitcast=True),
                                                              vg_base.to(gl.int64, bitcast=True))))))
        pf_tok = gl.where(lane < 8, 4 * stride_kt, gl.where(lane < 16, 4 * stride_vt, gl.where(
            lane == 16, 2 * stride_kst, gl.where(lane == 17, stride_vst, 4))))  # bytes per token
        pf_t0 = t_lo + 16 * w2
        kwa, vwa, ksa, vsa, kqa, bia, vga = _step_loads(
            kw_base, vw_base, ks_base, vs_base, kg_base, vg_base, tb0, t_hi, kw_off, vw_off, ks_off, vs_off,
            tk_k, tk_v, stride_kt, stride_vt, stride_kst, stride_vst, kqs, big)
        for i in range(0, n_steps, 2):  # two steps in flight, no register copies
            if PF > 0:
                _prefetch(pf_off + (pf_t0 + (i + PF) * STEP).to(gl.int64) * pf_tok,
                          (pf_t0 + (i + PF) * STEP) < t_hi)
            kwb, vwb, ksb, vsb, kqb, bib, vgb = _step_loads(
                kw_base, vw_base, ks_base, vs_base, kg_base, vg_base, tb0 + (i + 1) * STEP, t_hi, kw_off,
                vw_off, ks_off, vs_off, tk_k, tk_v, stride_kt, stride_vt, stride_kst, stride_vst, kqs, big)
            acc0, acc1, acc2, acc3, st = _step(ASM, CON, kwa, vwa, ksa, vsa, kqa, bia, vga, qa, qb, st,
                                               acc0, acc1, acc2, acc3)
            if PF > 0:
                _prefetch(pf_off + (pf_t0 + (i + 1 + PF) * STEP).to(gl.int64) * pf_tok,
                          (pf_t0 + (i + 1 + PF) * STEP) < t_hi)
            kwa, vwa, ksa, vsa, kqa, bia, vga = _step_loads(
                kw_base, vw_base, ks_base, vs_base, kg_base, vg_base, tb0 + (i + 2) * STEP, t_hi, kw_off,
                vw_off, ks_off, vs_off, tk_k, tk_v, stride_kt, stride_vt, stride_kst, stride_vst, kqs, big)
            acc0, acc1, acc2, acc3, st = _step(ASM, CON, kwb, vwb, ksb, vsb, kqb, bib, vgb, qa, qb, st,
                                               acc0, acc1, acc2, acc3)

        # ---- publish this warp's partial. acc tensor T, element (e2, e3, e1): query 2c + e1,
        # head dim 16 g + 4 T + e2 + 2 e3; state: m, M per query (equal in the 8 lanes g), l per lane
        slot = (bh * NUM_SPLITS + split) * NW + w5  # [R, 1, 1, 1, 1]
        # stored register-major ([T, e2, e3, e1] x 32 lanes): each warp store writes 128 contiguous bytes
        pbase = part_ptr + slot * 1024 + (e2 * 4 + e3 * 2 + e1) * 32 + 4 * g5 + c5
        gl.store(pbase, acc0, cache_modifier=".cg")
        gl.store(pbase + 256, acc1, cache_modifier=".cg")
        gl.store(pbase + 512, acc2, cache_modifier=".cg")
        gl.store(pbase + 768, acc3, cache_modifier=".cg")
        kind = 2 * e2 + e3  # 0: m, 1: l, 2: M, 3: l again (skipped)
        mlp = ml_ptr + slot * 80 + gl.where(kind == 1, 16 + 8 * g5, 8 * (kind // 2)) + 2 * c5 + e1
        gl.store(mlp, st, mask=(kind == 1) | ((kind != 3) & (g5 == 0)), cache_modifier=".cg")
        gl.thread_barrier()
        if DBG & 4:  # timing experiment: no fence (wrong memory ordering)
            done = gl.atomic_add(lock_ptr + bh, 1, sem="relaxed", scope="gpu")
        else:
            done = gl.atomic_add(lock_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            if DBG & 2:  # timing experiment: merge one slot only (wrong output)
                _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G, 1, NW)
            else:
                _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G, NUM_SPLITS * NW, NW)
            gl.atomic_xchg(lock_ptr + bh, 0)

    @gluon.jit
    def _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G: gl.constexpr,
               NS: gl.constexpr, NW: gl.constexpr):
        """out = [sum_s acc_s 2^(M_s - Mx)] / [sum_s l_s 2^(m_s - mx)] * 2^(14 + Mx - mx), slots in order.
        The per-slot statistics are read as one tile; the slot loop is unrolled so its loads overlap."""
        NSP: gl.constexpr = triton.next_power_of_2(NS)
        LS: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [NW, 1, 1], [2, 1, 0])  # [NSP, 8, 8 lanes]
        sl = gl.arange(0, NSP, layout=gl.SliceLayout(1, gl.SliceLayout(2, LS)))
        ql = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LS)))
        ll = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LS)))
        s2 = gl.expand_dims(sl, 1)  # [NSP, 1]
        q2 = gl.expand_dims(ql, 0)  # [1, 8]
        sm = (s2 < NS) & (q2 < G)
        base = ml_ptr + (bh * NS + s2) * 80 + q2
        m_s = gl.load(base, mask=sm, other=float("-inf"), cache_modifier=".cg")  # [NSP, 8]
        big_s = gl.load(base + 8, mask=sm, other=float("-inf"), cache_modifier=".cg")
        l3 = gl.load(gl.expand_dims(base + 16, 2) + gl.expand_dims(gl.expand_dims(ll, 0), 1) * 8,
                     mask=gl.expand_dims(sm, 2), other=0.0, cache_modifier=".cg")  # [NSP, 8, 8]
        l_s = gl.sum(l3, 2)
        mx = gl.max(m_s, 0)
        big_mx = gl.max(big_s, 0)
        mx = gl.where(mx == float("-inf"), 0.0, mx)
        big_mx = gl.where(big_mx == float("-inf"), 0.0, big_mx)
        den = gl.sum(l_s * gl.exp2(m_s - gl.expand_dims(mx, 0)), 0)  # [8]
        f = gl.exp2(big_mx - mx + 14.0) / gl.where(den == 0.0, 1.0, den)  # [8]
        # weighted sum of the slots' accumulators, [8, 128] per slot
        L2: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, L2))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, L2))
        # (query q, head dim d) -> the writer's lane 4 (d // 16) + q // 2 and register (T, e2, e3, e1)
        q2 = gl.expand_dims(rows, 1)
        d2 = gl.expand_dims(cols, 0)
        rem = d2 % 16
        offs = ((rem // 4) * 256 + ((rem % 2) * 4 + ((rem // 2) % 2) * 2 + q2 % 2) * 32
                + 4 * (d2 // 16) + q2 // 2)
        rmask = gl.expand_dims(rows, 1) < G
        big_r = gl.convert_layout(big_mx, gl.SliceLayout(1, L2))
        num = gl.zeros([8, 128], gl.float32, L2)
        for s_ in gl.static_range(NS):  # unrolled: the slots' loads are independent
            ms = gl.load(ml_ptr + (bh * NS + s_) * 80 + 8 + rows, mask=rows < G, other=float("-inf"),
                         cache_modifier=".cg")
            o_s = gl.load(part_ptr + (bh * NS + s_) * 1024 + offs, mask=rmask, other=0.0,
                          cache_modifier=".cg")
            num += o_s * gl.expand_dims(gl.exp2(ms - big_r), 1)
        o = num * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, L2)), 1)
        optr = (out_ptr + b * stride_ob + (hk * G + gl.expand_dims(rows, 1)) * stride_oh
                + gl.expand_dims(cols, 0))
        gl.store(optr, o.to(gl.bfloat16), mask=rmask)


class _Workspace:
    def __init__(self):
        self.bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device, n_slots: int, gp: int, d: int, n_lock: int, ml_cols: int | None = None):
        ml_cols = ml_cols or 2 * gp
        key = (device, gp, d, ml_cols)
        cur = self.bufs.get(key)
        if cur is None or cur[0].shape[0] < n_slots or cur[2].numel() < n_lock:
            n_slots, n_lock = max(n_slots, 1024), max(n_lock, 1024)
            cur = self.bufs[key] = (
                torch.empty(n_slots, gp * d, dtype=torch.float32, device=device),
                torch.empty(n_slots, ml_cols, dtype=torch.float32, device=device),
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


GLUON = {"on": gluon is not None and not INTERPRET, "error": None}


def _splits_gluon(b: int, hkv: int, t: int, num_warps: int, device, maxnreg: int | None) -> int:
    """Splits so that the warps of the whole grid fill the H200 about once (16 resident warps per
    multiprocessor at <= 128 registers, 12 at ~168) and each warp streams >= 64 tokens."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 65536 // (32 * (maxnreg or 168))
    target = (per_sm // num_warps) * sms  # programs that fit at once
    n = max(1, min(64, target // max(1, b * hkv)))
    while n > 1 and t // (n * num_warps) < 64:
        n -= 1
    return n


def _decode_attention_gluon(q, lengths, starts, k, v, kg, vg, ks, vs, sm_scale, num_splits, num_warps,
                            mode: int = 0, pf: int = 3, maxnreg: int | None = None, dbg: int = 0):
    b, hq, d = q.shape
    hkv, t_cap = k.shape[1], k.shape[2]
    g = hq // hkv
    kw, vw = k.view(torch.int32), v.view(torch.int32)  # [B, Hkv, T, 16] words
    ks16 = ks.view(torch.int16)  # [B, Hkv, T, 4]: scale byte pairs (2c, 2c+1)
    vs8 = vs.view(torch.uint8)
    num_splits = num_splits or _splits_gluon(b, hkv, t_cap, num_warps, q.device, maxnreg)
    n_slots = b * hkv * num_splits * num_warps
    part, ml, lock = _WORKSPACE.get(q.device, n_slots, 8, 128, b * hkv, ml_cols=80)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
    COMPILED["decode_attn nvfp4 gluon"] = _decode_attn_fp4_gluon[(b * hkv, num_splits)](
        q, kw, ks16, kg, vw, vs8, vg, lengths, starts if starts is not None else lengths, out,
        part, ml, lock,
        hkv, sm_scale * math.log2(math.e) * 16384.0,
        q.stride(0), q.stride(1), kw.stride(0), kw.stride(1), kw.stride(2),
        ks16.stride(0), ks16.stride(1), ks16.stride(2), kg.stride(0), kg.stride(1),
        vw.stride(0), vw.stride(1), vw.stride(2), vs8.stride(0), vs8.stride(1), vs8.stride(2),
        vg.stride(0), vg.stride(1), out.stride(0), out.stride(1),
        G=g, NUM_SPLITS=num_splits, HAS_START=starts is not None, ASM=_ATTN_ASM[mode], CON=_ATTN_CON, PF=pf,
        DBG=dbg, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return out


@with_asm_fallback
def decode_attention(q, lengths, k, v, k_global, v_global, *, k_scale=None, v_scale=None, sm_scale=None,
                     num_splits=None, block_t=None, num_warps=None, num_stages=3, starts=None, kernel=None,
                     _mode: int = 4, _pf: int = 3, _maxnreg: int | None = None, _dbg: int = 0):
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
    use_gluon = (kernel in (None, "gluon") and fp4 and GLUON["on"] and q.is_cuda and d == 128 and g <= 8
                 and block_t is None)
    if kernel == "gluon" and not use_gluon:
        raise ValueError("the Gluon kernel needs CUDA, an NVFP4 cache, head_dim 128 and <= 8 query heads "
                         "per KV head")
    if use_gluon:
        lengths_i = lengths.to(device=q.device, dtype=torch.int32)
        starts_i = None
        if starts is not None:
            if starts.shape != (b,):
                raise ValueError(f"starts must be int32 [B={b}], got {tuple(starts.shape)}")
            starts_i = starts.to(device=q.device, dtype=torch.int32)
        try:
            return _decode_attention_gluon(q, lengths_i, starts_i, k, v, k_global, v_global, k_scale, v_scale,
                                           sm_scale, num_splits, num_warps or 4, _mode, _pf,
                                           _maxnreg, _dbg)
        except Exception as exc:  # noqa: BLE001  (Gluon failed to compile or launch here)
            if kernel == "gluon":
                raise
            import warnings

            GLUON["on"], GLUON["error"] = False, repr(exc)[:300]
            warnings.warn(f"Gluon NVFP4 attention disabled ({GLUON['error']}); using the Triton kernel",
                          stacklevel=2)
    num_warps = num_warps or 4
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
