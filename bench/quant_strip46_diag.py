"""Where the strip kernel's 16x16 4/6 time goes (quant.cu strip_decide46, forty-sixth session: mse 0.275 ms
against mae 0.257 on 32768x4096 bf16 on an H100, with the same static instruction counts): for mse and mae
with an imposed g (no amax pass), the share of warp iterations that take the exact errors (strip_exact;
counted by a build that adds one atomic per such warp, its bytes unchanged) and the kernel's time without that
path (a build that skips it: wrong bytes, time only), each against the kernel as it is. Launches the strip
kernel directly (fp4rl.kernels.quantize.cuda._launch), do_bench medians over --repeats interleaved rounds.

    python3 bench/quant_strip46_diag.py [--rows 32768] [--cols 4096] [--repeats 3] [--out FILE.json] [--once]
"""

import argparse
import json
import os
import statistics
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from fp4rl.kernels.quantize import cuda as qc  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402

CALL = "      strip_exact(p0, row_q, live, pick, tmax, sc, j, d, sc_out, b0, nb_row);\n"
COUNT = "      if ((threadIdx.x & 31) == 0) atomicAdd((int*)parts, 1);  // (SRC 3: parts unused)\n"
_source = qc.source


def _diag_source(defs: dict) -> str:
    """DIAG 1: count the warps that take the exact errors (into parts[0]); DIAG 2: skip that path."""
    src = _source(defs)
    assert src.count(CALL) == 1, "quant.cu's strip_exact call changed: update bench/quant_strip46_diag.py"
    diag = defs.get("DIAG", 0)
    return src.replace(CALL, COUNT + CALL) if diag == 1 else src.replace(CALL, "") if diag == 2 else src


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--once", action="store_true",
                    help="each build (mse, then mae) launched twice and nothing else: for ncu")
    args = ap.parse_args()
    qc.source = _diag_source
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.cols, device="cuda", generator=gen, dtype=torch.bfloat16)
    r, k = x.shape
    nb_row = k // 16
    g = torch.tensor([float(x.float().abs().amax()) / 1536.0], device="cuda")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    n_warps = (r // 16) * -(-nb_row // 16)
    grid = (max(1, min(-(-n_warps // 8), sms * 8)), 1, 1)
    data = torch.empty(r, k // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(r, nb_row, dtype=torch.uint8, device="cuda")
    g_out = torch.empty(1, device="cuda")
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")

    def launch(mae, diag):
        extra = {"DIAG": diag} if diag else {}
        key = qc.flat_config(torch.bfloat16, True, mae, False, 3, False, 3, **extra)
        qc._launch("nvfp4_quant_strip16", key, x, grid, (256, 1, 1),
                   [x, data, scale, g_out, g, counter, r // 16, nb_row])

    if args.once:
        for mae in (False, True):
            launch(mae, 0)
            launch(mae, 0)
        torch.cuda.synchronize()
        return 0
    rows, times = [], {}
    for mae in (False, True):
        counter.zero_()
        launch(mae, 1)
        torch.cuda.synchronize()
        exact = int(counter[0])
        q = reference.quantize(x, tile=(16, 16), scale_rule="4/6", err="mae" if mae else "mse",
                               global_scale=g[0])
        same = torch.equal(data, q.data) and torch.equal(scale, q.block_scale.view(torch.uint8))
        rows.append(dict(err="mae" if mae else "mse", exact_warps=exact, warps=n_warps,
                         exact_share=exact / n_warps, counted_build_same_bytes_as_reference=same))
        print(json.dumps(rows[-1]), flush=True)
    for _ in range(args.repeats):
        for mae in (False, True):
            for diag in (0, 2):
                launch(mae, diag)
                ms = triton.testing.do_bench(lambda m=mae, d=diag: launch(m, d), warmup=5, rep=60)
                times.setdefault((mae, diag), []).append(ms)
    for (mae, diag), ts in times.items():
        row = dict(err="mae" if mae else "mse", build="as is" if diag == 0 else "exact path skipped",
                   ms=statistics.median(ts), ms_repeats=ts)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [r, k], "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
