"""Ninth session: the MoE route kernel's time by warps and sort-step width, against the torch route it
replaces (softmax, top-k, normalize, cast, stable argsort, searchsorted, gather index: KernelMoeBlock's
torch path).

python3 bench/moe_route_bench.py   (Qwen3-30B-A3B router: E 128, top 8; tokens 1, 8, 32, 64)
python3 bench/moe_route_bench.py regs   (twenty-ninth session: the sort from the ids in registers, by warps)
python3 bench/moe_route_bench.py cuda   (thirty-fourth session: the CUDA router + route, moe_route_cuda,
                                        against the Triton router_route, with and without PDL between calls)
python3 bench/moe_route_bench.py router   (eleventh session: the router GEMM + route in one launch,
                                           moe_route.router_route, by warps / experts per program / columns
                                           per step / columns per program, against F.linear (cuBLAS) + the
                                           route kernel)

CUDA-graph replay of 50 calls, median of 5 replays, us per call. Every variant's outputs are checked equal to
the default's.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_fixed import timed  # noqa: E402  (graph replay of reps calls, median of ROUNDS)

from fp4rl.kernels import moe_route  # noqa: E402

REPS = 50


def torch_route(lg, k):
    probs = torch.softmax(lg, -1, dtype=torch.float32)
    w, idx = torch.topk(probs, k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(lg.dtype)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.searchsorted(flat[order], torch.arange(lg.shape[1] + 1, device=lg.device)).to(torch.int32)
    return idx, w, order // k, offs


def main():
    e, k = 128, 8
    heads = [f"w{nw} bq{bq}" for nw in (2, 4, 8) for bq in (32, 64, 128)]
    print("| tokens | torch route us | " + " | ".join(heads) + " |")
    for t in (1, 8, 32, 64):
        lg = torch.randn(t, e, device="cuda").bfloat16()
        ref = moe_route.route(lg, k, True)
        cells = [f"{timed(lambda _r, lg=lg: torch_route(lg, k), REPS):.1f}"]
        for nw in (2, 4, 8):
            for bq in (32, 64, 128):
                out = moe_route.route(lg, k, True, num_warps=nw, bq=bq)
                same = all(torch.equal(a, b) for a, b in zip(out, ref))
                us = timed(lambda _r, lg=lg, nw=nw, bq=bq: moe_route.route(lg, k, True, num_warps=nw, bq=bq),
                           REPS)
                cells.append(f"{us:.1f}" + ("" if same else " (DIFFERS)"))
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)
    d = torch.randn(32 * k, 2048, device="cuda").bfloat16()
    _, w, _, pos, _ = moe_route.route(torch.randn(32, e, device="cuda").bfloat16(), k, True)
    print(f"combine 32 tokens x 2048: {timed(lambda _r: moe_route.combine(d, pos, w), REPS):.1f} us")


def router_main():
    """(warps, experts per program, columns per step, columns per program): the last is the column split of
    the fourteenth session (2048 = H: one slice, the eleventh session's kernel)."""
    e, k, h = 128, 8, 2048
    variants = [(nw, bes, min(256, hc), hc) for nw in (4, 8) for bes in (16, 32) for hc in (128, 256, 512)]
    variants.append((4, 16, 256, 2048))
    print("| tokens | F.linear + route us | " + " | ".join(f"w{a} e{b} h{c} hc{d}" for a, b, c, d in variants)
          + " |")
    wr = (torch.randn(e, h, device="cuda") * 0.02).bfloat16()
    for t in (1, 8, 32, 64):
        x = torch.randn(t, h, device="cuda").bfloat16()
        ref_logits = F.linear(x, wr)
        cells = [f"{timed(lambda _r, x=x: moe_route.route(F.linear(x, wr), k, True), REPS):.1f}"]
        for nw, bes, bh, hc in variants:
            name = f"router_route w{nw} e{bes} h{bh} hc{hc}"
            out = moe_route.router_route(x, wr, k, True, num_warps=nw, bes=bes, bh=bh, hc=hc)
            ulp = ref_logits.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
            if not bool(((out[0].float() - ref_logits.float()).abs() <= ulp).all()):
                raise SystemExit(f"{name}: logits beyond a bf16 ulp of cuBLAS's")
            if not all(torch.equal(a, b) for a, b in zip(out[1:], moe_route.route(out[0], k, True))):
                raise SystemExit(f"{name}: not the route of its own logits")
            us = timed(lambda _r, x=x, nw=nw, bes=bes, bh=bh, hc=hc: moe_route.router_route(
                x, wr, k, True, num_warps=nw, bes=bes, bh=bh, hc=hc), REPS)
            cells.append(f"{us:.1f}")
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)


def keyed_main():
    """Sixteenth session: the top-k on packed keys (KEYED_TOPK) against the two-pass form, alternating in the
    same run (ROUNDS rounds, median of the rounds' medians): route alone (default warps) and router_route at
    its defaults, Qwen3-30B-A3B's router (E 128, H 2048, top 8). Outputs checked equal first."""
    e, k, h = 128, 8, 2048
    wr = (torch.randn(e, h, device="cuda") * 0.02).bfloat16()
    print("| kernel | tokens | two-pass us | keyed us | saved us |")
    for t in (1, 8, 32):
        lg = torch.randn(t, e, device="cuda").bfloat16()
        x = torch.randn(t, h, device="cuda").bfloat16()
        cases = [("route", lambda kd, lg=lg: moe_route.route(lg, k, True, keyed=kd))]
        if t <= 8:
            cases.append(("router_route", lambda kd, x=x: moe_route.router_route(x, wr, k, True, keyed=kd)))
        for name, fn in cases:
            if not all(torch.equal(a, b) for a, b in zip(fn(True), fn(False))):
                raise SystemExit(f"{name} {t} tokens: keyed and two-pass outputs differ")
            got = {True: [], False: []}
            for _ in range(5):
                for kd in (False, True):
                    got[kd].append(timed(lambda _r, fn=fn, kd=kd: fn(kd), REPS))
            old, new = sorted(got[False])[2], sorted(got[True])[2]
            print(f"| {name} | {t} | {old:.2f} | {new:.2f} | {old - new:.2f} |", flush=True)


def regs_main():
    """Twenty-ninth session: the sort from the ids in registers (REGS) against the sort from idx, and the
    launch's warps (the last program's reductions are shared-memory trees with barriers past one warp), for
    router_route (Qwen3-30B-A3B's router, its defaults otherwise) and route at 1 / 8 tokens (route's default
    is 2 warps to 16 pairs, 8 above); the variants alternate over 5 rounds (the median of the rounds'
    medians); outputs checked equal to the default's."""
    e, k, h = 128, 8, 2048
    wr = (torch.randn(e, h, device="cuda") * 0.02).bfloat16()
    variants = [(nw, regs) for nw in (1, 2, 4, 8) for regs in (False, True)]
    names = [f"w{nw} {'regs' if r else 'idx'} us" for nw, r in variants]
    print("| kernel | tokens | " + " | ".join(names) + " |")
    for t in (1, 8):
        lg = torch.randn(t, e, device="cuda").bfloat16()
        x = torch.randn(t, h, device="cuda").bfloat16()
        cases = [("router_route",
                  lambda nw, r, x=x: moe_route.router_route(x, wr, k, True, num_warps=nw, regs=r)),
                 ("route", lambda nw, r, lg=lg: moe_route.route(lg, k, True, num_warps=nw, regs=r))]
        for name, fn in cases:
            ref = fn(None, None)
            for nw, r in variants:
                if not all(torch.equal(a, b) for a, b in zip(fn(nw, r), ref)):
                    raise SystemExit(f"{name} {t} tokens w{nw} regs {r}: outputs differ from the default's")
            got = {v: [] for v in variants}
            for _ in range(5):
                for v in variants:
                    got[v].append(timed(lambda _r, fn=fn, v=v: fn(*v), REPS))
            print(f"| {name} | {t} | " + " | ".join(f"{sorted(got[v])[2]:.2f}" for v in variants) + " |",
                  flush=True)


def cuda_main():
    """Thirty-fourth session: the CUDA router + route (moe_route_cuda, one cluster launch; the logits to CTA 0
    behind a cluster barrier, and by st.async on an mbarrier: ASYNC_LOGITS) against the Triton router_route at
    its defaults, Qwen3-30B-A3B's router (E 128, H 2048, top 8) at 1 / 2 / 4 / 8 tokens.
    Outputs first: the CUDA kernel equal to its reference, the same experts as the Triton kernel. Then each
    timed alternately over 5 rounds (the median of the rounds' medians): a graph of REPS calls without PDL,
    and inside pdl.step() (each call may start while the one before runs: the CUDA kernel's router rows go to
    shared memory before its wait, as in the decode step)."""
    from fp4rl.kernels import moe_route_cuda, pdl

    e, k, h = 128, 8, 2048
    wr = (torch.randn(e, h, device="cuda") * 0.02).bfloat16()
    print("| tokens | PDL | Triton router_route us | CUDA, cluster barrier us | CUDA, st.async (ASYNC) us |")

    def cuda(x, asy):
        moe_route_cuda.ASYNC_LOGITS = asy
        try:
            return moe_route_cuda.router_route(x, wr, k, True)
        finally:
            moe_route_cuda.ASYNC_LOGITS = False

    for t in (1, 2, 4, 8):
        x = torch.randn(t, h, device="cuda").bfloat16()
        want = moe_route_cuda.reference(x, wr, k, True)
        for asy in (False, True):
            if not all(torch.equal(a, b) for a, b in zip(cuda(x, asy), want)):
                raise SystemExit(f"{t} tokens, ASYNC {asy}: the CUDA kernel differs from its reference")
        if not torch.equal(want[1], moe_route.router_route(x, wr, k, True)[1]):
            print(f"({t} tokens: other experts than the Triton kernel's: a near tie in the logits' last bit)")
        fns = {"triton": lambda x=x: moe_route.router_route(x, wr, k, True),
               "cuda": lambda x=x: cuda(x, False), "async": lambda x=x: cuda(x, True)}
        for use_pdl in (False, True):
            times = {name: [] for name in fns}
            for _ in range(5):
                for name, fn in fns.items():
                    if use_pdl:
                        with pdl.step():
                            times[name].append(timed(lambda _r, fn=fn: fn(), REPS))
                    else:
                        times[name].append(timed(lambda _r, fn=fn: fn(), REPS))
            cells = " | ".join(f"{sorted(times[n])[2]:.2f}" for n in fns)
            print(f"| {t} | {'on' if use_pdl else 'off'} | {cells} |", flush=True)


if __name__ == "__main__":
    modes = {"router": router_main, "keyed": keyed_main, "regs": regs_main, "cuda": cuda_main}
    modes.get(sys.argv[1] if sys.argv[1:] else "", main)()
