"""Draw docs/img/h200_rl.png from the metrics of the default job's GPU runs (bench/data/s25/rl72_*.jsonl).

    .venv/bin/python docs/img/h200_rl.py [--data bench/data/s25] [--out docs/img/h200_rl.png]

Left: sampler-vs-trainer mean |logprob diff| per step with W4A4 on every decoder linear (nvfp4-linear), TRACE
on (solid) and off (round to nearest, dashed), trainer seeds 0-2. Right: held-out greedy accuracy before and
after the 20 steps of each run. Prints the table of bench/RESULTS.md's twenty-fifth session.
"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = [("bf16", "BF16"), ("w4a16_cold", "W4A16 (default)"), ("linear_rtn", "W4A4 RTN s0"),
        ("linear_rtn_s1", "W4A4 RTN s1"), ("linear_rtn_s2", "W4A4 RTN s2"), ("linear_trace", "W4A4 TRACE s0"),
        ("linear_trace_s1", "W4A4 TRACE s1"), ("linear_trace_s2", "W4A4 TRACE s2")]


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(data: Path, out: Path):
    runs = {name: load(data / f"rl72_{name}.jsonl") for name, _ in ARMS}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for seed in range(3):
        for kind, style in (("trace", "-"), ("rtn", "--")):
            name = f"linear_{kind}" + (f"_s{seed}" if seed else "")
            rows = [r for r in runs[name] if "mismatch/logprob_abs_diff" in r]
            ax.plot([r["step"] for r in rows], [r["mismatch/logprob_abs_diff"] for r in rows], style,
                    color=f"C{seed}", label=f"{'TRACE' if kind == 'trace' else 'RTN'}, seed {seed}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean |logprob diff|, sampler vs trainer")
    ax.set_title("W4A4 on every decoder linear, GPU kernel sampler")
    ax.legend(fontsize=7, ncol=2)
    print("| run | held-out greedy accuracy | median step s (rollout / train / sync) | mean abs dlp "
          "| KL k3 |")
    print("|---|---|---|---|---|")
    for i, (name, label) in enumerate(ARMS):
        rows = runs[name]
        before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
        bx.bar([2 * i, 2 * i + 0.8], [before, after], color=["0.7", f"C{i}"], width=0.8)
        steps = [r for r in rows[2:] if "time/step_s" in r]  # (step 1 holds the warm-up)

        def med(key, rows=steps):
            return statistics.median(r[key] for r in rows)
        mism = [r for r in rows if "mismatch/logprob_abs_diff" in r]
        print(f"| {label} | {before:.2f} -> {after:.2f} | {med('time/step_s'):.2f} "
              f"({med('time/rollout_s'):.2f} / {med('time/train_s'):.2f} / {med('time/sync_s'):.3f}) | "
              f"{med('mismatch/logprob_abs_diff', mism):.4f} | {med('mismatch/kl_k3', mism):.5f} |")
    bx.set_xticks([2 * i + 0.4 for i in range(len(ARMS))], [label for _, label in ARMS], rotation=40,
                  ha="right", fontsize=7)
    bx.set_ylabel("held-out greedy accuracy (grey: step 0)")
    bx.set_title("SmolLM2-135M, 20 GRPO steps on an H200")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("bench/data/s25"))
    p.add_argument("--out", type=Path, default=Path("docs/img/h200_rl.png"))
    a = p.parse_args()
    main(a.data, a.out)
