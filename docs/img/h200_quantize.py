"""Draw docs/img/h200_quantize.png from bench/quant_cuda.py's JSON (default: the twenty-eighth session's run
of `bench/device_run81.sh a`, bench/data/s28/quant81_a.json: the session's quantize kernels against its
start's in one process on an H200).

    .venv/bin/python docs/img/h200_quantize.py [--data bench/data/s28/quant81_a.json] \
        [--out docs/img/h200_quantize.png]

Effective TB/s ((bytes read once + written) / time) per mode and shape, the session's end ("cuda") beside its
start ("prev"); the issue's targets (3 TB/s, 4/6: 2 TB/s) and the measured copy bandwidth as lines.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ["row 6", "tensor 6", "row 4/6 mse", "row 4/6 mae", "tensor 4/6 mse", "tensor 4/6 mae"]


def main(data: Path, out: Path) -> None:
    run = json.loads(data.read_text())
    rows = run["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4.2), sharey=True)
    width = 0.38
    for ax, shape in zip(axes, shapes):
        by_mode = {r["mode"]: r for r in rows if r["shape"] == shape}
        modes = [m for m in MODES if m in by_mode]
        for i, m in enumerate(modes):
            r = by_mode[m]
            for j, (key, color, label) in enumerate((("prev", "0.7", "session start"),
                                                     ("cuda", "tab:blue", "session end"))):
                if key not in r:
                    continue
                v = r[key]["tb_s"]
                ax.bar(i + (j - 0.5) * width, v, width, color=color, label=label if i == 0 else None)
                if key == "cuda":
                    ax.text(i + 0.5 * width, v + 0.05, f"{v:.2f}", ha="center", fontsize=7)
        ax.axhline(run["copy"]["tb_s"], color="k", lw=0.8, ls=":", label="copy bandwidth")
        ax.axhline(3.0, color="tab:green", lw=0.8, ls="--", label="target (3 TB/s)")
        ax.axhline(2.0, color="tab:red", lw=0.8, ls="--", label="target, 4/6 (2 TB/s)")
        ax.set_xticks(range(len(modes)), modes, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{shape} bfloat16", fontsize=10)
    axes[0].set_ylabel("effective TB/s (read once + written)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle("NVFP4 quantize on an H200 (CUDA C++ kernels, bytes equal to the reference)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    for r in rows:
        if "cuda" in r:
            start, end = r["prev"]["tb_s"], r["cuda"]["tb_s"]
            print(f"{r['shape']:>11} {r['mode']:<15} start {start:.2f}  end {end:.2f} TB/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("bench/data/s28/quant81_a.json"))
    ap.add_argument("--out", type=Path, default=Path("docs/img/h200_quantize.png"))
    a = ap.parse_args()
    main(a.data, a.out)
