"""Device benchmark of the CUDA quantize kernels (fp4rl/kernels/quantize/quant.cu), seventh session; the
"exact", "fast1", "fast2" and "fast3" variants (twenty-sixth, twenty-seventh sessions) run rule 4/6 with
FAST46 0, 1, 2, 3 at every size.

For each shape and mode, in one run: the CUDA kernels (per-row modes also with 1, 2 and 4 blocks per thread in
the row kernel; "cuda" is the default choice) and the Triton kernels (CUDA off); bytes checked against the
reference on the first --check-rows rows (4096; 0: all) for each; effective TB/s = (bytes read once +
written) / time, as in RESULTS.
The per-tensor modes also report the amax pass alone.
Timing: fp4rl.benchmarks.gpu_kernels.time_calls (CUDA-graph replay, operands rotated through >= 4x L2,
median of 7). Usage (device): python3 bench/quant_cuda.py --out $OUT/quant_cuda.json
"""

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, ".")
from fp4rl.benchmarks.gpu_kernels import _env, copies_for, copy_bandwidth, time_calls  # noqa: E402
from fp4rl.kernels.quantize import amax_partials, quantize_2d  # noqa: E402
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

ROWS_BPT0 = dict(qc.ROWS_BPT)
MODES = [
    ("tensor 6", dict(), dict()),
    ("row 6", dict(per_row=True), dict(scale_scope="row")),
    ("row 4/6 mse", dict(per_row=True, scale_rule="4/6"), dict(scale_scope="row", scale_rule="4/6")),
    ("row 4/6 mae", dict(per_row=True, scale_rule="4/6", err="mae"),
     dict(scale_scope="row", scale_rule="4/6", err="mae")),
    ("tensor 4/6 mse", dict(scale_rule="4/6"), dict(scale_rule="4/6")),
    ("tensor 4/6 mae", dict(scale_rule="4/6", err="mae"), dict(scale_rule="4/6", err="mae")),
    ("row 6 imposed g", dict(per_row=True, global_scale="g"), dict(scale_scope="row", global_scale="g")),
]
VARIANTS = [("cuda", True, None), ("cuda_bpt1", True, 1), ("cuda_bpt2", True, 2), ("cuda_bpt4", True, 4),
            ("triton", False, None)]
# rule 4/6 with every block's exact errors (quant.cu FAST46 0, the kernels before the twenty-sixth session),
# with decide46 and the winner's codes in a pass of their own (FAST46 1) and with both candidates' codes in
# its pass (2), at every size; "cuda": the launcher's own choice (FAST46 2 from FAST46_MIN_BLOCKS blocks)
VARIANTS += [(p + v[0][4:], True, v[2]) for p in ("exact", "fast1", "fast2", "fast3") for v in VARIANTS
             if v[0].startswith("cuda")]
# "reload": FAST46 3 with the row kernel reading each block twice (cuda.RELOAD46; twenty-seventh session)
FAST46_OF = {"reload": 3, "fast3": 3, "fast2": 2, "fast1": 1, "exact": 0}
RELOAD46_0 = qc.RELOAD46
FAST46_0, MIN_BLOCKS_0 = qc.FAST46, qc.FAST46_MIN_BLOCKS
# "prev": the launcher's choices with quant.cu from --prev-source (an earlier commit's, timed in the same run)
# any "cuda", "exact", "fast<n>" or "reload" variant may end in _m<k>: the kernel compiled with MINB k (CTAs
# of its size per SM that the registers must allow) instead of the launcher's table
ROWS_CONFIG, FLAT_CONFIG = qc.rows_config, qc.flat_config
SOURCE_0 = qc._SOURCE


def variant(name: str):
    """(name, CUDA on, blocks per thread or None, MINB or None) of a variant name."""
    m = re.fullmatch(r"(cuda|prev|exact|fast1|fast2|fast3|reload)(?:_bpt(\d+))?(?:_m(\d+))?", name)
    if m is None:
        hit = [v for v in VARIANTS if v[0] == name]
        if not hit:
            raise SystemExit(f"unknown variant {name!r}")
        return (*hit[0], None)
    return name, True, int(m.group(2)) if m.group(2) else None, int(m.group(3)) if m.group(3) else None


def force_minb(minb):
    """qc's launch configurations with MINB replaced (None: the launcher's own)."""
    def swap(key):
        return key if minb is None else tuple(sorted({**dict(key), "MINB": minb}.items()))
    qc.rows_config = lambda *a: (lambda t: (t[0], t[1], swap(t[2])))(ROWS_CONFIG(*a))
    qc.flat_config = lambda *a, **k: swap(FLAT_CONFIG(*a, **k))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32768x4096,8192x14336,4096x4096,32x4096")
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES))
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prev-source", default=None,
                    help="a quant.cu to time as the 'prev' variants (the launcher's choices, that source)")
    ap.add_argument("--check-rows", type=int, default=4096, help="rows checked against the reference, 0: all")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth()
    print(f"copy {bw['tb_s']:.2f} TB/s", flush=True)
    out = {"env": _env(), "copy": bw, "rows": []}
    modes = [m for m in MODES if m[0] in args.modes.split(",")]
    variants = [variant(v) for v in args.variants.split(",")]
    if any(v[0].startswith("prev") for v in variants) and not args.prev_source:
        raise SystemExit("the 'prev' variants need --prev-source (an earlier quant.cu)")
    heads = " | ".join(f"{v[0]} us (TB/s)" for v in variants)
    print(f"| shape | mode | {heads} | floor us | bytes = ref |")
    print("|---" * (len(variants) + 4) + "|")
    for shape in args.shapes.split(","):
        r, k = (int(v) for v in shape.split("x"))
        x = (torch.randn(r, k, device="cuda") * torch.logspace(-2, 2, k, device="cuda")).to(dtype)
        xs = [x] + [x.roll(i, 0) for i in range(1, copies_for(x.nbytes))]
        moved = x.numel() * x.element_size() + r * k // 2 + r * k // 16
        gsc = x.float().abs().amax(dim=1) / 2688.0
        for name, kw, ref_kw in modes:
            kw = {a: (gsc if b == "g" else b) for a, b in kw.items()}
            nc = args.check_rows or r
            ref_kw = {a: (gsc[:nc, None] if b == "g" else b) for a, b in ref_kw.items()}
            q = reference.quantize(x[:nc], **ref_kw)
            row = {"shape": shape, "mode": name, "floor_us": moved / bw["tb_s"] / 1e6, "dtype": args.dtype}
            exact = []
            for vname, on, bpt, minb in variants:
                if bpt is not None and not name.startswith("row"):
                    continue
                prefix = vname.split("_")[0]
                if prefix in FAST46_OF and "4/6" not in name:
                    continue
                qc.STATE["on"] = on
                if (qc._SOURCE == SOURCE_0) == (prefix == "prev"):  # swap sources (and built kernels)
                    qc._SOURCE = Path(args.prev_source) if prefix == "prev" else SOURCE_0
                    qc._KERNELS.clear()
                qc.FAST46 = FAST46_OF.get(prefix, FAST46_0)
                qc.RELOAD46 = prefix == "reload" or (RELOAD46_0 and prefix in ("cuda", "prev"))
                qc.FAST46_MIN_BLOCKS = 0 if prefix in FAST46_OF else MIN_BLOCKS_0
                force_minb(minb)
                qc.ROWS_BPT = {"6": bpt, "4/6": bpt}
                kwc = {a: (b[:nc] if a == "global_scale" else b) for a, b in kw.items()}
                d, s, g = quantize_2d(x[:nc], check_finite=False, **kwc)
                ok = bool(torch.equal(d, q.data) and torch.equal(g.reshape(-1), q.global_scale.reshape(-1))
                          and torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8)))
                us = time_calls([lambda xi=xi, kw=kw: quantize_2d(xi, check_finite=False, **kw) for xi in xs],
                                min_calls=6)
                row[vname] = {"us": us, "tb_s": moved / us / 1e6, "byte_exact": ok}
                exact.append(ok)
            qc.STATE["on"] = True
            qc.FAST46, qc.FAST46_MIN_BLOCKS, qc.RELOAD46 = FAST46_0, MIN_BLOCKS_0, RELOAD46_0
            force_minb(None)
            qc.ROWS_BPT = dict(ROWS_BPT0)
            if name.startswith("tensor") and len(variants):
                row["amax_cuda_us"] = time_calls([lambda xi=xi: qc.amax_parts(xi) for xi in xs], min_calls=6)
                row["amax_triton_us"] = time_calls([lambda xi=xi: amax_partials(xi) for xi in xs],
                                                   min_calls=6)
            out["rows"].append(row)
            cells = " | ".join(f"{row[v[0]]['us']:.1f} ({row[v[0]]['tb_s']:.2f})" if v[0] in row else "-"
                               for v in variants)
            print(f"| {shape} | {name} | {cells} | {row['floor_us']:.1f} | {all(exact)} |", flush=True)
        del xs, x
        torch.cuda.empty_cache()
    amax_rows = [r for r in out["rows"] if "amax_cuda_us" in r]
    for r in amax_rows:
        print(f"amax pass {r['shape']} {r['mode']}: cuda {r['amax_cuda_us']:.1f} us, "
              f"triton {r['amax_triton_us']:.1f} us")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
