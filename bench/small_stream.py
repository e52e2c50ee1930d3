"""How fast can a few MB stream on this GPU? torch's read-only reduction (sum) and a read+write copy over
buffers of a decode GEMM's size, timed as every GPU table here (CUDA-graph replay of a chain of calls over
copies that defeat L2, median of 7): the reference for the mma16 kernel's weight stream (`t3` builds).

  python3 bench/small_stream.py [--mb 1.5,3,6,14,33] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl.benchmarks.gpu_kernels import _env, copies_for, copy_bandwidth, time_calls  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="1.5,3,6,14,33")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = {"env": _env(), "copy": copy_bandwidth(), "rows": []}
    print("copy", out["copy"], flush=True)
    for mb in map(float, a.mb.split(",")):
        n = int(mb * 1e6) // 2 // 4096 * 4096
        bufs = [torch.randn(n, device="cuda").bfloat16() for _ in range(copies_for(2 * n))]
        outs = [torch.empty_like(b) for b in bufs]
        t_sum = time_calls([lambda b=b: torch.sum(b, dtype=torch.float32) for b in bufs])
        t_copy = time_calls([lambda b=b, o=o: o.copy_(b) for b, o in zip(bufs, outs)])
        row = dict(mb=2 * n / 1e6, sum_us=t_sum, sum_tb_s=2 * n / t_sum / 1e6, copy_us=t_copy,
                   copy_tb_s=4 * n / t_copy / 1e6)
        out["rows"].append(row)
        print(f"{2 * n / 1e6:6.2f} MB  read (sum) {t_sum:6.2f} us {row['sum_tb_s']:4.2f} TB/s   "
              f"read+write (copy) {t_copy:6.2f} us {row['copy_tb_s']:4.2f} TB/s", flush=True)
        del bufs, outs
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
