"""Sweep the grouped (routed-expert) CUDA mma16 W4A16 kernel on an MoE layer's shapes, the way the decode step
calls it: gate|up with the route's gather (x_rows) and down with SiLU(gate) * up in its x staging (x_silu).
Timing as fp4rl.benchmarks.gpu_kernels (CUDA-graph replay of a chain of calls, median of 7); each call reads a
different routing set of a full expert stack, so the weights come from DRAM as in decode, not from L2. Each
configuration is checked against the float64 product of the dequantized experts before it is timed.

  python3 bench/grouped_sweep.py [--experts 128] [--topk 8] [--hidden 2048] [--inter 768] [--tokens 1,8]
                                 [--variants auto,d3,d4,s2x,pdl,pdl+d4,t3] [--out FILE]

Variants as bench/mma16_sweep.py (dN DEPTH, sN SPLIT, trN TRIGGER, tN timing-only builds, s2x / sh twice /
half the chosen split, pdl: launches with programmatic dependent launch; mgN: chunks of 8N rows; auto: as
the sampler launches it, gemv_cuda_grouped.grouped_mg's chunks), and triton: the Triton grouped GEMM
(gemm.gemm without `tokens`, tuned), the experts' other path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mma16_sweep import configs, start  # noqa: E402

from fp4rl.benchmarks.gpu_kernels import _rel, time_calls  # noqa: E402
from fp4rl.kernels import gemm, gemv_cuda_grouped, pdl  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402


def expert_stack(e: int, n: int, k: int, seed: int):
    """E random experts [N, K] quantized to NVFP4: the stacked mma16 copy, global scales [E], a function
    giving expert i dequantized (float64), and the packed stack (data, block_scale, global_scale: the Triton
    grouped GEMM's operand)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    datas, scales, gs = [], [], []
    for _ in range(e):
        q = reference.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        datas.append(q.data)
        scales.append(q.block_scale)
        gs.append(q.global_scale.float().reshape(()))
    data, bs, gsc = torch.stack(datas), torch.stack(scales), torch.stack(gs)
    wc = gemv_cuda_grouped.relayout_stack(data, bs)

    def deq(i):
        from fp4rl.nvfp4.format import NVFP4Tensor

        return reference.dequantize(NVFP4Tensor(data=data[i], block_scale=bs[i], global_scale=gsc[i],
                                                shape=(n, k), dtype=torch.float32)).double()

    return wc, gsc, deq, SimpleNamespace(data=data, block_scale=bs, global_scale=gsc)


def routings(tokens: int, experts: int, topk: int, sets: int, seed: int):
    """`sets` routings of `tokens` tokens (top-k distinct experts each, the sets covering every expert in turn
    so that successive calls read different weights): (offsets int32 [E+1], rows int32 [M] = the token of each
    expert-sorted row, expert of each sorted row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(sets):
        perm = torch.randperm(experts, generator=g)
        chosen = torch.stack([perm[(s * topk + t * 7 + torch.arange(topk)) % experts] for t in range(tokens)])
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        ex = flat[order]
        tok = (order // topk).to(torch.int32)
        counts = torch.bincount(ex, minlength=experts)
        offs = torch.zeros(experts + 1, dtype=torch.int32)
        offs[1:] = torch.cumsum(counts, 0)
        out.append((offs.cuda(), tok.cuda(), ex))
    return out


def call(fn, use_pdl):
    with pdl.step() if use_pdl else contextlib.nullcontext():
        return fn()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--sets", type=int, default=16)
    ap.add_argument("--variants", default="auto,d3,d4,d6,s2x,sh,t3,pdl,pdl+d4")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms, out, bw, t_start = start()
    e, h, f = a.experts, a.hidden, a.inter
    up_wc, up_g, up_deq, up_packed = expert_stack(e, 2 * f, h, seed=1)
    dn_wc, dn_g, dn_deq, dn_packed = expert_stack(e, h, f, seed=2)
    per_up = (2 * f) * h * 9 // 16  # packed bytes + E4M3 scales per expert
    per_dn = h * f * 9 // 16
    print(f"experts built [{time.time() - t_start:.0f} s]", flush=True)
    for t in map(int, a.tokens.split(",")):
        sets = routings(t, e, a.topk, a.sets, seed=t)
        m = t * a.topk
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        gu = [torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16) for _ in sets]
        offs0, rows0, ex0 = sets[0]
        used = sorted(set(ex0.tolist()))
        for name, wc, g, deq, n, k, per, packed in (
                ("gate_up", up_wc, up_g, up_deq, 2 * f, h, per_up, up_packed),
                ("down", dn_wc, dn_g, dn_deq, h, f, per_dn, dn_packed)):
            deqs = {i: deq(i) for i in used}
            ex_rows = ex0.tolist()
            if name == "gate_up":
                xin = x.double()[rows0.long().cpu()]
            else:
                gate, up = gu[0][:, :f].float(), gu[0][:, f:].float()
                xin = (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16().double()
            ref = torch.stack([xin[r] @ deqs[ex_rows[r]].T for r in range(m)])
            base = gemv_cuda_grouped.choose_grouped(n, k, min(e, m), sms,
                                                    gemv_cuda_grouped.grouped_mg(m, e))  # as launched
            moved = len(set(ex_rows)) * per + m * (k if name == "gate_up" else 2 * k) * 2 + m * n * 2
            floor_us = moved / bw / 1e6
            variants = a.variants.split(",")
            if "triton" in variants:  # the Triton grouped GEMM (gemm.gemm without `tokens`), tuned
                def trun(i, name=name, packed=packed, sets=sets, x=x, gu=gu):
                    offs, rows, _ = sets[i]
                    if name == "gate_up":
                        return gemm.gemm(x, packed, offsets=offs, rows=rows)
                    return gemm.gemm(gu[i], packed, offsets=offs, silu=True)

                try:
                    err = _rel(trun(0), ref)
                    us = time_calls([lambda i=i: trun(i) for i in range(len(sets))])
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} t{t} triton FAILED {repr(exc)[:400]}", flush=True)
                else:
                    out["rows"].append(dict(kernel="triton_grouped", which=name, variant="triton", n=n, k=k,
                                            tokens=t, rows=m, us=us, floor_us=floor_us, rel_err=err,
                                            tb_s=moved / us / 1e6))
                    print(f"{name:8s} {n}x{k} t{t:2d} {us:7.2f} us  floor {floor_us:5.2f}  "
                          f"{moved / us / 1e6:4.2f} TB/s  err {err:.1e}  triton grouped", flush=True)
            for vname, c, use_pdl in configs([v for v in variants if v != "triton"], base, k):
                ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in sets]

                def run(i, c=c, name=name, wc=wc, g=g, sets=sets, x=x, ys=ys, gu=gu):
                    offs, rows, _ = sets[i]
                    if name == "gate_up":
                        return gemv_cuda_grouped.launch_grouped(x, wc, g, offs, ys[i], x_rows=rows, cfg=c)
                    return gemv_cuda_grouped.launch_grouped(gu[i], wc, g, offs, ys[i], x_silu=True, cfg=c)

                try:
                    err = _rel(call(lambda: run(0), use_pdl), ref)
                    us = time_calls([lambda i=i, p=use_pdl: call(lambda: run(i), p)
                                     for i in range(len(sets))])
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} t{t} {vname} {c} FAILED {repr(exc)[:400]}", flush=True)
                    continue
                row = dict(kernel="mma16_grouped", which=name, variant=vname, n=n, k=k, tokens=t, rows=m,
                           cfg=c, us=us, floor_us=floor_us, rel_err=err, tb_s=moved / us / 1e6)
                out["rows"].append(row)
                print(f"{name:8s} {n}x{k} t{t:2d} {us:7.2f} us  floor {floor_us:5.2f}  "
                      f"{moved / us / 1e6:4.2f} TB/s  err {err:.1e}  {vname} {c}", flush=True)
        print(f"[{time.time() - t_start:.0f} s]", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
