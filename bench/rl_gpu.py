"""`fp4rl train` that prints, at exit, what the GEMM tuner cost the run (keys timed, wall seconds: where a
first run on a GPU spends its warm-up). Usage: python3 bench/rl_gpu.py train --config ... (fp4rl.cli's
arguments)."""

import atexit
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4rl import cli  # noqa: E402
from fp4rl.kernels import gemm_tune  # noqa: E402

START = time.perf_counter()


def report():
    secs = gemm_tune.TUNE_SECONDS
    slowest = sorted(secs.items(), key=lambda kv: -kv[1])[:5]
    print(f"[rl_gpu] GEMM tuner: {len(secs)} keys timed in {sum(secs.values()):.1f} s of the process's "
          f"{time.perf_counter() - START:.1f} s; slowest: " + "; ".join(f"{k} {v:.1f} s" for k, v in slowest),
          flush=True)


if __name__ == "__main__":
    atexit.register(report)
    sys.exit(cli.main(sys.argv[1:]))
