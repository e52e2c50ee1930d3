"""The grid caps of the per-tensor quantize's two launches (forty-sixth session, after the strip kernel gained
6% from a larger cap): the amax pass alone (fp4rl.kernels.quantize.cuda.amax_parts) at AMAX_CTAS_PER_SM caps,
and 1x16 quantize_2d (rule 6 and 4/6 mse, the tensor's amax and an imposed g) at FLAT_CTAS_PER_SM /
FLAT46_CTAS_PER_SM caps, bf16;
do_bench medians over --repeats interleaved rounds, each case's bytes checked against the default cap's.

    python3 bench/quant_grid.py [--rows 32768] [--cols 4096] [--repeats 3] [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import fp4rl.kernels.quantize as q  # noqa: E402
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402

CAPS = (4, 8, 16, 32, 64, 256)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=gen, dtype=torch.bfloat16)
    amax = float(x.float().abs().amax())
    nbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    g6, g46 = (torch.tensor(amax / m, device="cuda") for m in (2688, 1536))
    cases = {"amax pass": None, "1x16 rule 6": dict(), "1x16 rule 6, imposed g": dict(global_scale=g6),
             "1x16 4/6 mse": dict(scale_rule="4/6"),
             "1x16 4/6 mse, imposed g": dict(scale_rule="4/6", global_scale=g46)}
    default = (qc.AMAX_CTAS_PER_SM, qc.FLAT_CTAS_PER_SM, qc.FLAT46_CTAS_PER_SM)
    times, same, ref = {}, {}, {}
    for _ in range(args.repeats):
        for name, kw in cases.items():
            for cap in CAPS:
                if kw is None:
                    qc.AMAX_CTAS_PER_SM = cap
                    fn = lambda: qc.amax_parts(x)  # noqa: E731
                else:
                    qc.FLAT_CTAS_PER_SM = qc.FLAT46_CTAS_PER_SM = cap
                    fn = lambda kw=kw: q.quantize_2d(x, check_finite=False, **kw)  # noqa: E731
                try:
                    out = fn()
                    ms = triton.testing.do_bench(fn, warmup=5, rep=60)
                finally:
                    qc.AMAX_CTAS_PER_SM, qc.FLAT_CTAS_PER_SM, qc.FLAT46_CTAS_PER_SM = default
                assert qc.STATE["error"] is None, qc.STATE["error"]
                outs = [out] if kw is None else [t.reshape(-1).view(torch.uint8) for t in out]
                ref.setdefault(name, outs)
                same[(name, cap)] = all(torch.equal(a, b) for a, b in zip(outs, ref[name]))
                times.setdefault((name, cap), []).append(ms)
    rows = []
    for (name, cap), ts in times.items():
        ms = statistics.median(ts)
        read = x.numel() * 2 if cases[name] is None else nbytes
        row = dict(case=name, ctas_per_sm=cap, ms=ms, ms_repeats=ts, TBps=read / ms / 1e9,
                   same_bytes=same[(name, cap)])
        rows.append(row)
        shown = {k: round(v, 4) if isinstance(v, float) else [round(t, 4) for t in v] if isinstance(v, list)
                 else v for k, v in row.items()}
        print(json.dumps(shown), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
