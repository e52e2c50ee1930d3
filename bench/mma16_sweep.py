"""Sweep the CUDA mma16 W4A16 kernel (fp4rl/kernels/gemv_mma16.cu) on the GPU against cuBLAS BF16 and the
Gluon GEMV (gemv32 copy) measured in the same run; timing as fp4rl.benchmarks.gpu_kernels (CUDA-graph
replay, operands rotated through >= 4x L2, median of 7). Each configuration is checked against the float64
reference product before it is timed.

  python3 bench/mma16_sweep.py [--shapes 4096x14336,...] [--rows 1,8,16] [--variants auto,d2,d6,nt1,...]
                               [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl.benchmarks.gpu_gemm import _nvfp4_weight  # noqa: E402
from fp4rl.benchmarks.gpu_kernels import _env, _rel, copies_for, copy_bandwidth, time_calls  # noqa: E402
from fp4rl.kernels import gemm, gemv, gemv_cuda, pdl  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402


def variant(name: str, base: dict) -> dict:
    """auto = gemv_cuda.choose(); wide = gemv_cuda.choose_wide() (wgmma, any rows; "wide+s4" etc.);
    dN = DEPTH N; ntN = NT N; sN = SPLIT N; trN = TRIGGER N; xsN = XSTREAM N; wbN = WB N; mgN = MG N;
    swN = SWZ N; gseN = GSE N (the global scale read before the PDL wait: default in KW builds); ashN = ASH N
    (wgmma: the weights' A staged in shared memory, 8 multiplies per step; DEPTH >= 3); xpN = XPRE N
    (wgmma: x's cp.async addresses per thread computed once: 1 per chunk, default at MG <= 4; 2 one running
    pointer per thread, default above);
    wsN = WS N (wgmma: the warp-specialized build, a producer warp with the bulk / tensor copy engine; its
    ring depth is dN's); minbN =
    WS_MINB N (WS: registers left for N CTAs per SM); mbN = MINB N (the plain builds: the same bound);
    wpN = WARPS N (4: 64 NT weight rows a CTA, wgmma: one warpgroup; 8: the 8-warp build where the rule
    takes 4; WS / ASH / NT 2 variants drop the rule's WARPS 4 unless wp4 is named);
    wgN = WGMMA N (with xs1) (combined with "+");
    kwN = KW N (in-CTA split-K: SPLIT 1); kw / cl: the chosen split moved inside the CTA (KW) / into a
    cluster (SPLIT);
    tN = TIMING N (timing-only variants, see the .cu); s2x / sh: twice / half the chosen split; pdl: the
    launches carry the programmatic-dependent-launch attribute (fp4rl/kernels/pdl.py), so that in the timed
    chain each GEMM prefetches its first weight steps while the one before it finishes."""
    c = dict(base)
    for part in name.split("+"):
        if part in ("auto", "pdl"):
            continue
        if part in ("s2x", "sh"):
            key = "KW" if c.get("KW", 1) > 1 else "SPLIT"
            c[key] = min(8, c[key] * 2) if part == "s2x" else max(1, c[key] // 2)
            continue
        if part in ("kw", "cl"):
            split = gemv_cuda.ksplit(c)
            c.pop("KW", None)
            c.update(SPLIT=1, KW=split) if part == "kw" else c.update(SPLIT=split)
            continue
        if part.startswith("kw") and part[2:].isdigit():
            c.update(SPLIT=1, KW=int(part[2:]))
            continue
        keys = {"d": "DEPTH", "nt": "NT", "s": "SPLIT", "t": "TIMING", "tr": "TRIGGER", "xs": "XSTREAM",
                "wg": "WGMMA", "mg": "MG", "wb": "WB", "sw": "SWZ", "gse": "GSE", "xp": "XPRE", "ash": "ASH",
                "ws": "WS", "minb": "WS_MINB", "mb": "MINB", "wp": "WARPS"}
        prefix = part.rstrip("0123456789")
        if prefix not in keys or prefix == part:
            raise SystemExit(f"variant {name!r}: unknown part {part!r} (see mma16_sweep.variant)")
        c[keys[prefix]] = int(part[len(prefix):])
    if (c.get("WS") or c.get("ASH") or c.get("NT", 1) != 1) and "wp4" not in name.split("+"):
        c.pop("WARPS", None)  # (WS, ASH and NT 2 variants of the rule: its 8-warp build unless wp4 is named)
    return c


def configs(names, base: dict | None, k: int, wide: dict | None = None):
    """(name, configuration, PDL) for each variant name, each distinct configuration once, only splits that
    K's 128-k steps can take; `wide...` names start from `wide` (skipped without it), the others from `base`
    (skipped when None: the mma.sync kernel does not take these rows)."""
    seen = []
    for name in names:
        if name.startswith("wide"):
            if wide is None:
                continue
            c = variant(name[len("wide+"):] if "+" in name else "auto", wide)
        elif base is None:
            continue
        else:
            c = variant(name, base)
        use_pdl = "pdl" in name.split("+")
        if c.get("KW", 1) == 1:
            c.pop("KW", None)
        if (c, use_pdl) in seen or (k // 128) < gemv_cuda.ksplit(c):
            continue
        seen.append((c, use_pdl))
        yield name, c, use_pdl


def start():
    """A sweep's (SM count, results dict with env and copy bandwidth, copy TB/s, start time); the `pdl`
    variants put the attribute on every launch of the kernel (not only the kinds pdl.DEFAULT_OFF leaves)."""
    pdl.set_kinds_off(())
    out = {"env": _env(), "copy": copy_bandwidth(), "rows": []}
    print("copy", out["copy"], flush=True)
    return torch.cuda.get_device_properties(0).multi_processor_count, out, out["copy"]["tb_s"], time.time()


def call(x, w, g, y, c, use_pdl: bool):
    with pdl.step() if use_pdl else contextlib.nullcontext():
        return gemv_cuda.launch(x, w, g, y, cfg=c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x6144,6144x4096,24576x4096,4096x12288")
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--variants", default="auto,nt2,d2,d4,s2x,sh,t2")
    ap.add_argument("--gluon", action="store_true", help="also time the Gluon GEMV (gemv32) at 1-4 rows")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sms, out, bw, t_start = start()
    for shp in a.shapes.split(","):
        n, k = map(int, shp.split("x"))
        w_bf16, wq = _nvfp4_weight(n, k)
        w_ref = reference.dequantize(wq).double()
        g = wq.global_scale.float().reshape(-1)
        wc0 = gemv_cuda.relayout(wq.data, wq.block_scale)
        nf = copies_for(wc0.wt.nbytes + wc0.st.nbytes)
        wcs = [wc0] + [gemv_cuda.Mma16Weight(wt=wc0.wt.clone(), st=wc0.st.clone(), n=n, k=k)
                       for _ in range(nf - 1)]
        wbs = [w_bf16] + [w_bf16.clone() for _ in range(copies_for(w_bf16.nbytes) - 1)]
        floor_bytes = wq.data.nbytes + wq.block_scale.nbytes
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ w_ref.T
            bf = time_calls([lambda w=w, x=x: torch.matmul(x, w.t()) for w in wbs])
            floor_us = (floor_bytes + x.nbytes + 2 * m * n) / bw / 1e6
            base = gemv_cuda.choose(n, k, m, sms) if gemv_cuda.fits(n, k, m, sms) else None
            wide = gemv_cuda.choose_wide(n, k, m, sms)
            for name, c, use_pdl in configs(a.variants.split(","), base, k, wide):
                y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                try:
                    err = _rel(call(x, wc0, g, y, c, use_pdl), ref)
                    us = time_calls([lambda w=w, c=c, x=x, y=y, g=g, p=use_pdl: call(x, w, g, y, c, p)
                                     for w in wcs])
                except Exception as exc:  # noqa: BLE001
                    print(f"{n}x{k} m{m} {name} {c} FAILED {repr(exc)[:400]}", flush=True)
                    continue
                row = dict(kernel="mma16", variant=name, n=n, k=k, rows=m, cfg=c, us=us, bf16_us=bf,
                           speedup=bf / us, floor_us=floor_us, rel_err=err)
                out["rows"].append(row)
                print(f"{n}x{k} m{m:3d} {us:7.1f} us  bf16 {bf:6.1f}  x{bf / us:4.2f}  "
                      f"floor {floor_us:5.1f}  err {err:.1e}  {name} {c}", flush=True)
            if a.gluon and m <= gemv.MAX_ROWS and gemv.available():
                from types import SimpleNamespace

                cg = dict(KIND="gemv_mma", LAYOUT=1, **gemv.configs_mma(n, k // 2, sms, m)[0])
                wsws = [SimpleNamespace(data=wq.data, block_scale=wq.block_scale.clone(),
                                        global_scale=wq.global_scale, gemv32=gemv.swizzle(wq.data))
                        for _ in range(copies_for(wq.data.nbytes + wq.block_scale.nbytes))]
                try:
                    err = _rel(gemm.gemm(x, wsws[0], config=cg), ref)
                    us = time_calls([lambda x=x, w=w, c=cg: gemm.gemm(x, w, config=c) for w in wsws])
                    print(f"{n}x{k} m{m:3d} {us:7.1f} us  bf16 {bf:6.1f}  x{bf / us:4.2f}  err {err:.1e}  "
                          f"gluon gemv32 {cg}", flush=True)
                    out["rows"].append(dict(kernel="gluon_gemv32", n=n, k=k, rows=m, us=us, bf16_us=bf,
                                            speedup=bf / us, rel_err=err, cfg=cg))
                except Exception as exc:  # noqa: BLE001
                    print("gluon FAILED", repr(exc)[:300], flush=True)
                del wsws
            del x
        del wcs, wbs
        torch.cuda.empty_cache()
        print(f"[{time.time() - t_start:.0f} s]", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
