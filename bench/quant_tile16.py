"""The 16x16 quantize on its new kernel against the tiles kernel it replaces. The tiles kernel took 42.9 ms
for 16x16 4/6 against 357 us for 16x16 rule 6 on 32768x4096 bfloat16 (third session; 45.0 ms against 261 us in
the seventh; bench/RESULTS.md): compiled for sm_90 (Triton 3.6) its 4/6 build has 1050 FADDs and 263
shared-memory loads, the [R, NB, 16] reshapes of the 16-row error tree making every thread redo others' sums.
The new kernel (blocks.py _quantize_tile16_kernel: one block per thread, the tiles' max and error tree
over [N] per-block values) has 108 FADDs, like the 1x16 4/6 block kernel.

Times fp4rl.kernels.quantize.quantize_2d on the GPU (triton.testing.do_bench, median ms, TB/s counting x read
once and the codes and scales written): 16x16 rule 6 and 4/6 (mse) on both kernels (BLOCKS off: the tiles
kernel), the new one at other program shapes (TILE16), with an imposed global scale, and 1x16 4/6 (the default
path) for comparison. Every 16x16 row's bytes are compared with the tiles kernel's for the same rule.

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
    rows, before = [], {}

    def run(name, blocks=True, nbc=None, nblk=None, **kw):
        q.BLOCKS["on"], q.TILE16["nbc"], q.TILE16["blocks"] = blocks, nbc, nblk
        try:
            out = q.quantize_2d(x, **kw)
            ms = triton.testing.do_bench(lambda: q.quantize_2d(x, check_finite=False, **kw), warmup=5, rep=60)
        finally:
            q.BLOCKS["on"], q.TILE16["nbc"], q.TILE16["blocks"] = True, None, None
        row = {"case": name, "ms": ms, "TB/s": nbytes / ms / 1e9}
        # the tiles kernel's bytes for the same rule and scale source (an imposed g is another source)
        key = (kw.get("scale_rule", "6"), kw.get("tile16", False), "global_scale" in kw)
        if not blocks:
            before[key] = out
        elif key in before:
            # reshape(-1): the global scale is a 0-dim float32, which view(uint8) refuses
            row["same_bytes_as_tiles_kernel"] = all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(out, before[key]))
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        return out

    run("16x16 rule 6, tiles kernel (before)", blocks=False, tile16=True)
    run("16x16 rule 6, tile16 kernel", tile16=True)
    run("16x16 4/6 mse, tiles kernel (before)", blocks=False, tile16=True, scale_rule="4/6")
    out = run("16x16 4/6 mse, tile16 kernel", tile16=True, scale_rule="4/6")
    for nbc, nblk in ((8, 256), (16, 128), (4, 128), (16, 256)):
        run(f"16x16 4/6 mse, tile16 kernel, {nbc} tiles x {nblk} blocks", nbc=nbc, nblk=nblk, tile16=True,
            scale_rule="4/6")
    run("16x16 4/6 mse, tile16 kernel, imposed global scale", tile16=True, scale_rule="4/6",
        global_scale=out[2].reshape(()).clone())
    run("1x16 4/6 mse (default path)", scale_rule="4/6")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [args.rows, args.cols], "rows": rows},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
