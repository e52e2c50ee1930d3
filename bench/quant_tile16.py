"""Why is the 16x16 4/6 quantize ~100x slower than 16x16 rule 6? (42.9 ms against 357 us on 32768x4096
bfloat16 in the third session, 45.0 ms against 261 us in the seventh; bench/RESULTS.md. Under ptxas for sm_90
the tiles kernel shows no spills with Triton 3.6 at any of the widths below, so it is not the registers.)

Times fp4rl.kernels.quantize.quantize_2d on the GPU (triton.testing.do_bench, median ms) for: 16x16 rule 6,
16x16 4/6 (mse) at several tile widths / warps of the tiles kernel (`_configs` overridden), 1x16 4/6 on the
same tiles kernel (BLOCKS off: what TILE16 adds), 16x16 4/6 with an imposed global scale (the error's
per-element IEEE division by 1536 replaced by a product with g). Every 16x16 4/6 variant's bytes are compared
with the first one's.

    python3 bench/quant_tile16.py [--rows 32768] [--cols 4096] [--out FILE.json]
"""

import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import fp4rl.kernels.quantize as q  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=g, dtype=torch.bfloat16)
    nbytes = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    original = q._configs
    rows = []

    def run(name, cfg=None, blocks=True, **kw):
        q._configs = (lambda k, tile16, rule46, row_pass: cfg) if cfg else original
        q.BLOCKS["on"] = blocks
        try:
            out = q.quantize_2d(x, **kw)
            ms = triton.testing.do_bench(lambda: q.quantize_2d(x, check_finite=False, **kw), warmup=5, rep=60)
        finally:
            q._configs, q.BLOCKS["on"] = original, True
        row = {"case": name, "ms": ms, "TB/s": nbytes / ms / 1e9}
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        return out

    run("16x16 rule 6 (default config)", tile16=True)
    ref = run("16x16 4/6 mse (default config)", tile16=True, scale_rule="4/6")
    for cfg in ((16, 64, 4), (16, 32, 2), (16, 16, 1), (32, 64, 8), (16, 128, 4)):
        out = run(f"16x16 4/6 mse BR={cfg[0]} BC={cfg[1]} warps={cfg[2]}", cfg, tile16=True, scale_rule="4/6")
        rows[-1]["same_bytes"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                     for a, b in zip(out, ref))
        print(json.dumps({"same_bytes": rows[-1]["same_bytes"]}), flush=True)
    run("1x16 4/6 mse on the tiles kernel", blocks=False, scale_rule="4/6")
    run("16x16 4/6 mse, imposed global scale", tile16=True, scale_rule="4/6",
        global_scale=ref[2].reshape(()).clone())
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
