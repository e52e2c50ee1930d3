"""`fp4rl ablate`: the same RL job under several settings ("arms"), side by side.

Each arm is the base config (--config, then --set) plus its own overrides, run as its own run
directory `runs/<name>-<arm>/` with the same seeds, so the arms see the same prompts in the same
order and differ only by what the arm changes (e.g. BF16 against the NVFP4 recipe). Then one
summary for all of them in `runs/<name>-ablate/`: summary.json, summary.md (a table) and plots
overlaying the arms' curves (reward, held-out accuracy, sampler/trainer mismatch).

    fp4rl ablate                                   # bf16 vs the config's own precision preset
    fp4rl ablate --presets bf16,nvfp4-w4a16,nvfp4-linear
    fp4rl ablate --arm lr3e-5:trainer.lr=3e-5 --arm tis_off:grpo.is_correction=none

Interrupted, it continues: an arm whose run directory already holds the finished run is read
back, not run again; an unfinished one resumes from its newest checkpoint (as `fp4rl train
--resume`), so the arm's records are those of an uninterrupted run. A run directory holding a run
of another config is refused (it is never overwritten or mixed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

from fp4rl.config import PRECISION_PRESETS, ConfigError, RunConfig, dump_toml, load_config
from fp4rl.metrics import read_metrics
from fp4rl.trainer import latest_checkpoint

_ARM_NAME = re.compile(r"[A-Za-z0-9._=+-]+")
PLOT_KEYS = ("reward/mean", "eval/accuracy", "mismatch/logprob_abs_diff", "mismatch/kl_k3")
MEAN_KEYS = ("reward/mean", "reward/accuracy", "mismatch/logprob_abs_diff", "mismatch/kl_k3",
             "mismatch/tis_clip_frac", "train/grad_norm", "time/rollout_s", "time/train_s")


def parse_arms(arm_specs: list[str], presets: str | None, base: RunConfig) -> dict[str, list[str]]:
    """Arms as {name: overrides}. --arm NAME:KEY=VALUE[,KEY=VALUE...] (a value holding a comma: give
    the key in its own --arm NAME:... again), --presets P1,P2 (arm P = precision.preset=P). Neither:
    bf16 and the config's own preset."""
    arms: dict[str, list[str]] = {}
    for name in (presets.split(",") if presets else []):
        name = name.strip()
        if name not in PRECISION_PRESETS:
            raise ConfigError(f"--presets: {name!r} is not a precision preset; choose from "
                              f"{', '.join(PRECISION_PRESETS)}")
        arms[name] = [f"precision.preset={name}"]
    for spec in arm_specs:
        name, sep, sets = spec.partition(":")
        if not sep or not _ARM_NAME.fullmatch(name) or not sets:
            raise ConfigError(f"--arm {spec!r}: write NAME:KEY=VALUE[,KEY=VALUE...], NAME of letters, digits "
                              "and . _ - = +, e.g. --arm lr3e-5:trainer.lr=3e-5")
        arms.setdefault(name, []).extend(s.strip() for s in sets.split(",") if s.strip())
    if not arms:
        arms = {"bf16": ["precision.preset=bf16"]}
        if base.precision.preset != "bf16":
            arms[base.precision.preset] = [f"precision.preset={base.precision.preset}"]
    if len(arms) < 2:
        raise ConfigError(f"an ablation needs two arms or more, got {list(arms)}: add --arm or --presets")
    return arms


def arm_config(config_file: str | None, base_sets: list[str], name: str, sets: list[str]) -> RunConfig:
    """The arm's config: base < arm overrides; run.name = <base run.name>-<arm>."""
    base = load_config(config_file, base_sets)
    return load_config(config_file, [*base_sets, *sets, f"run.name={base.run.name}-{name}"])


def _finished(records: list[dict], steps: int) -> bool:
    return any(r.get("step") == steps for r in records)


def run_arm(config: RunConfig, train_fn) -> list[dict]:
    """Run, resume or read back one arm (see the module docstring); returns its metrics records."""
    run_dir = config.run_dir
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if not records and latest_checkpoint(run_dir) is None:
        return train_fn(config)
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds a run but no config.toml: move it away or pick another run.name")
    held = load_config(saved, ["run.resume=false"])
    want = dataclasses.replace(config, run=dataclasses.replace(config.run, resume=False))
    if dump_toml(held) != dump_toml(want):
        h, w = held.to_dict(), want.to_dict()
        diff = [f"{s}.{k}" for s in w for k in w[s] if h.get(s, {}).get(k) != w[s][k]]
        raise ConfigError(f"{run_dir} holds a run of another config ({', '.join(diff) or 'some keys'} "
                          "differ): move it away or pick another run.name")
    if _finished(records, config.trainer.steps):
        print(f"{run_dir}: finished run found, read back")
        return records
    if latest_checkpoint(run_dir) is None:
        raise ConfigError(f"{run_dir} holds an unfinished run without a checkpoint to resume from: move it "
                          "away (or set trainer.checkpoint_every > 0 to make arms resumable)")
    return train_fn(load_config(saved, ["run.resume=true"]))


def summarize(arms: dict[str, list[dict]]) -> dict:
    """Per arm: steps, held-out accuracy first -> last, means of the MEAN_KEYS over the training steps,
    the last quarter's mean reward, peak memory."""
    out = {}
    for name, records in arms.items():
        steps = [r for r in records if r.get("step", 0) >= 1]  # step 0: the held-out eval before training
        evals = [r for r in records if "eval/accuracy" in r]
        row: dict = {"steps": max((r["step"] for r in steps), default=0)}
        if evals:
            row["eval/accuracy_first"] = evals[0]["eval/accuracy"]
            row["eval/accuracy_last"] = evals[-1]["eval/accuracy"]
        for key in MEAN_KEYS:
            vals = [float(r[key]) for r in steps if isinstance(r.get(key), (int, float))]
            if vals:
                row[f"mean {key}"] = statistics.fmean(vals)
        rewards = [float(r["reward/mean"]) for r in steps if isinstance(r.get("reward/mean"), (int, float))]
        if rewards:
            row["last quarter reward/mean"] = statistics.fmean(rewards[-max(1, len(rewards) // 4):])
        peaks = [r["memory/peak_bytes"] for r in steps
                 if isinstance(r.get("memory/peak_bytes"), (int, float))]
        if peaks:
            row["memory/peak_bytes"] = max(peaks)
        out[name] = row
    return out


def table(summary: dict) -> str:
    """summary as a Markdown table, one row per arm."""
    cols = sorted({k for row in summary.values() for k in row}, key=lambda k: (k != "steps", k))
    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in summary.items():
        cells = [f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(arms: dict[str, list[dict]], out_dir: Path) -> Path | None:
    """The arms' curves of PLOT_KEYS, one panel per key logged by any arm; None if nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(records, key):
        pairs = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    keys = [k for k in PLOT_KEYS if any(series(r, k)[0] for r in arms.values())]
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.8 * len(keys)), squeeze=False, sharex=True)
    for ax, key in zip(axes[:, 0], keys):
        for name, records in arms.items():
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "arms.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ablate(config_file: str | None, base_sets: list[str], arm_sets: dict[str, list[str]],
           train_fn=None) -> tuple[dict, Path]:
    """Run every arm (train_fn: fp4rl.loop.train by default), then write the summary; returns
    (summary, the summary directory)."""
    if train_fn is None:
        from fp4rl.loop import train as train_fn
    configs = {name: arm_config(config_file, base_sets, name, sets) for name, sets in arm_sets.items()}
    base = load_config(config_file, base_sets)
    out_dir = Path(base.run.dir) / f"{base.run.name}-ablate"
    records = {}
    for name, cfg in configs.items():  # every arm's config is checked before the first one runs
        print(f"== arm {name}: {' '.join(arm_sets[name])} -> {cfg.run_dir}")
        records[name] = run_arm(cfg, train_fn)
    summary = summarize(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(
        {"arms": {n: {"overrides": arm_sets[n], "run_dir": str(configs[n].run_dir), **summary[n]}
                  for n in arm_sets}}, indent=1) + "\n")
    (out_dir / "summary.md").write_text(table(summary))
    plot(records, out_dir / "plots")
    return summary, out_dir


# ---------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.toml", help="base run config (defaults < file < --set)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key of every arm, e.g. --set trainer.steps=10 (repeatable)")
    parser.add_argument("--arm", dest="arms", action="append", default=[], metavar="NAME:KEY=VALUE[,...]",
                        help="one arm: its name and the keys it changes (repeatable)")
    parser.add_argument("--presets", metavar="P1,P2,...",
                        help=f"one arm per precision preset ({', '.join(PRECISION_PRESETS)})")


def run(args) -> int:
    try:
        arms = parse_arms(args.arms, args.presets, load_config(args.config, args.overrides))
        summary, out_dir = ablate(args.config, args.overrides, arms)
    except (ConfigError, FileNotFoundError, FileExistsError) as e:
        print(f"fp4rl ablate: error: {e}", file=sys.stderr)
        return 2
    print(table(summary))
    print(f"summary: {out_dir / 'summary.md'}, {out_dir / 'summary.json'}, {out_dir / 'plots'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4rl ablate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
