"""Draw docs/img/h200_sampler.png from the sampler benchmark's JSON (fp4rl.benchmarks.sampler_gpu --out).

    .venv/bin/python docs/img/h200_sampler.py bench/data/s14/sampler53_8b_final2.json \
        bench/data/s14/sampler53_30b_final2.json [--out FILE.png]

One panel per model shape: the NVFP4 presets' decode speed relative to BF16 in the same engine and run, per
batch size, as decode tokens/s (solid; the step-clock cadence from the thirteenth session) and as CUDA-graph
replay time (dashed), with the issue's 2.5x target and the byte-count limit of each preset (BF16 weight bytes
over the preset's, at the built depth). Of rows measured more than once with other launch settings (--pdl),
the one with the default setting is drawn. Prints the plotted numbers.
"""

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fp4rl.kernels.pdl import DEFAULT_OFF  # noqa: E402


def _rank(r) -> int:
    """0: the default launch setting (PDL on with the default kinds; older JSON has no pdl_off), 1: PDL on
    with other kinds, 2: PDL off."""
    if not r.get("pdl", True):
        return 2
    return 0 if "pdl_off" not in r or set(r["pdl_off"]) == DEFAULT_OFF else 1


def rows_of(path):
    """The bf16-KV rows of a JSON, one per (shape, precision, batch): the one nearest the default setting."""
    with open(path) as fh:
        rows = [r for r in json.load(fh)["rows"] if "error" not in r and r.get("kv") == "bf16"]
    best = {}
    for r in rows:
        key = (r["shape"], r["precision"], r["batch"])
        if key not in best or _rank(r) < _rank(best[key]):
            best[key] = r
    return list(best.values())


def main(paths, out):
    by_shape = defaultdict(list)
    for p in paths:
        for r in rows_of(p):
            by_shape[r["shape"]].append(r)
    fig, axes = plt.subplots(1, len(by_shape), figsize=(5.5 * len(by_shape), 4), squeeze=False)
    for ax, (shape, rows) in zip(axes[0], sorted(by_shape.items())):
        base = {r["batch"]: r for r in rows if r["preset"] == "bf16"}
        presets = sorted({r["precision"] for r in rows if r["preset"] != "bf16"})
        for i, prec in enumerate(presets):
            pr = sorted((r for r in rows if r["precision"] == prec and r["batch"] in base),
                        key=lambda r: r["batch"])
            b = [r["batch"] for r in pr]
            tok = [r["tok_s"] / base[r["batch"]]["tok_s"] for r in pr]
            rep = [base[r["batch"]]["graph_us"] / r["graph_us"] for r in pr]
            ax.plot(b, tok, "o-", color=f"C{i}", label=f"{prec}: tok/s")
            ax.plot(b, rep, "s--", color=f"C{i}", alpha=0.6, label=f"{prec}: graph replay")
            ax.plot(b, [r["limit_built"] for r in pr], ":", color=f"C{i}", alpha=0.5,
                    label=f"{prec}: byte limit")
            for r, t, g in zip(pr, tok, rep):
                print(f"{shape} {prec} batch {r['batch']}: {t:.2f}x tok/s, {g:.2f}x graph replay")
        ax.axhline(2.5, color="k", lw=0.8, ls="-.", label="target 2.5x")
        ax.axhline(1.0, color="gray", lw=0.6)
        layers = rows[0]["layers"], rows[0]["full_layers"]
        ax.set(title=f"{shape} ({layers[0]}/{layers[1]} layers), H200", xlabel="batch (sequences)",
               ylabel="speed vs BF16, same engine", xscale="log", ylim=(0, 3.5))
        ax.set_xticks(sorted(base), [str(v) for v in sorted(base)])
        ax.legend(fontsize=6.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    args = sys.argv[1:]
    out = "docs/img/h200_sampler.png"
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1]
        args = args[:i] + args[i + 2:]
    if not args:
        sys.exit(__doc__)
    main(args, out)
