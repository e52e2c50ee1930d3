"""Device check + timing of the NVFP4 quantize kernels (fp4rl/kernels/quantize.py), session 3.

1. _div1536 (FMA-corrected x * fp32(1/1536)) against IEEE division on every float32 bit pattern.
2. 32768 x 4096 bfloat16: every mode with the one-block-per-thread kernels and with the older tiles,
   bytes vs the reference on the first 4096 rows, effective TB/s = (bytes read once + written) / time.
"""

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from fp4rl.benchmarks.gpu_kernels import _env, copy_bandwidth, time_calls  # noqa: E402
from fp4rl.kernels import quantize as Q  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402


@triton.jit
def _div_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, Q._div1536(tl.load(x_ptr + offs, mask=m)), mask=m)


def check_div(res):
    chunk = 1 << 28
    bad, tested, bad_safe, tested_safe = 0, 0, 0, 0
    d = torch.tensor(1536.0, device="cuda")
    for c in range(16):
        bits = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.int64, device="cuda")
        bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
        x = bits.view(torch.float32)
        y = torch.empty_like(x)
        _div_kernel[(chunk // 4096,)](x, y, chunk, BLOCK=4096, enable_fp_fusion=False)
        ref = torch.div(x, d)
        fin = torch.isfinite(x)
        diff = (y.view(torch.int32) != ref.view(torch.int32)) & fin
        bad += int(diff.sum())
        tested += int(fin.sum())
        ax = x.abs()
        safe = fin & (((ax >= 2.0**-80) & (ax < 2.0**112)) | (ax == 0))
        bad_safe += int((diff & safe).sum())
        tested_safe += int(safe.sum())
        if diff.any() and "first_bad" not in res:
            i = int(diff.nonzero()[0])
            res["first_bad"] = [float(x[i]), float(y[i]), float(ref[i])]
    res["div1536"] = {"tested": tested, "mismatches": bad, "tested_in_range": tested_safe,
                      "mismatches_in_range": bad_safe}
    print("div1536", res["div1536"], res.get("first_bad"))


def bench(res, bw):
    rows, k = 32768, 4096
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, k, device="cuda")
    xs = [x, x.roll(1, 0)]
    modes = [
        ("1x16 tensor 6", dict(), dict()),
        ("1x16 row 6", dict(per_row=True), dict(scale_scope="row")),
        ("1x16 row 4/6 mse", dict(per_row=True, scale_rule="4/6"), dict(scale_scope="row", scale_rule="4/6")),
        ("1x16 tensor 4/6 mae", dict(scale_rule="4/6", err="mae"), dict(scale_rule="4/6", err="mae")),
        ("1x16 tensor 4/6 mse", dict(scale_rule="4/6"), dict(scale_rule="4/6")),
        ("1x16 row 4/6 mae", dict(per_row=True, scale_rule="4/6", err="mae"),
         dict(scale_scope="row", scale_rule="4/6", err="mae")),
    ]
    moved = rows * k * 2 + rows * k // 2 + rows * k // 16
    for name, kw, ref_kw in modes:
        for impl in ("gluon", "blocks", "tiles"):
            if impl == "gluon" and "4/6" in name:
                continue  # rule 6 only
            Q.BLOCKS["on"] = impl != "tiles"
            Q.GLUON_BLOCKS["on"] = impl == "gluon"
            try:
                d, s, g = Q.quantize_2d(x[:4096], check_finite=False, **kw)
                q = reference.quantize(x[:4096], **ref_kw)
                exact = bool(torch.equal(d, q.data) and torch.equal(g.reshape(-1), q.global_scale.reshape(-1))
                             and torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8)))
                calls = [lambda xi=xi, kw=kw: Q.quantize_2d(xi, check_finite=False, **kw) for xi in xs]
                us = time_calls(calls, min_calls=6)
                row = {"mode": name, "impl": impl, "gluon_on": Q.GLUON_BLOCKS["on"], "us": us,
                       "tb_s": moved / us / 1e6,
                       "floor_us": moved / bw * 1e6, "byte_exact": exact}
            except Exception as exc:  # noqa: BLE001
                row = {"mode": name, "impl": impl, "error": repr(exc)[:300]}
            print("bench", json.dumps(row))
            res.setdefault("bench", []).append(row)
    Q.BLOCKS["on"] = True
    Q.GLUON_BLOCKS["on"] = True
    # the amax pass alone (tensor scale), for the notes
    res["amax_pass_us"] = time_calls([lambda xi=xi: Q.amax_partials(xi) for xi in xs], min_calls=6)
    print("amax pass us", res["amax_pass_us"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant9.json")
    ap.add_argument("--warm-ms", type=float, default=0.0, help="replay each graph this long before timing")
    a = ap.parse_args()
    res = {"env": _env()}
    import fp4rl.benchmarks.gpu_kernels as gk

    gk.WARM_MS = a.warm_ms
    t0 = time.time()
    check_div(res)
    bw = copy_bandwidth()
    res["copy"] = bw
    print(f"copy {bw['tb_s']:.2f} TB/s [{time.time() - t0:.0f}s]")
    bench(res, bw["tb_s"] * 1e12)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    for r in res["bench"]:
        print(f"{r['mode']:22s} {r['impl']:6s} "
              + (f"{r['us']:7.1f} us {r['tb_s']:.2f} TB/s exact={r['byte_exact']}" if "us" in r
                 else r["error"][:120]))
    print(f"[total {time.time() - t0:.0f}s]")


if __name__ == "__main__":
    main()
