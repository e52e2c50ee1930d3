"""W4A16 decode GEMV for 1-2 rows of x on CUDA cores, written in Gluon (Triton's explicit-layout dialect).

Why Gluon: in plain Triton the few rows of x and the per-16-element block scales get layouts of
their own (one element per thread), and the compiler converts them to the weight tile's layout
through shared memory with CTA barriers in every loop iteration (seen in the TTGIR/SASS of the
plain-Triton kernels: ~6 barriers per iteration). That chain, not the memory, bounded the old
decode kernels. Here every operand is laid out by hand from one 3D blocked layout
L3 = [rows, 8-byte groups, 8 bytes]:
- weights: each thread loads 16 consecutive packed bytes (two scale blocks) of R rows: one
  16-byte load per row and iteration;
- block scales: SliceLayout(2, L3), the two E4M3 bytes that belong to those 16 bytes;
- x: SliceLayout(0, L3), read as 32-bit words (one bf16 pair k even / k odd per packed byte),
  16 consecutive words per thread, shared by its R rows; a pair splits into FP32 with one
  integer instruction per value;
- products accumulate elementwise in FP32 (no reduction in the loop) and are reduced once.
The next tile is loaded before the current one is computed (register double buffer), so each
thread keeps a tile of loads in flight. No shared memory, no barrier in the loop.

Arithmetic: the same as fp4rl.kernels.gemm (exact bfloat16 e2m1 * block_scale, FP32 FMAs, the
global scale once on the sum); the split-K partials are added in split order by the last program
of each tile, so results do not depend on scheduling.

Only compiled on CUDA (Gluon has no CPU interpreter); ``available()`` says whether it imports here.
"""

from __future__ import annotations

import torch

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _IMPORT_ERROR = None
except Exception as exc:  # noqa: BLE001
    gluon = gl = None
    _IMPORT_ERROR = exc

from fp4rl.kernels._common import _UNPACK_WORD, COMPILED

# Unpack to FP32: 8 packed bytes ($16, $17) and the block scale as FP32 ($18; the pack's 8 copies
# are one register) -> lo ($0..$7: e2m1 * s of the low nibbles, byte order) and hi ($8..$15: the
# high nibbles), FP32. The codes go through fp4rl.kernels._common's bfloat16 byte tables and one
# mul.rn.bf16x2 by the scale (exact), then each bfloat16 is widened with one shift or mask.
_WIDEN = """
shl.b32 {a}, {p}, 16;
and.b32 {b}, {p}, 0xFFFF0000;
"""


def _word_fp32(w: str, lo: list, hi: list) -> str:
    body = _UNPACK_WORD.format(w=w, lo0="p0", lo1="p1", hi0="p2", hi1="p3", s0="sc", s1="sc")
    body += _WIDEN.format(p="p0", a=lo[0], b=lo[1]) + _WIDEN.format(p="p1", a=lo[2], b=lo[3])
    body += _WIDEN.format(p="p2", a=hi[0], b=hi[1]) + _WIDEN.format(p="p3", a=hi[2], b=hi[3])
    return body


_ASM = (
    "{\n.reg .b32 s<13>, lb0, lb1, hb0, hb1, sg, sc, p0, p1, p2, p3;\n"
    "mov.b32 lb0, 0xC0800000;\nmov.b32 lb1, 0xC0804000;\nmov.b32 hb0, 0x3F3F3F00;\n"
    "mov.b32 hb1, 0x40404040;\nmov.b32 sg, 0x8000;\ncvt.rn.bf16x2.f32 sc, $18, $18;\n"
    + _word_fp32("$16", ["$0", "$1", "$2", "$3"], ["$8", "$9", "$10", "$11"])
    + _word_fp32("$17", ["$4", "$5", "$6", "$7"], ["$12", "$13", "$14", "$15"])
    + "}\n"
)
STATE = {"ok": _IMPORT_ERROR is None, "error": repr(_IMPORT_ERROR) if _IMPORT_ERROR else None}


def available() -> bool:
    return STATE["ok"]


def disable(exc: Exception) -> None:
    """Stop using the Gluon GEMV in this process (it failed to compile or run here)."""
    import warnings

    STATE["ok"], STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"Gluon W4A16 GEMV disabled ({STATE['error']}); using the Triton decode kernel",
                  stacklevel=3)


if gluon is not None:

    @gluon.jit
    def _gemv_kernel(
        x_ptr, w_ptr, ws_ptr, wg_ptr, y_ptr, part_ptr, lock_ptr,
        M, N, KH, stride_xm, stride_wn, stride_wsn, stride_ym,
        WG_ROW: gl.constexpr, SPLIT_K: gl.constexpr, BM: gl.constexpr,
        R: gl.constexpr, TR: gl.constexpr, TC: gl.constexpr, EVEN: gl.constexpr, ASM: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        BN: gl.constexpr = R * TR * NW
        G: gl.constexpr = 2 * TC  # 8-byte groups (one block scale each) per row and iteration
        BKH: gl.constexpr = 8 * G
        L3: gl.constexpr = gl.BlockedLayout([R, 2, 8], [TR, TC, 1], [NW, 1, 1], [2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, L3)  # [BN, G]
        LX: gl.constexpr = gl.SliceLayout(0, L3)  # [G, 8]
        LN: gl.constexpr = gl.SliceLayout(1, LS)  # [BN]

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        rows = pid_n * BN + gl.arange(0, BN, layout=LN)
        g_s = gl.arange(0, G, layout=gl.SliceLayout(0, LS))
        g_x = gl.arange(0, G, layout=gl.SliceLayout(1, LX))
        b_x = gl.arange(0, 8, layout=gl.SliceLayout(0, LX))
        xoff = gl.expand_dims(g_x, 1) * 8 + gl.expand_dims(b_x, 0)  # [G, 8] byte (= x word) offsets
        woff = gl.expand_dims(gl.expand_dims(rows, 1), 2) * stride_wn + gl.expand_dims(xoff, 0)  # [BN, G, 8]
        soff = gl.expand_dims(rows, 1) * stride_wsn + gl.expand_dims(g_s, 0)  # [BN, G]
        rmask_s = gl.expand_dims(rows < N, 1)
        rmask_w = gl.expand_dims(rmask_s, 2)

        kh_per = gl.cdiv(gl.cdiv(KH, SPLIT_K), BKH) * BKH
        kb_lo = pid_k * kh_per
        kb_hi = gl.minimum(KH, kb_lo + kh_per)

        acc0 = gl.zeros([BN, G, 8], gl.float32, L3)
        acc1 = gl.zeros([BN, G, 8], gl.float32, L3)
        # prologue: the first tile
        if EVEN:
            wb_n = gl.load(w_ptr + woff + kb_lo, mask=kb_lo < kb_hi)
            sb_n = gl.load(ws_ptr + soff + kb_lo // 8, mask=kb_lo < kb_hi)
        else:
            wb_n = gl.load(w_ptr + woff + kb_lo, mask=rmask_w & (gl.expand_dims(xoff, 0) + kb_lo < kb_hi),
                           other=0)
            sb_n = gl.load(ws_ptr + soff + kb_lo // 8,
                           mask=rmask_s & (gl.expand_dims(g_s, 0) * 8 + kb_lo < kb_hi), other=0)
        for kb0 in range(kb_lo, kb_hi, BKH):
            wb = wb_n
            sb = sb_n
            nxt = kb0 + BKH
            if EVEN:  # prefetch the next tile before computing this one
                wb_n = gl.load(w_ptr + woff + nxt, mask=nxt < kb_hi)
                sb_n = gl.load(ws_ptr + soff + nxt // 8, mask=nxt < kb_hi)
                xw0 = gl.load(x_ptr + xoff + kb0)
            else:
                wb_n = gl.load(w_ptr + woff + nxt, mask=rmask_w & (gl.expand_dims(xoff, 0) + nxt < kb_hi),
                               other=0)
                sb_n = gl.load(ws_ptr + soff + nxt // 8,
                               mask=rmask_s & (gl.expand_dims(g_s, 0) * 8 + nxt < kb_hi), other=0)
                xw0 = gl.load(x_ptr + xoff + kb0, mask=xoff + kb0 < kb_hi, other=0)
            s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32)  # exact
            s3 = gl.broadcast(gl.expand_dims(s, 2), wb)[0]
            wl, wh = gl.inline_asm_elementwise(
                ASM, "=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,r,r,f,f,f,f,f,f,f,f", [wb, s3],
                dtype=(gl.float32, gl.float32), is_pure=False, pack=8,
            )
            xl = gl.expand_dims((xw0 << 16).to(gl.float32, bitcast=True), 0)
            xh = gl.expand_dims((xw0 & -65536).to(gl.float32, bitcast=True), 0)
            acc0 = acc0 + wl * xl
            acc0 = acc0 + wh * xh
            if BM == 2:
                if EVEN:
                    xw1 = gl.load(x_ptr + stride_xm + xoff + kb0, mask=M > 1, other=0)
                else:
                    xw1 = gl.load(x_ptr + stride_xm + xoff + kb0, mask=(xoff + kb0 < kb_hi) & (M > 1),
                                  other=0)
                xl1 = gl.expand_dims((xw1 << 16).to(gl.float32, bitcast=True), 0)
                xh1 = gl.expand_dims((xw1 & -65536).to(gl.float32, bitcast=True), 0)
                acc1 = acc1 + wl * xl1
                acc1 = acc1 + wh * xh1

        p0 = gl.sum(gl.sum(acc0, 2), 1)  # [BN], LN
        p1 = gl.sum(gl.sum(acc1, 2), 1)
        last = True
        if SPLIT_K > 1:  # deterministic split-K: the last program of the tile adds partials in order
            base = part_ptr + pid_n * (SPLIT_K * BM * BN)
            loc = gl.arange(0, BN, layout=LN)
            gl.store(base + pid_k * (BM * BN) + loc, p0, cache_modifier=".cg")
            if BM == 2:
                gl.store(base + pid_k * (BM * BN) + BN + loc, p1, cache_modifier=".cg")
            gl.thread_barrier()
            done = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            last = done == SPLIT_K - 1
            if last:
                p0 = gl.load(base + loc, cache_modifier=".cg")
                if BM == 2:
                    p1 = gl.load(base + BN + loc, cache_modifier=".cg")
                for sk in range(1, SPLIT_K):
                    p0 += gl.load(base + sk * (BM * BN) + loc, cache_modifier=".cg")
                    if BM == 2:
                        p1 += gl.load(base + sk * (BM * BN) + BN + loc, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + pid_n, 0)
        if last:
            nmask = rows < N
            if WG_ROW:
                g = gl.load(wg_ptr + rows, mask=nmask, other=0.0)
            else:
                g = gl.load(wg_ptr)
            gl.store(y_ptr + rows, (p0 * g).to(gl.bfloat16), mask=nmask)
            if BM == 2:
                gl.store(y_ptr + stride_ym + rows, (p1 * g).to(gl.bfloat16), mask=nmask & (M > 1))


def configs(n: int, kh: int, sms: int) -> list[dict]:
    """Candidate (R, TR, TC, num_warps, SPLIT_K) for an N x 2KH weight; first is the default."""
    out = []
    for r, tr, tc, nw in ((2, 4, 8, 4), (4, 4, 8, 4), (2, 2, 16, 4), (4, 1, 32, 4), (2, 4, 8, 8),
                          (1, 4, 8, 8)):
        bn, bkh = r * tr * nw, 16 * tc
        tiles = -(-n // bn)
        split = 1
        while tiles * split < 2 * sms and kh // (2 * split) >= 2 * bkh:
            split *= 2
        for sk in dict.fromkeys((split, 2 * split, max(1, split // 2))):
            if kh // sk >= bkh:
                out.append(dict(R=r, TR=tr, TC=tc, num_warps=nw, SPLIT_K=sk))
    return out


def launch(x2: torch.Tensor, wd: torch.Tensor, ws: torch.Tensor, wg: torch.Tensor, y: torch.Tensor,
           cfg: dict, workspace) -> torch.Tensor:
    """y [M, N] (M <= 2) = x2 [M, K] bf16 @ DQ(W).T; wd uint8 [N, K/2], ws uint8 [N, K/16],
    wg fp32 [1] or [N]."""
    n, kh = wd.shape
    m = x2.shape[0]
    if m > 2:
        raise ValueError(f"the Gluon GEMV takes 1-2 rows, got {m}")
    bn = cfg["R"] * cfg["TR"] * cfg["num_warps"]
    bkh = 16 * cfg["TC"]
    split = cfg["SPLIT_K"]
    tiles = -(-n // bn)
    part, lock = workspace.get(y.device, tiles * split * 2 * bn if split > 1 else 0, tiles)
    xw = x2.view(torch.int32)  # [M, K/2]: bf16 pairs
    COMPILED["w4_gemv gluon"] = _gemv_kernel[(tiles, split)](
        xw, wd, ws, wg, y, part, lock, m, n, kh, xw.stride(0), wd.stride(0), ws.stride(0), y.stride(0),
        WG_ROW=wg.numel() > 1, SPLIT_K=split, BM=2 if m == 2 else 1, R=cfg["R"], TR=cfg["TR"], TC=cfg["TC"],
        EVEN=n % bn == 0 and kh % bkh == 0, ASM=_ASM, num_warps=cfg["num_warps"],
    )
    return y
