"""Sweep the W4A16 decode kernels for 1-2 rows on the GPU: every configuration of the Gluon
tensor-core GEMV (standard and gemv32 code layouts) and the first Triton decode candidates,
checked against the reference, timed like fp4rl.benchmarks.gpu_kernels (CUDA-graph replay,
operands rotated through >= 4x L2), next to cuBLAS BF16.

  python3 bench/gemv_sweep.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl.benchmarks.gpu_gemm import _nvfp4_weight  # noqa: E402
from fp4rl.benchmarks.gpu_kernels import _rel, copies_for, time_calls  # noqa: E402
from fp4rl.kernels import gemm, gemm_tune, gemv  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.nvfp4.format import NVFP4Tensor  # noqa: E402


def _direct(kind, layout):
    """A call of a Gluon GEMV launcher on (x, weight parts); layout 1 takes swizzled data."""
    fn = {"mma": gemv.launch_mma}[kind]

    def run(x, wd, ws, wg, c):
        y = torch.empty(x.shape[0], wd.shape[0], dtype=torch.bfloat16, device=x.device)
        return fn(x, wd, ws, wg, y, c, gemm._WORKSPACE, layout=layout)

    return run


VARIANTS = [("mma", 0), ("mma", 1)]


def _cfgs(kind, n, kh, sms, m=1):
    return gemv.configs_mma(n, kh, sms, m)


def check_variants(a_check=2):
    """Every new variant x config on odd shapes (masked edges), per-tensor and per-row scales, 1-2 rows,
    plus the swizzle round trip."""
    bad = []
    for n, k, kw in ((100, 224, {}), (37, 1056, {"scale_scope": "row"}), (256, 4096, {})):
        w = reference.quantize((torch.randn(n, k, device="cuda") * 0.05), **kw)
        sw = gemv.swizzle(w.data)
        if not torch.equal(gemv.unswizzle(sw), w.data):
            bad.append(("swizzle round trip", n, k))
        g = w.global_scale.float().reshape(-1).contiguous()
        ws = w.block_scale.view(torch.uint8)
        for m in (1, 2, 4, 5, 8, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.double() @ reference.dequantize(w).double().T
            for kind, layout in VARIANTS:
                run = _direct(kind, layout)
                for c in _cfgs(kind, n, k // 2, 132, m)[:a_check]:
                    try:
                        e = _rel(run(x, sw if layout else w.data, ws, g, c), ref)
                    except Exception as exc:  # noqa: BLE001
                        bad.append((kind, layout, n, k, m, c, repr(exc)[:300]))
                        break
                    if not e < 4e-3:
                        bad.append((kind, layout, n, k, m, c, e))
    print("variant check:", bad if bad else "ok", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x6144")
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-cfg", type=int, default=100, help="Gluon configurations per shape and rows")
    ap.add_argument("--check-cfg", type=int, default=2, help="configurations checked on the odd shapes")
    ap.add_argument("--max-triton", type=int, default=4, help="Triton candidates per shape and rows")
    ap.add_argument("--layout2", action="store_true", help="also time layout 2 (no unpack: timing only)")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from fp4rl.benchmarks.gpu_kernels import _env, copy_bandwidth

    out = {"env": _env(), "copy": copy_bandwidth()}
    out.update(variant_bad=[str(b) for b in check_variants(a.check_cfg)], rows=[])
    print("copy", out["copy"], flush=True)
    for shp in a.shapes.split(","):
        n, k = map(int, shp.split("x"))
        w_bf16, wq = _nvfp4_weight(n, k)
        nf = copies_for(wq.data.nbytes + wq.block_scale.nbytes)
        wqs = [wq] + [NVFP4Tensor(data=wq.data.clone(), block_scale=wq.block_scale.clone(),
                                  global_scale=wq.global_scale.clone(), shape=wq.shape, dtype=wq.dtype)
                      for _ in range(nf - 1)]
        wbs = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(w_bf16.nbytes) - 1)]
        w_ref = reference.dequantize(wq).double()
        swz = [gemv.swizzle(q.data) for q in wqs]
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w_ref.T
            bf = time_calls([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbs])
            cands = gemm_tune.candidate_configs(m, n, k // 2, x.device)[:a.max_triton]
            for kind, layout in VARIANTS + ([("mma", 2)] if a.layout2 else []):  # 2: no unpack (timing only)
                run = _direct(kind, layout)
                for c in _cfgs(kind, n, k // 2, sms, m)[:(a.max_cfg if layout < 2 else 1)]:
                    parts = [(q.data if not layout else sw, q.block_scale.view(torch.uint8),
                              q.global_scale.float().reshape(-1)) for q, sw in zip(wqs, swz)]
                    try:
                        err = _rel(run(x, *parts[0], c), ref)
                        us = time_calls([lambda p=p, c=c, run=run, x=x: run(x, *p, c) for p in parts])
                    except Exception as exc:  # noqa: BLE001
                        print(n, k, m, kind, layout, c, "FAILED", repr(exc)[:300], flush=True)
                        continue
                    row = dict(n=n, k=k, rows=m, cfg=dict(KIND=kind, LAYOUT=layout, **c), us=us, bf16_us=bf,
                               speedup=bf / us, rel_err=err)
                    out["rows"].append(row)
                    print(f"{n}x{k} m{m} {us:7.1f} us  bf16 {bf:6.1f}  x{bf / us:4.2f}  err {err:.1e}  "
                          f"{kind} L{layout} {c}", flush=True)
            for c in cands:
                try:
                    err = _rel(gemm.gemm(x, wq, config=c), ref)
                    us = time_calls([lambda w=w, x=x, c=c: gemm.gemm(x, w, config=c) for w in wqs])
                except Exception as exc:  # noqa: BLE001
                    print(n, k, m, c, "FAILED", repr(exc)[:300], flush=True)
                    continue
                row = dict(n=n, k=k, rows=m, cfg=c, us=us, bf16_us=bf, speedup=bf / us, rel_err=err)
                out["rows"].append(row)
                print(f"{n}x{k} m{m} {us:7.1f} us  bf16 {bf:6.1f}  x{bf / us:4.2f}  err {err:.1e}  {c}",
                      flush=True)
            del x
        del wqs, wbs, swz
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
