"""The streaming loop of the Gluon NVFP4 decode kernel (gluon_decode.py): per-lane pointers.

The address arithmetic is out of the steps (the loop of the third session recomputed ~100 address,
mask and zero-fill instructions per 16-token step; 504 -> 431 SASS instructions per step, 120.5 ->
105.5 us at 32K on an H200, bit-identical results): each lane keeps one 64-bit pointer per operand
(K words, V words, K scale pairs, V scale bytes, the two per-token scales), bumped once per pair of
steps; every load of a step is that pointer plus a compile-time offset (the immediate of the load).
The steps whose 16 x num_warps tokens all lie below t_hi (all but at most two per split) load
without masks (in the last iteration the look-ahead load of the next pair re-reads the current
pair: no predicate, no zero fill); the ragged end runs in a short masked tail loop, as does, with
DBG 64, a split's odd last step. K words: one
16-byte load per token (inline ld.global.v4; the 5-D layout gives Triton only 8-byte vectors).

(One PTX block and one softmax update per pair of steps was also tried: 402 instructions per step,
but no faster on the H200 (105.6 us) and not bit-identical; not kept.)
"""

from __future__ import annotations

try:  # as in gluon_decode.py
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception:  # noqa: BLE001
    gluon = gl = None

if gluon is not None:

    @gluon.jit
    def _ld4(p, PRED: gl.constexpr, pred):
        """16-byte load per lane group of 4 elements sharing one pointer (p: int64 addresses, the same
        within each group of 4 consecutive registers); PRED: under pred (int32, no zero fill)."""
        if PRED:
            return gl.inline_asm_elementwise(
                "{\n.reg .pred p;\nsetp.ne.b32 p, $8, 0;\n@p ld.global.v4.b32 {$0, $1, $2, $3}, [$4];\n}\n",
                "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [p, pred], dtype=gl.int32, is_pure=True, pack=4)
        else:
            return gl.inline_asm_elementwise(
                "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,l,l,l", [p],
                dtype=gl.int32, is_pure=True, pack=4)

    @gluon.jit
    def _ptr_loads(pk, pv, pks, pvs, pkg, pvg, okw, ovw, oks, ovs, og, DT: gl.constexpr,
                   stride_kt: gl.constexpr, stride_vt: gl.constexpr, stride_kst: gl.constexpr,
                   stride_vst: gl.constexpr, MASK: gl.constexpr, mk, mv, kqs, zf, big, ts=0):
        """Operands of the step DT + ts tokens after the pointers (ts: a warp-uniform shift). MASK 0:
        none; 1: mk (warp-uniform, no zero fill, results unused when false); 2: per token (mk: K rows,
        mv: V rows), zero fill."""
        okw = okw + ts * stride_kt
        ovw = ovw + ts * stride_vt
        oks = oks + ts * stride_kst
        ovs = ovs + ts * stride_vst
        og = og + ts
        if MASK == 2:
            kw = gl.load(pk + (okw + DT * stride_kt), mask=mk, other=0)
        else:
            kpt = (pk + (okw - (okw % 4) + DT * stride_kt)).to(gl.int64, bitcast=True)
            kw = _ld4(kpt, MASK == 1, gl.broadcast(mk, kpt)[0].to(gl.int32))
        if MASK == 0:
            vw = gl.load(pv + (ovw + DT * stride_vt))
            ks = gl.load(pks + (oks + DT * stride_kst))
            vs = gl.load(pvs + (ovs + DT * stride_vst))
            kg = gl.load(pkg + (og + DT))
            vg = gl.load(pvg + (og + DT))
            bias = zf
        elif MASK == 1:
            vw = gl.load(pv + (ovw + DT * stride_vt), mask=mk)
            ks = gl.load(pks + (oks + DT * stride_kst), mask=mk)
            vs = gl.load(pvs + (ovs + DT * stride_vst), mask=mk)
            kg = gl.load(pkg + (og + DT), mask=mk)
            vg = gl.load(pvg + (og + DT), mask=mk)
            bias = zf
        else:
            vw = gl.load(pv + (ovw + DT * stride_vt), mask=mv, other=0)
            ks = gl.load(pks + (oks + DT * stride_kst), mask=mk, other=0)
            vs = gl.load(pvs + (ovs + DT * stride_vst), mask=mv, other=0)
            kg = gl.load(pkg + (og + DT), mask=mk, other=0.0)
            vg = gl.load(pvg + (og + DT), mask=mk, other=0.0)
            bias = gl.broadcast(gl.where(mk, 0.0, float("-inf")), big)[0]
        return (kw, vw, gl.broadcast(ks.to(gl.int32), big)[0], gl.broadcast(vs.to(gl.int32), big)[0],
                gl.broadcast(kg * kqs, big)[0], bias, gl.broadcast(vg, big)[0])

    @gluon.jit
    def _prefetch(addr, pred):
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
    def _stream(ASM: gl.constexpr, CON: gl.constexpr, PF: gl.constexpr, STEP: gl.constexpr,
                kw_base, vw_base, ks_base, vs_base, kg_base, vg_base, t_lo, t_hi,
                w5, g5, c5, e2, e3, e1, stride_kt: gl.constexpr, stride_vt: gl.constexpr,
                stride_kst: gl.constexpr, stride_vst: gl.constexpr, kqs, zf, big, qa, qb, st,
                acc0, acc1, acc2, acc3, pf_off, pf_tok, pf_t0, DBG: gl.constexpr):
        """All steps of one warp's share of [t_lo, t_hi): returns acc0..3, st."""
        t0 = t_lo + 16 * w5  # [R, 1, 1, 1, 1]: the warp's first token
        pk = kw_base + ((t0 + g5) * stride_kt + 4 * c5)  # [R, 4, 1, 1, 1]
        pv = vw_base + ((t0 + 2 * c5) * stride_vt + 2 * g5)
        pks = ks_base + ((t0 + g5) * stride_kst + c5)
        pvs = vs_base + ((t0 + 2 * c5) * stride_vst + g5)
        pkg = kg_base + (t0 + g5)  # [R, 1, 1, 1, 1]
        pvg = vg_base + (t0 + g5)
        okw = e2 * (8 * stride_kt) + e3 * 2 + e1  # [1, 1, 2, 2, 2]: compile-time per register
        ovw = (e3 + 8 * e2) * stride_vt + e1
        oks = e2 * (8 * stride_kst)
        ovs = (e3 + 8 * e2) * stride_vst
        og = 8 * e2
        n_tok = gl.maximum(t_hi - t_lo, 0)
        n_steps = gl.cdiv(n_tok, STEP)
        n_main = (n_tok // (2 * STEP)) * 2  # steps in pairs whose tokens are all valid
        if DBG & 1:
            n_steps = 0
            n_main = 0
        z = g5 * 0  # [R, 1, 1, 1, 1] zeros (warp-uniform predicates)
        ppf = pf_off + (pf_t0 + PF * STEP).to(gl.int64) * pf_tok  # [R, 4] prefetch address, PF steps ahead
        pf_inc = pf_tok.to(gl.int64) * STEP
        kwa, vwa, ksa, vsa, kqa, bia, vga = _ptr_loads(
            pk, pv, pks, pvs, pkg, pvg, okw, ovw, oks, ovs, og, 0, stride_kt, stride_vt, stride_kst,
            stride_vst, 1, z < n_main, z < n_main, kqs, zf, big)
        for i in range(0, n_main, 2):
            if PF > 0:
                _prefetch(ppf, (pf_t0 + (i + PF) * STEP) < t_hi)
            kwb, vwb, ksb, vsb, kqb, bib, vgb = _ptr_loads(
                pk, pv, pks, pvs, pkg, pvg, okw, ovw, oks, ovs, og, STEP, stride_kt, stride_vt, stride_kst,
                stride_vst, 0, z < n_main, z < n_main, kqs, zf, big)
            acc0, acc1, acc2, acc3, st = _step(ASM, CON, kwa, vwa, ksa, vsa, kqa, bia, vga, qa, qb, st,
                                               acc0, acc1, acc2, acc3)
            if PF > 0:
                _prefetch(ppf + pf_inc, (pf_t0 + (i + 1 + PF) * STEP) < t_hi)
            # the next pair; in the last iteration the current pair again (in bounds; unused)
            back = gl.where(i + 2 < n_main, 0, 2 * STEP)
            kwa, vwa, ksa, vsa, kqa, bia, vga = _ptr_loads(
                pk, pv, pks, pvs, pkg, pvg, okw, ovw, oks, ovs, og, 2 * STEP, stride_kt, stride_vt,
                stride_kst, stride_vst, 0, z < n_main, z < n_main, kqs, zf, big, -back)
            acc0, acc1, acc2, acc3, st = _step(ASM, CON, kwb, vwb, ksb, vsb, kqb, bib, vgb, qa, qb, st,
                                               acc0, acc1, acc2, acc3)
            pk += 2 * STEP * stride_kt
            pv += 2 * STEP * stride_vt
            pks += 2 * STEP * stride_kst
            pvs += 2 * STEP * stride_vst
            pkg += 2 * STEP
            pvg += 2 * STEP
            ppf += 2 * pf_inc
        # the ragged end (at most two steps: in a split that holds the end of the sequence, or with DBG 64 a
        # split's odd last step)
        tk_k = g5 + 8 * e2  # [R, 1, 2, 1, 1]: token of the K rows of this lane
        tk_v = 2 * c5 + e3 + 8 * e2  # [R, 4, 2, 2, 1]: tokens of its V rows
        for i in range(n_main, n_steps):
            tb = t0 + i * STEP
            kwt, vwt, kst, vst, kqt, bit, vgt = _ptr_loads(
                pk, pv, pks, pvs, pkg, pvg, okw, ovw, oks, ovs, og, 0, stride_kt, stride_vt, stride_kst,
                stride_vst, 2, (tb + tk_k) < t_hi, (tb + tk_v) < t_hi, kqs, zf, big)
            acc0, acc1, acc2, acc3, st = _step(ASM, CON, kwt, vwt, kst, vst, kqt, bit, vgt, qa, qb, st,
                                               acc0, acc1, acc2, acc3)
            pk += STEP * stride_kt
            pv += STEP * stride_vt
            pks += STEP * stride_kst
            pvs += STEP * stride_vst
            pkg += STEP
            pvg += STEP
        return acc0, acc1, acc2, acc3, st
