"""Draw docs/img/h200_sampler.png from the sampler benchmark's JSON (fp4rl.benchmarks.sampler_gpu --out); each
panel's title names the GPU its files were measured on.

    .venv/bin/python docs/img/h200_sampler.py bench/data/s14/sampler53_8b_final2.json \
        bench/data/s14/sampler53_30b_final2.json [--out FILE.png]

A path may carry a label (PATH=LABEL): its series are named with it and compared with that file's own BF16
rows (several runs of one shape in one panel, e.g. two dispatch settings). --tok-only: tokens/s alone, the
legend under the panels (for many series).

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
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fp4rl.kernels.pdl import DEFAULT_OFF  # noqa: E402


def _rank(r) -> int:
    """0: the default launch setting (PDL on with the default kinds; older JSON has no pdl_off), 1: PDL on
    with other kinds, 2: PDL off."""
    if not r.get("pdl", True):
        return 2
    return 0 if "pdl_off" not in r or set(r["pdl_off"]) == DEFAULT_OFF else 1


def rows_of(path, label=""):
    """The bf16-KV rows of a JSON, one per (shape, precision, batch): the one nearest the default setting;
    each with "run": the label (its BF16 rows are the baseline of its other rows)."""
    with open(path) as fh:
        data = json.load(fh)
    gpu = data.get("env", {}).get("gpu", "H200")
    gpu = next((g for g in ("H200", "H100") if g in gpu), gpu)  # "NVIDIA H100 80GB HBM3" -> "H100"
    rows = [{**r, "gpu": gpu} for r in data["rows"] if "error" not in r and r.get("kv") == "bf16"]
    best = {}
    for r in rows:
        key = (r["shape"], r["precision"], r["batch"])
        if key not in best or _rank(r) < _rank(best[key]):
            best[key] = r
    return [{**r, "run": label} for r in best.values()]


def main(paths, out, tok_only=False):
    by_shape = defaultdict(list)
    for p in paths:
        path, _, label = p.partition("=")
        for r in rows_of(path, label):
            by_shape[r["shape"]].append(r)
    fig, axes = plt.subplots(1, len(by_shape), figsize=(5.5 * len(by_shape), 5.2 if tok_only else 4),
                             squeeze=False)
    for ax, (shape, rows) in zip(axes[0], sorted(by_shape.items())):
        base = {(r["run"], r["batch"]): r for r in rows if r["preset"] == "bf16"}
        series = sorted({(r["run"], r["precision"]) for r in rows if r["preset"] != "bf16"})
        for i, (run, precision) in enumerate(series):
            prec = f"{precision} ({run})" if run else precision
            pr = sorted((r for r in rows if (r["run"], r["precision"]) == (run, precision)
                         and (run, r["batch"]) in base), key=lambda r: r["batch"])
            b = [r["batch"] for r in pr]
            tok = [r["tok_s"] / base[run, r["batch"]]["tok_s"] for r in pr]
            rep = [base[run, r["batch"]]["graph_us"] / r["graph_us"] for r in pr]
            ax.plot(b, tok, "o-", color=f"C{i}", label=f"{prec}: tok/s")
            if not tok_only:
                ax.plot(b, rep, "s--", color=f"C{i}", alpha=0.6, label=f"{prec}: graph replay")
                limit = [r.get("limit_built") or base[run, r["batch"]]["bytes_built"] / r["bytes_built"]
                         for r in pr]  # (arms in separate processes: from the rows' byte counts)
                ax.plot(b, limit, ":", color=f"C{i}", alpha=0.5,
                        label=f"{prec}: byte limit")
            for r, t, g in zip(pr, tok, rep):
                print(f"{shape} {prec} batch {r['batch']}: {t:.2f}x tok/s, {g:.2f}x graph replay")
        ax.axhline(2.5, color="k", lw=0.8, ls="-.", label="target 2.5x")
        ax.axhline(1.0, color="gray", lw=0.6)
        layers = rows[0]["layers"], rows[0]["full_layers"]
        gpus = "/".join(sorted({r["gpu"] for r in rows}))
        ax.set(title=f"{shape} ({layers[0]}/{layers[1]} layers), {gpus}", xlabel="batch (sequences)",
               ylabel="speed vs BF16, same engine", xscale="log", ylim=(0, 3.5))
        ticks = sorted({b for _, b in base})
        ax.set_xticks(ticks, [str(v) for v in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if tok_only:
            ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        else:
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
    tok_only = "--tok-only" in args
    args = [a for a in args if a != "--tok-only"]
    if not args:
        sys.exit(__doc__)
    main(args, out, tok_only)
