"""The inline PTX of one 16-token step of one warp of the Gluon NVFP4 kernel (gluon_decode.py).

Unpack: an E2M1 code s|e1 e0 m placed at FP16 bits 15 | 11 10 9 is the FP16 number e2m1 * 2^-14
(code 1 = 0.5 becomes the subnormal 2^-15): exact, no table. In a standard NVFP4 word (8 codes, code
k at bits 4k) the sign sits 3 bits above the magnitude, in FP16 6 bits above, so one word is first
rewritten (a shift and two lop3 bit-selects) into E (even codes: magnitude at 8j + 0..2, sign at 8j + 6)
and O (odd codes, the same), then each FP16 pair is one shift and one mask (``_attn_unpack``): 11 integer
instructions per 8 codes (the bfloat16 table unpack: 17), then one mul.rn.f16x2 per pair by the E4M3
block scale (exact: e2m1 * s * 2^-14 is a multiple of 2^-24 with <= 6 significant bits, in FP16 range).

S^T = K Q^T: A = K (rows: tokens g and g + 8 of lane (g, c), which loads each token's 16 bytes at 16c in
one load), B = Q^T (Q's fragments gathered once in the unpack's head-dim order, scaled per (batch, KV
head) by a power of two into FP16 range; columns past the G query heads are zero); 8 MMAs per 16 tokens
in two independent chains. D: lane (g, c) holds the scores of tokens g, g + 8 for queries 2c, 2c + 1.
O^T += V^T P'^T: A = V^T (rows: head dims of block g; k: tokens 2c, 2c+1 | 8+2c, 9+2c, loaded as bytes
8g..8g+7 of those tokens; one prmt per two words interleaves two tokens' bytes so that the same unpack
yields token pairs of one head dim; the block-scale pair is one cvt.f16x2.e4m3x2), B = P'^T, moved from
the S accumulator layout with two movmatrix (no shuffles); 8 MMAs accumulate in FP32.
Scales: the K per-token scale multiplies the FP32 score. The V per-token scale g_v enters the
probabilities in the exponent: P' = 2^(s + log2 g_v - M) with its own running reference M, so P' stays
FP16-safe; the softmax denominator keeps its own reference m; o = acc * 2^14 * 2^(M - m) / l.
Lazy references: m and M move only when a score exceeds them by more than 8 (log2 units: P' <= 2^8). A
warp vote on each lane's own scores finds such a step (the default since the eighth session: the tile
maximum, its shuffles and the rescale of the 32 accumulators run only then, behind a warp-uniform branch).

``_ATTN_ASM[mode]`` is the step's PTX for each experiment mode (``_attn_asm``'s bits), ``_ATTN_CON``
its operand constraints; both are constexprs of the kernel, built once here as plain strings.
"""

from __future__ import annotations

_ATTN_MSK = 0x8E008E00


def _attn_unpack(w, r):
    """PTX: standard NVFP4 word w -> FP16 pairs r[0..3] = codes (0,4), (2,6), (1,5), (3,7) (x 2^-14).
    t = w << 3 (sign of code k at 4k+6); E = w's even codes' magnitudes (bits 8j+0..2) with t elsewhere,
    O = the odd ones (8j+4..6), and bits 28..31 of w (code 7 whole), with t elsewhere: each code's sign then
    sits 6 bits above its magnitude, as in FP16, but code 7's, which an arithmetic shift right by 3 puts at
    bit 31 of pair (3, 7). 11 integer instructions per 8 codes, 7 on the ALU pipe (ptxas puts shifts left
    on the FMA pipe as IMAD.SHL). The third session's form rotated w and pair (3, 7) instead (8 ALU
    instructions: two SHF rotates; no faster or slower on the H200 within noise, eighth session). A
    byte-permute form (w's signs, then E and O as bytes with the magnitude at bits 1-3 and the sign at
    bit 7, each pair one prmt into the high bytes of a zero word) takes 10 instructions but 8 on the ALU
    pipe: measured no faster (100.4 vs 98.5 us at 32K), not kept."""
    return (f"shl.b32 ut, {w}, 3;\nlop3.b32 uE, {w}, ut, k7, 0xE4;\n"
            f"lop3.b32 uO, {w}, ut, k70, 0xE4;\n"
            f"shl.b32 {r[0]}, uE, 9;\nand.b32 {r[0]}, {r[0]}, msk;\n"
            f"shl.b32 {r[1]}, uE, 1;\nand.b32 {r[1]}, {r[1]}, msk;\n"
            f"shl.b32 {r[2]}, uO, 5;\nand.b32 {r[2]}, {r[2]}, msk;\n"
            f"shr.s32 {r[3]}, uO, 3;\nand.b32 {r[3]}, {r[3]}, msk;\n")


def _attn_asm(mode: int = 0) -> str:
    """One 16-token step of one warp, per lane (pack = 8). Operands: out acc0..3 (8 each), st (m, l, M
    for queries 2c, 2c+1); in kw, vw, ks, vs, kq, bias, vg, qa, qb, st, acc0..3 (8 each).
    mode bits (experiments): 1 no unpack (wrong values; timing only), 2 rescale the accumulators
    every step (no warp vote and branch; ignored with 16), 4 S in two independent MMA chains, 16 the
    references' move detected by a vote on the lanes' own scores (no tile maximum unless one moves; the
    default, 20 = 16 + 4)."""
    OACC, OST = 0, 32
    KW, VW, KS, VS, KQ, BIAS, VG, QA, QB, ST, ACC = (40 + 8 * i for i in range(11))
    a = ["{\n.reg .b32 ut, uE, uO, k7, k70, msk, r<4>, rb<4>, sk, sA, sB, sC, sD, mx, mxb, X0, X1, Y0, "
         "Y1;\n"
         ".reg .b16 h0, h1;\n.reg .f32 d<4>, e<4>, s<4>, u<4>, lv0, lv1, tm, tt, ta0, ta1, tb0, tb1, "
         " m<2>, mn<2>, mu<2>, al<2>, "
         "M<2>, "
         "Mn<2>, Mu<2>, Al<2>, pp<4>, l<2>, o<32>;\n.reg .pred pz;\n"
         f"mov.b32 k7, 0x07070707;\nmov.b32 k70, 0xF0707070;\n"
         f"mov.b32 msk, {_ATTN_MSK:#x};\n"]
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
    update = "".join(  # reference max: moved only when the tile exceeds it by more than 8 (a factor 2^8)
        f"max.f32 tm, {v}{q}, {v}{q + 2};\n"
        + "".join(f"shfl.sync.bfly.b32 tt, tm, {x}, 0x1f, 0xffffffff;\nmax.f32 tm, tm, tt;\n"
                  for x in (4, 8, 16))
        + f"add.f32 tt, {old}{q}, 0f41000000;\nsetp.gt.f32 pz, tm, tt;\n"
        f"selp.f32 {new_}{q}, tm, {old}{q}, pz;\nsetp.eq.f32 pz, {new_}{q}, 0fFF800000;\n"
        f"selp.f32 {use}{q}, 0f00000000, {new_}{q}, pz;\nsub.f32 tm, {old}{q}, {use}{q};\n"
        f"ex2.approx.ftz.f32 {alpha}{q}, tm;\n"
        for v, old, new_, use, alpha in (("s", "m", "mn", "mu", "al"), ("u", "M", "Mn", "Mu", "Al"))
        for q in range(2))
    rescale = "".join(f"mul.f32 o{i}, o{i}, Al{i % 2};\n" for i in range(32))
    if mode & 16:
        # The references move only when a score exceeds one by more than 8 (log2 units: a factor 2^8),
        # which a warp vote on the lanes' own scores detects: no tile maximum (12 shuffles, 16 max) unless
        # one moves (rare after the first steps). The same values as the tile-maximum form: a tile
        # exceeds old + 8 exactly when one of its scores does (max ignores NaN, a comparison with NaN is
        # false); without a move, new = old, use = old (or 0 while old = -inf, when every score is -inf
        # and any finite use gives P = 0: max(old, -FLT_MAX)), alpha = 1, and fma(l, 1, x) = l + x. While
        # old = -inf the tile form's alpha is 0 instead of 1; the same results only because l = 0 and o = 0
        # until the first finite score (the kernel's initial state). With a move: the tile-maximum code,
        # then o *= Al (Al = 1 leaves o exact).
        a.append("add.f32 ta0, m0, 0f41000000;\nadd.f32 ta1, m1, 0f41000000;\n"
                 "add.f32 tb0, M0, 0f41000000;\nadd.f32 tb1, M1, 0f41000000;\n"
                 "setp.gt.f32 pz, s0, ta0;\nsetp.gt.or.f32 pz, s2, ta0, pz;\n"
                 "setp.gt.or.f32 pz, s1, ta1, pz;\nsetp.gt.or.f32 pz, s3, ta1, pz;\n"
                 "setp.gt.or.f32 pz, u0, tb0, pz;\nsetp.gt.or.f32 pz, u2, tb0, pz;\n"
                 "setp.gt.or.f32 pz, u1, tb1, pz;\nsetp.gt.or.f32 pz, u3, tb1, pz;\n"
                 "vote.sync.any.pred pz, pz, 0xffffffff;\n"
                 "mov.f32 mn0, m0;\nmov.f32 mn1, m1;\nmov.f32 Mn0, M0;\nmov.f32 Mn1, M1;\n"
                 "max.f32 mu0, m0, 0fFF7FFFFF;\nmax.f32 mu1, m1, 0fFF7FFFFF;\n"
                 "max.f32 Mu0, M0, 0fFF7FFFFF;\nmax.f32 Mu1, M1, 0fFF7FFFFF;\n"
                 "mov.f32 al0, 0f3F800000;\nmov.f32 al1, 0f3F800000;\n"
                 "@!pz bra KEEP${:uid};\n" + update + rescale + "KEEP${:uid}:\n")
    else:
        a.append(update)
    a.append("".join(f"sub.f32 tm, s{t}, mu{t % 2};\nex2.approx.ftz.f32 pp{t}, tm;\n" for t in range(4)))
    a.append("add.f32 tm, pp0, pp2;\nfma.rn.f32 l0, l0, al0, tm;\n"
             "add.f32 tm, pp1, pp3;\nfma.rn.f32 l1, l1, al1, tm;\n")
    a.append("".join(f"sub.f32 tm, u{t}, Mu{t % 2};\nex2.approx.ftz.f32 pp{t}, tm;\n" for t in range(4)))
    # P'^T fragments (t = g | g+8, q = 2c, 2c+1) -> transposed: P'(q = g, t = 2c, 2c+1 | 8+2c, 9+2c)
    a.append("cvt.rn.f16x2.f32 X0, pp1, pp0;\ncvt.rn.f16x2.f32 X1, pp3, pp2;\n"
             "movmatrix.sync.aligned.m8n8.trans.b16 Y0, X0;\nmovmatrix.sync.aligned.m8n8.trans.b16 Y1, X1;\n")
    if mode & 16:
        pass  # rescaled in the update branch above
    elif mode & 2:
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



_ATTN_ASM = {m: _attn_asm(m) for m in range(32)}
_ATTN_CON = ",".join(["=f"] * 40 + ["r"] * 32 + ["f"] * 24 + ["r"] * 16 + ["f"] * 40)
