"""Draw docs/img/default_job.png from the run directories of the default job's seeds.

    .venv/bin/python docs/img/default_job.py runs/s0 runs/s1 runs/s2 [--out FILE.png]

Top: held-out accuracy (greedy solid, T=1 dashed) per seed; middle: training reward per seed;
bottom: sampler-vs-trainer mean |logprob diff| per seed. Prints the before/after table.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fp4rl.config import load_config  # noqa: E402
from fp4rl.metrics import read_metrics  # noqa: E402


def series(records, key):
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def main(run_dirs, out):
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for i, run_dir in enumerate(run_dirs):
        records = read_metrics(run_dir)
        color, name = f"C{i}", Path(run_dir).name
        for key, style in (("eval/accuracy", "-o"), ("eval/accuracy_t1", "--s")):
            steps, values = series(records, key)
            if steps:
                axes[0].plot(steps, values, style, color=color, label=f"{name} {key.split('/')[1]}")
                print(f"{name} {key}: {values[0]:.2f} -> {values[-1]:.2f} (steps {steps[0]} -> {steps[-1]})")
        axes[1].plot(*series(records, "reward/mean"), color=color, label=name)
        axes[2].plot(*series(records, "mismatch/logprob_abs_diff"), color=color, label=name)
        wall = sum(r.get("time/step_s", 0) + (r.get("time/eval_s", 0) if r["step"] == 0 else 0)
                   for r in records)
        print(f"{name}: {len(records) - 1} steps, {wall / 60:.1f} min in steps and evals")
    axes[0].set_ylabel("held-out accuracy")
    axes[1].set_ylabel("reward/mean")
    axes[2].set_ylabel("mean |logprob diff|")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    preset = load_config(Path(run_dirs[0]) / "config.toml").precision.preset
    axes[0].set_title(f"SmolLM2-135M, basic_arithmetic, GRPO, {preset}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    out = Path(__file__).with_suffix(".png")
    if "--out" in args:
        i = args.index("--out")
        out, args = Path(args[i + 1]), args[:i] + args[i + 2 :]
    main(args, out)
