"""The Gluon decode-attention kernel for the NVFP4 cache (sm_90, head_dim 128, <= 8 query heads per
KV head).

A decode-attention kernel for the NVFP4 cache written per lane in Gluon, with the tensor cores fed
straight from registers (mma.sync.m16n8k16, FP16 operands), no shared memory and no barrier in its
loop. One warp streams 16 tokens per step; a CTA's warps take interleaved steps of one split, then merge
their partials in the CTA through shared memory (``_cta_merge``): with one split that is the output; with
more, one partial a CTA, merged by the last program of the (b, kv head) to finish, as in the Triton kernel.
(FP4RL_GLUON_CTA_MERGE=0 has each warp publish its own instead, ``_warp_publish``; =1 merges in the CTA at
one split only.)

The arithmetic of a step (the E2M1 -> FP16 unpack, the two MMA products, the online softmax with
the V scale in the exponent) is one inline-PTX block per step: fp4rl.kernels.attention.gluon_ptx
explains it. This module holds the Gluon side: the lane layout (a 5-D blocked layout, ``_ax``),
the operand loads of a step (two steps in flight), the L2 prefetch PF steps ahead, the
register-major partials and their merge (``_merge``).
Gluon is Triton's experimental explicit-layout dialect; this is written for Triton 3.6 (the
dispatcher falls back to the Triton kernel, with a warning, if it fails to compile).
"""

from __future__ import annotations

import os

import triton

try:  # Gluon (Triton's explicit-layout dialect) is experimental: its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None


def _cta_merge_from_env() -> int:
    """FP4RL_GLUON_CTA_MERGE, where a CTA's warps merge their partials in the CTA (``_cta_merge``) rather
    than each publishing its own (``_warp_publish``): 2 (default) at every split count; 1 at one split
    only; 0 never (the fiftieth session's path). Returned as the DBG bits the launch ORs in (32: every
    split count; 16: never). Measured on an H100 (bench/RESULTS.md, fifty-first session): faster at every
    shape timed, one split or many."""
    raw = os.environ.get("FP4RL_GLUON_CTA_MERGE", "").strip()
    if raw not in ("", "0", "1", "2"):
        raise ValueError(f"FP4RL_GLUON_CTA_MERGE={raw!r}: use 2 (a CTA's warps merged in the CTA at every "
                         "split count, the default), 1 (at one split only) or 0 (each warp publishes its "
                         "own), or unset it")
    return {"0": 16, "1": 0}.get(raw, 32)


MERGE_DBG = _cta_merge_from_env()  # ORed into the launch's DBG


def cta_merge_every_split(dbg: int) -> bool:
    """Whether a launch with these DBG bits (MERGE_DBG ORed in) merges a CTA's warps in the CTA at every
    split count (32 without 16), as the kernel's own test below (``_cta_merge`` or ``_warp_publish``)."""
    return ((dbg | MERGE_DBG) & 48) == 32

if gluon is not None:
    from fp4rl.kernels.attention.gluon_stream import _stream

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
    def _decode_attn_fp4_gluon(
        q_ptr, kw_ptr, ks_ptr, kg_ptr, vw_ptr, vs_ptr, vg_ptr, len_ptr, start_ptr, out_ptr,
        part_ptr, ml_ptr, lock_ptr,
        Hkv, qk_scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kt: gl.constexpr, stride_ksb, stride_ksh,
        stride_kst: gl.constexpr, stride_kgb, stride_kgh, stride_vb, stride_vh, stride_vt: gl.constexpr,
        stride_vsb, stride_vsh, stride_vst: gl.constexpr, stride_vgb, stride_vgh, stride_ob, stride_oh,
        G: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_START: gl.constexpr, ASM: gl.constexpr,
        CON: gl.constexpr, PF: gl.constexpr = 3, DBG: gl.constexpr = 0, PDL: gl.constexpr = False,
    ):
        """kw/vw: int32 words [B, Hkv, T, 16] (D = 128); ks int16 [B, Hkv, T, 4] (scale byte pairs),
        vs uint8 [B, Hkv, T, 8]. Partials: one slot per (b, kv head, split, warp), or per (b, kv head,
        split) where the CTA merges its warps (``_cta_merge``): acc [8 queries, 128] in part, (m [8], M [8],
        l [8 lanes, 8 queries]) in ml."""
        if PDL:  # programmatic dependent launch (fp4rl.kernels.pdl, kind "gluon"): the next kernel may launch
            # now; q, the lengths and the new token's K / V come from the kernels before: wait before any read
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
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
        # a split's tokens in whole pairs of steps; DBG 64 (A/B, to be timed): in whole steps, finer past a
        # multiple of 2 STEP x NUM_SPLITS (16 splits of 4097-4160 tokens run 13 CTAs, not 11); a split's odd
        # step then runs in the ragged end's masked path
        QUANT: gl.constexpr = 2 * STEP - ((DBG & 64) // 64) * STEP
        if HAS_START:
            start = gl.minimum(gl.load(start_ptr + b), length)
            chunk = gl.cdiv(gl.cdiv(length - start, NUM_SPLITS), QUANT) * QUANT
            t_lo = start + split * chunk
        else:
            chunk = gl.cdiv(gl.cdiv(length, NUM_SPLITS), QUANT) * QUANT
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

        # state per lane (queries 2c + e1): m at (e2, e3) = (0, 0), l at (0, 1) and (1, 1), M at (1, 0)
        st = gl.where(e2 == e3, float("-inf"), 0.0) + gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        st = gl.where((e2 == 1) & (e3 == 1), 0.0, st)
        acc0 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc1 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc2 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc3 = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
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
        zf = gl.zeros([R, 4, 2, 2, 2], gl.float32, L5)
        acc0, acc1, acc2, acc3, st = _stream(
            ASM, CON, PF, STEP, kw_base, vw_base, ks_base, vs_base, kg_base, vg_base,
            t_lo, t_hi, w5, g5, c5, e2, e3, e1, stride_kt, stride_vt, stride_kst, stride_vst, kqs, zf,
            big, qa, qb, st, acc0, acc1, acc2, acc3, pf_off, pf_tok, pf_t0, DBG)

        # where the warps' partials merge (MERGE_DBG): in the CTA at one split, and at every split count
        # with DBG 32 (the dispatcher's default); DBG 16: each warp publishes its own
        if ((DBG & 16) == 0) and ((NUM_SPLITS == 1) or ((DBG & 32) != 0)):
            _cta_merge(acc0, acc1, acc2, acc3, st, part_ptr, ml_ptr, lock_ptr, out_ptr, bh, split, b, hk,
                       stride_ob, stride_oh, G, NUM_SPLITS, NW, DBG)
        else:
            _warp_publish(acc0, acc1, acc2, acc3, st, g5, c5, w5, e2, e3, e1, part_ptr, ml_ptr, lock_ptr,
                          out_ptr, bh, split, b, hk, stride_ob, stride_oh, G, NUM_SPLITS, NW, DBG)

    @gluon.jit
    def _ax6(n: gl.constexpr, dim: gl.constexpr, L6: gl.constexpr):
        """arange(0, n) along dim of the 6-D layout L6, expanded to 6 dims."""
        if dim < 5:
            x = gl.expand_dims(_ax(n, dim, gl.SliceLayout(5, L6)), 5)
        else:
            S: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0,
                                             gl.SliceLayout(0, L6)))))
            x = gl.arange(0, n, layout=S)
            for _ in gl.static_range(5):
                x = gl.expand_dims(x, 0)
        return x

    @gluon.jit
    def _pick(x, MAX: gl.constexpr):
        """x [warp, g, c, e2, e3, e1] masked to one (e2, e3) -> [warp, g, c, 1, 1, e1] (max, else sum)."""
        if MAX:
            x = gl.max(gl.max(x, 4), 3)
        else:
            x = gl.sum(gl.sum(x, 4), 3)
        return gl.expand_dims(gl.expand_dims(x, 3), 4)

    @gluon.jit
    def _cta_merge(acc0, acc1, acc2, acc3, st, part_ptr, ml_ptr, lock_ptr, out_ptr, bh, split, b, hk,
                   stride_ob, stride_oh, G: gl.constexpr, NUM_SPLITS: gl.constexpr, NW: gl.constexpr,
                   DBG: gl.constexpr):
        """The CTA's warps' partials merged as `_merge` merges slots, through shared memory: the warps store
        their accumulators (one store) and state, one barrier, then each accumulator T is summed over the
        warps with every operand of a sum in the lane's own registers (at 4 warps warp T holds tensor T; at
        2 each warp two; at 8 each tensor is in two warps). One split: the output, without a global round
        trip. More (or a counter-path DBG bit 2 / 4 / 8 at one split): one slot per CTA in the warps' format
        (acc register-major, m / M per query, l per lane), a second barrier, then `_count_and_merge`: the
        last CTA of the (b, kv head) to finish merges NUM_SPLITS slots, not NUM_SPLITS x NW."""
        # [T, warp, g, c, e2, e3, e1]: a lane (g, c) of warp T holds every warp's (e2, e3, e1) of tensor T
        # (4 warps; 2: warp T also T + 2; 8: warps T and T + 4 alike)
        LT: gl.constexpr = gl.BlockedLayout([1, NW, 1, 1, 2, 2, 2], [1, 1, 8, 4, 1, 1, 1],
                                            [NW, 1, 1, 1, 1, 1, 1], [6, 5, 4, 3, 2, 1, 0])
        SW: gl.constexpr = gl.SliceLayout(0, LT)  # [warp, g, c, e2, e3, e1], every warp's copy
        SO: gl.constexpr = gl.SliceLayout(1, LT)  # [T, g, c, e2, e3, e1], the sums
        SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [5, 4, 3, 2, 1, 0])
        acc_s = gl.allocate_shared_memory(gl.float32, [4 * NW, 8, 4, 2, 2, 2], SH)  # [T x warp, g, c, ...]
        st_s = gl.allocate_shared_memory(gl.float32, [NW, 8, 4, 2, 2, 2], SH)
        # one store (four into the same buffer would each take a barrier): rows T x NW + warp
        a4 = gl.join(gl.join(acc0, acc1), gl.join(acc2, acc3))  # [R, 4, 2, 2, 2, T & 1, T >> 1]
        a4 = gl.permute(a4, [6, 5, 0, 1, 2, 3, 4])  # [T >> 1, T & 1, R, 4, 2, 2, 2]
        acc_s.store(gl.reshape(a4, [4 * NW, 8, 4, 2, 2, 2]))
        st_s.store(gl.reshape(st, [NW, 8, 4, 2, 2, 2]))
        gl.thread_barrier()
        acc = acc_s.reshape([4, NW, 8, 4, 2, 2, 2]).load(LT)
        st6 = st_s.load(SW)
        NEG: gl.constexpr = float("-inf")
        e2 = _ax6(2, 3, SW)
        e3 = _ax6(2, 4, SW)
        # state per lane (query 2c + e1): m at (e2, e3) = (0, 0), M at (1, 0), l at (0, 1)
        m_w = _pick(gl.where((e2 == 0) & (e3 == 0), st6, NEG), True)  # [warp, g, c, 1, 1, e1]
        big_w = _pick(gl.where((e2 == 1) & (e3 == 0), st6, NEG), True)
        l_w = _pick(gl.where((e2 == 0) & (e3 == 1), st6, 0.0), False)
        m_cta = gl.max(m_w, 0)  # [8, 4, 1, 1, 2]; published as is (-inf: no token), as a warp's m
        big_mx = gl.max(big_w, 0)
        mx = gl.where(m_cta == NEG, 0.0, m_cta)
        big_mx = gl.where(big_mx == NEG, 0.0, big_mx)
        lg = gl.sum(l_w * gl.exp2(m_w - gl.expand_dims(mx, 0)), 0)  # lane g's share of l: [8, 4, 1, 1, 2]
        sa = gl.expand_dims(gl.exp2(big_w - gl.expand_dims(big_mx, 0)), 0)  # [1, warp, g, c, 1, 1, e1]
        num = gl.sum(acc * sa, 1)  # [T, g, c, e2, e3, e1]: head dim 16 g + 4 T + e2 + 2 e3, query 2 c + e1
        t = _ax6(4, 0, SO)
        g = _ax6(8, 1, SO)
        c = _ax6(4, 2, SO)
        f2 = _ax6(2, 3, SO)
        f3 = _ax6(2, 4, SO)
        f1 = _ax6(2, 5, SO)
        if (NUM_SPLITS == 1) and ((DBG & 14) == 0):
            den = gl.expand_dims(gl.sum(lg, 0), 0)  # [1, 4, 1, 1, 2]
            f = gl.exp2(big_mx - mx + 14.0) / gl.where(den == 0.0, 1.0, den)  # [8, 4, 1, 1, 2]
            f = gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(0, SO)), 0)
            q = 2 * c + f1
            optr = out_ptr + b * stride_ob + (hk * G + q) * stride_oh + 16 * g + 4 * t + f2 + 2 * f3
            om = (q < G) & (t >= 0) & (g >= 0) & (f2 >= 0) & (f3 >= 0)  # [4, 8, 4, 2, 2, 2], as num
            gl.store(optr, (num * f).to(gl.bfloat16), mask=om)
        else:
            slot = bh * NUM_SPLITS + split
            gl.store(part_ptr + slot * 1024 + t * 256 + (f2 * 4 + f3 * 2 + f1) * 32 + 4 * g + c, num,
                     cache_modifier=".cg")
            SS: gl.constexpr = gl.SliceLayout(0, SW)  # [g, c, 1, 1, e1]
            gs = _ax(8, 0, SS)
            qs = 2 * _ax(4, 1, SS) + _ax(2, 4, SS)
            mlp = ml_ptr + slot * 80 + qs + 0 * gs  # [8, 4, 1, 1, 2], as the statistics
            gl.store(mlp, m_cta, mask=gs == 0, cache_modifier=".cg")
            gl.store(mlp + 8, big_mx, mask=gs == 0, cache_modifier=".cg")
            gl.store(mlp + 16 + 8 * gs, lg, cache_modifier=".cg")
            gl.thread_barrier()
            _count_and_merge(part_ptr, ml_ptr, lock_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G,
                             NUM_SPLITS, NUM_SPLITS, NW, DBG)

    @gluon.jit
    def _warp_publish(acc0, acc1, acc2, acc3, st, g5, c5, w5, e2, e3, e1, part_ptr, ml_ptr, lock_ptr, out_ptr,
                      bh, split, b, hk, stride_ob, stride_oh, G: gl.constexpr, NUM_SPLITS: gl.constexpr,
                      NW: gl.constexpr, DBG: gl.constexpr):
        """Each warp publishes its own partial (DBG 16: FP4RL_GLUON_CTA_MERGE=0; past one split also without
        DBG 32: =1). The last CTA to finish merges the NUM_SPLITS x NW slots; at one split the CTA merges its
        own NW after the barrier, without the counter (the fiftieth session's path), unless a counter-path DBG
        bit (2 / 4 / 8) sends it through `_count_and_merge`."""
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
        if (NUM_SPLITS == 1) and ((DBG & 14) == 0):
            # one split: this CTA holds every partial of its (b, kv head), and the barrier above already
            # orders its warps' global stores before their loads in the merge, so no counter, no gpu-scope
            # fence and no lock reset (DBG & 8: the counter anyway, for timing; DBG 2 / 4 time the counter's
            # path at any split count)
            _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G, NW, NW)
        else:
            _count_and_merge(part_ptr, ml_ptr, lock_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G,
                             NUM_SPLITS, NUM_SPLITS * NW, NW, DBG)

    @gluon.jit
    def _count_and_merge(part_ptr, ml_ptr, lock_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh,
                         G: gl.constexpr, NUM_SPLITS: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr,
                         DBG: gl.constexpr):
        """After the CTA's barrier behind its published slots: the split counter of (b, kv head) (a gpu-scope
        acq_rel atomic); the last of its NUM_SPLITS CTAs merges the NS slots and resets the counter."""
        if DBG & 4:  # timing experiment: no fence (wrong memory ordering)
            done = gl.atomic_add(lock_ptr + bh, 1, sem="relaxed", scope="gpu")
        else:
            done = gl.atomic_add(lock_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            if DBG & 2:  # timing experiment: merge one slot only (wrong output)
                _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G, 1, NW)
            else:
                _merge(part_ptr, ml_ptr, out_ptr, bh, b, hk, stride_ob, stride_oh, G, NS, NW)
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

