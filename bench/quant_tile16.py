"""The 16x16 quantize's tile reductions: warp shuffles against reshapes. The one-block-per-thread 16x16
kernel (blocks.py _quantize_tile16_kernel, forty-second session) took 0.561 ms for 16x16 4/6 on 32768x4096
bfloat16 on an H100 (forty-third session), 2.2x the 1x16 4/6 kernel, with 57 barriers in its sm_90 build (the
tiles' max and 16-row error tree by reshapes, which Triton converts through shared memory). TMODE 3
(forty-fourth session) lays the blocks out tile-major, a tile's 16 rows in one warp's lanes, and reduces them
with shfl.sync.bfly: 12 barriers.

Times fp4rl.kernels.quantize.quantize_2d on the GPU (triton.testing.do_bench, median ms, TB/s counting x read
once and the codes and scales written) in each TILE16 mode (1: row-major, reshapes; 2: tile-major, reshapes;
3: tile-major, shuffles; auto: the dispatcher's choice), rules 6 and 4/6 (mse), with an imposed global scale,
and 1x16 4/6 (the default path) for comparison. Every 16x16 row's bytes are compared with mode 1's for the
same rule and scale source.

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
    rows, base = [], {}

    def run(name, mode=None, nbc=None, nblk=None, **kw):
        q.TILE16["mode"], q.TILE16["nbc"], q.TILE16["blocks"] = mode, nbc, nblk
        q.COMPILED.clear()
        try:
            out = q.quantize_2d(x, **kw)
            chosen = sorted(n.rsplit(" ", 1)[-1] for n in q.COMPILED if n.startswith("quantize tile16"))
            ms = triton.testing.do_bench(lambda: q.quantize_2d(x, check_finite=False, **kw), warmup=5, rep=60)
        finally:
            q.TILE16["mode"], q.TILE16["nbc"], q.TILE16["blocks"] = None, None, None
        row = {"case": name, "ms": ms, "TB/s": nbytes / ms / 1e9}
        if chosen:
            row["ran"] = chosen
        key = (kw.get("scale_rule", "6"), kw.get("tile16", False), "global_scale" in kw)
        if mode == 1:
            base[key] = out
        elif key in base:
            # reshape(-1): the global scale is a 0-dim float32, which view(uint8) refuses
            row["same_bytes_as_mode1"] = all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(out, base[key]))
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        return out

    for rule in ("6", "4/6"):
        out = None
        for mode in (1, 2, 3, None):
            out = run(f"16x16 rule {rule}, mode {mode or 'auto'}", mode=mode, tile16=True, scale_rule=rule)
        if rule == "4/6":
            g46 = out[2].reshape(()).clone()
    for nbc, nblk in ((8, 256), (16, 128), (4, 128)):
        run(f"16x16 4/6, mode 3, {nbc} tiles x {nblk} blocks", mode=3, nbc=nbc, nblk=nblk, tile16=True,
            scale_rule="4/6")
    run("16x16 4/6, mode 1, imposed global scale", mode=1, tile16=True, scale_rule="4/6", global_scale=g46)
    run("16x16 4/6, mode 3, imposed global scale", mode=3, tile16=True, scale_rule="4/6", global_scale=g46)
    run("1x16 4/6 (default path)", scale_rule="4/6")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
