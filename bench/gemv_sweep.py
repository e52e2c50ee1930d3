"""Sweep the W4A16 decode kernels for 1-2 rows on the GPU: every Gluon GEMV configuration and the
Triton decode candidates, checked against the reference, timed like fp4rl.benchmarks.gpu_kernels
(CUDA-graph replay, operands rotated through >= 4x L2), next to cuBLAS BF16.

  python3 bench/gemv_sweep.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl.benchmarks.gpu_kernels import _nvfp4_weight, _rel, copies_for, time_calls  # noqa: E402
from fp4rl.kernels import gemm, gemv  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.nvfp4.format import NVFP4Tensor  # noqa: E402


def check_odd():
    """Masked edges (N, K not multiples of the tile), per-row global scales, 1 and 2 rows."""
    bad = []
    for n, k, kw in ((100, 224, {}), (37, 1056, {"scale_scope": "row"}), (256, 4096, {})):
        w = reference.quantize((torch.randn(n, k, device="cuda") * 0.05), **kw)
        for m in (1, 2):
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.double() @ reference.dequantize(w).double().T
            for c in gemv.configs(n, k // 2, 132):
                y = gemm.gemm(x, w, config=dict(KIND="gemv", **c))
                e = _rel(y, ref)
                if not e < 4e-3:
                    bad.append((n, k, m, c, e))
    print("odd-shape check:", bad if bad else "ok", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x6144")
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"odd_bad": [str(b) for b in check_odd()], "rows": []}
    for shp in a.shapes.split(","):
        n, k = map(int, shp.split("x"))
        w_bf16, wq = _nvfp4_weight(n, k)
        nf = copies_for(wq.data.nbytes + wq.block_scale.nbytes)
        wqs = [wq] + [NVFP4Tensor(data=wq.data.clone(), block_scale=wq.block_scale.clone(),
                                  global_scale=wq.global_scale.clone(), shape=wq.shape, dtype=wq.dtype)
                      for _ in range(nf - 1)]
        wbs = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(w_bf16.nbytes) - 1)]
        w_ref = reference.dequantize(wq).double()
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w_ref.T
            bf = time_calls([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbs])
            cands = [dict(KIND="gemv", **c) for c in gemv.configs(n, k // 2, sms)]
            cands += gemm.candidate_configs(m, n, k // 2, x.device)[:6]
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
        del wqs, wbs
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
