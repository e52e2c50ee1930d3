"""`fp4rl ablate`: the same RL job under several settings ("arms"), side by side.

Each arm is the base config (--config, then --set) plus its own overrides, run as its own run
directory `runs/<name>-<arm>/` with the same seeds, so the arms see the same prompts in the same
order and differ only by what the arm changes (e.g. BF16 against the NVFP4 recipe). Then one
summary for all of them in `runs/<name>-ablate/`: summary.json, summary.md (a table) and plots
overlaying the arms' curves (reward, held-out accuracy, sampler/trainer mismatch).

    fp4rl ablate                                   # bf16 vs the config's own precision preset
    fp4rl ablate --presets bf16,nvfp4-w4a16,nvfp4-linear
    fp4rl ablate --arm lr3e-5:trainer.lr=3e-5 --arm tis_off:grpo.is_correction=none

Each arm trains in its own process (`python -m fp4rl.cli train --config <the arm's config>`), so its
peak memory (on CPU the process's peak RSS) and its warm-up are its own, not those of the arms before it.

Interrupted, it continues: an arm whose run directory already holds the finished run is read
back, not run again; an unfinished one resumes from its newest checkpoint (as `fp4rl train
--resume`), so the arm's records are those of an uninterrupted run. As `fp4rl train --resume RUN_DIR --set
trainer.steps=N`, a larger trainer.steps extends the arms' runs (under a constant LR schedule; the run may
also differ in run_dirs.RESUME_FREE_KEYS, its logging, evaluation and checkpoint schedule). Every arm's run
directory is checked before the first arm trains: one holding a run of another config is refused (it is
never overwritten or mixed), and so is a summary directory holding the summary of an ablation of other arms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fp4rl.config import PRECISION_PRESETS, ConfigError, RunConfig, dump_toml, load_config
from fp4rl.loop import RunInterrupted
from fp4rl.metrics import read_metrics, write_atomic
from fp4rl.run_dirs import RESUME_FREE_KEYS
from fp4rl.trainer import latest_checkpoint

_ARM_NAME = re.compile(r"[A-Za-z0-9._=+-]+")
SUMMARY_SUFFIX = "ablate"  # the summary directory: runs/<run.name>-ablate/, so no arm may be named so
PLOT_KEYS = ("reward/mean", "eval/accuracy", "mismatch/logprob_abs_diff", "mismatch/kl_k3")
MEAN_KEYS = ("reward/mean", "reward/accuracy", "mismatch/logprob_abs_diff", "mismatch/kl_k3",
             "mismatch/tis_clip_frac", "train/grad_norm", "time/rollout_s", "time/train_s")


def _split_sets(sets: str) -> list[str]:
    """KEY=VALUE,KEY=VALUE... split at the commas outside brackets, braces and quotes (a list or table
    value keeps its commas: trainer.betas=[0.9, 0.95]). A quote opens a string only as the first character
    of a value (after `=`, `[`, `{` or `,`, spaces skipped), so one inside a bare word (Don't) is a
    character; a string, bracket or brace still open at the end (or a closing one never opened) raises
    ConfigError: it would have made the rest of the spec one value."""
    parts, depth, quote, start, prev = [], 0, None, 0, ","
    escaped = False
    for i, ch in enumerate(sets):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':  # a TOML basic string's escape (\" does not close it)
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'" and prev in "=[{,":
            quote, opened = ch, i
        elif ch in "[{":
            depth += 1
            opened = i if depth == 1 else opened
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise _unbalanced(sets, i, f"{ch!r} closes a bracket never opened")
        elif ch == "," and depth == 0:
            parts.append(sets[start:i])
            start = i + 1
        if not ch.isspace():
            prev = ch if not quote or ch == quote else prev
    if quote:
        raise _unbalanced(sets, opened, f"the string opened by {quote} is never closed")
    if depth:
        raise _unbalanced(sets, opened, f"the {sets[opened]!r} is never closed")
    return [*parts, sets[start:]]


def _unbalanced(sets: str, at: int, what: str) -> ConfigError:
    return ConfigError(f"{what} (at {sets[at:at + 20]!r}), so the rest of the spec would be one "
                       "value; quote a value holding quotes, commas or brackets, e.g. "
                       "task.suffix=\"Don't guess.\"")


def parse_arms(arm_specs: list[str], presets: str | None, base: RunConfig) -> dict[str, list[str]]:
    """Arms as {name: overrides}. --arm NAME:KEY=VALUE[,KEY=VALUE...] (split at the commas outside a value's
    brackets, braces and quotes; the same arm again adds keys), --presets P1,P2 (arm P = precision.preset=P).
    Neither: bf16 and the config's own preset."""
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
        if name == SUMMARY_SUFFIX:
            raise ConfigError(f"--arm {spec!r}: an arm cannot be named {SUMMARY_SUFFIX!r}: its run "
                              f"directory <run.name>-{SUMMARY_SUFFIX} is the ablation's summary directory; "
                              "pick another name")
        try:
            keys = [s.strip() for s in _split_sets(sets) if s.strip()]
        except ConfigError as e:
            raise ConfigError(f"--arm {spec!r}: {e}") from None
        named = [k for k in keys if k.split("=", 1)[0].strip().startswith("run.")]
        if named:
            raise ConfigError(f"--arm {spec!r}: {', '.join(named)}: an arm cannot set run.* keys (each "
                              "arm's run directory is <run.name>-<arm>, set by ablate); set run.* for every "
                              "arm with --set")
        arms.setdefault(name, []).extend(keys)
    if not arms:
        arms = {"bf16": ["precision.preset=bf16"]}
        if base.precision.preset != "bf16":
            arms[base.precision.preset] = [f"precision.preset={base.precision.preset}"]
    if len(arms) < 2:
        raise ConfigError(f"an ablation needs two arms or more, got {list(arms)}: add --arm or --presets")
    return arms


def arm_config(config_file: str | None, base_sets: list[str], name: str, sets: list[str]) -> RunConfig:
    """The arm's config: base < arm overrides; run.name = <base run.name>-<arm>. A ConfigError of the arm's
    config names the arm (a --set key may suit one arm and not another, e.g. precision.trace = true and
    the bf16 arm)."""
    base = load_config(config_file, base_sets)
    try:
        return load_config(config_file, [*base_sets, *sets, f"run.name={base.run.name}-{name}"])
    except ConfigError as e:
        raise ConfigError(f"arm {name!r} ({', '.join(sets) or 'the base config'}): {e}. "
                          f"{_arm_error_fix(config_file, base_sets, name, sets, str(e))}") from None


def _refused(config_file: str | None, sets: list[str], message: str) -> bool:
    """Whether load_config(config_file, sets) refuses with the same message (the same cause)."""
    try:
        load_config(config_file, sets)
    except ConfigError as e:
        return str(e) == message
    return False


def _arm_error_fix(config_file: str | None, base_sets: list[str], name: str, sets: list[str],
                   message: str) -> str:
    """The fix of an arm's refused config, for where the refused key came from: the arm's own keys (refused
    on the defaults too), their clash with the --config file, or with a --set key (every arm's)."""
    if sets and _refused(None, sets, message):
        return (f"The arm's own keys are refused together, whatever --config and --set hold: fix them in "
                f"--arm {name}:KEY=VALUE[,...]")
    if config_file is not None and sets and _refused(config_file, sets, message):
        return (f"The arm's keys clash with {config_file}, the base config of every arm: a key of the file "
                "that must differ between arms goes in --arm NAME:KEY=VALUE (out of the file), or choose "
                "other arms (--arm, --presets)")
    return ("A --set key sets it for every arm: a key that must differ between arms goes in --arm "
            "NAME:KEY=VALUE, not --set")


def _finished(records: list[dict], steps: int) -> bool:
    return any(r.get("step") == steps for r in records)


def arm_state(config: RunConfig) -> tuple[str, list[dict]]:
    """What running the arm will do, checked without training: ("fresh", []), ("finished", its records)
    or ("resume", its records); raises ConfigError if its run directory holds a run it cannot continue.
    As `fp4rl train --resume` (run_dirs.RESUME_FREE_KEYS), the run may differ from the arm's config in its
    length (a larger trainer.steps extends it, under a constant LR schedule), logging, evaluation and
    checkpoint schedule: resumed, it goes on with the arm's; any other key makes it another config's run,
    refused."""
    run_dir = config.run_dir
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    checkpoint = latest_checkpoint(run_dir)
    if not records and checkpoint is None:
        return "fresh", []
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} holds a run but no config.toml: move it away or pick another run.name")
    held = load_config(saved, ["run.resume=false"])
    want = dataclasses.replace(config, run=dataclasses.replace(config.run, resume=False))
    h, w = held.to_dict(), want.to_dict()
    diff = [f"{s}.{k}" for s in w for k in w[s] if h.get(s, {}).get(k) != w[s][k]]
    fixed = [k for k in diff if not k.startswith(RESUME_FREE_KEYS)]
    if fixed or (not diff and dump_toml(held) != dump_toml(want)):
        raise ConfigError(f"{run_dir} holds a run of another config ({', '.join(fixed) or 'some keys'} "
                          "differ): move it away or pick another run.name")
    steps, was = want.trainer.steps, held.trainer.steps
    trained = [r["step"] for r in records if r["step"] > 0]
    reached = max([int(checkpoint.name.removeprefix("step_")) if checkpoint else 0, *trained])
    if steps != was and reached:
        extend = (f"`fp4rl train --resume {run_dir} --set trainer.steps={steps}` (each arm's run directory "
                  "alike), then run this ablation again")
        if steps <= reached:
            raise ConfigError(
                f"{run_dir} holds this arm's run of trainer.steps = {was}, trained to step {reached}: it "
                f"cannot become a run of trainer.steps = {steps} (a run does not go back to fewer steps). "
                f"Set trainer.steps = {was} to read it back or continue it (or more to extend it), or move "
                f"it away to run the arm for trainer.steps = {steps}")
        if want.trainer.lr_schedule != "constant":
            raise ConfigError(
                f"{run_dir} holds this arm's run of trainer.steps = {was} (trained to step {reached}) under "
                f"trainer.lr_schedule = {want.trainer.lr_schedule!r}, which spans trainer.steps: continued "
                f"to {steps} steps it would match no uninterrupted run of either length (only a constant "
                f"schedule extends exactly), so the arm does not extend it. Move it away to run the arm for "
                f"trainer.steps = {steps}, set trainer.steps = {was} to keep it as it is, or to extend it "
                f"anyway: {extend}")
    if _finished(records, steps):
        other = [k for k in diff if not k.startswith("run.")]
        if other:
            print(f"{run_dir}: finished; read back as it was run, whose {', '.join(other)} differ from this "
                  "arm's config (no trained step depends on them); move it away to run it with the arm's")
        return "finished", records
    if checkpoint is None and trained:
        # as `fp4rl train --resume` (run_dirs.check_resumable): stopped in its first step, only the at-start
        # eval of step 0 is logged, and a resume redoes it from step 1; trained steps would be lost
        raise ConfigError(
            f"{run_dir} holds an unfinished run without a checkpoint to resume from (steps {trained[0]}.."
            f"{trained[-1]} logged, no checkpoint): it cannot be continued, and this arm never "
            "overwrites it; move the directory away (or pick another run.name) to run the arm again. "
            "(trainer.checkpoint_every > 0 makes future arms resumable after a kill.)")
    return "resume", records


def run_arm(config: RunConfig, train_fn, state: tuple[str, list[dict]] | None = None) -> list[dict]:
    """Run, resume or read back one arm (see the module docstring; state: arm_state(config), checked
    again if not given); returns its metrics records."""
    kind, records = state or arm_state(config)
    if kind == "fresh":
        return train_fn(config)
    if kind == "finished":
        print(f"{config.run_dir}: finished run found, read back")
        return records
    # the arm's config, resuming: a run that differs only in RESUME_FREE_KEYS (arm_state) goes on with the
    # arm's (a larger trainer.steps extends it), as `fp4rl train --resume RUN_DIR --set KEY=VALUE` would
    return train_fn(dataclasses.replace(config, run=dataclasses.replace(config.run, resume=True)))


class ArmInterrupted(KeyboardInterrupt):
    """An arm's `fp4rl train` stopped on Ctrl-C / SIGTERM after checkpointing its step."""


class ArmFailed(RuntimeError):
    """An arm's training process exited with an error (its message is on stderr above)."""


def train_in_subprocess(config: RunConfig) -> list[dict]:
    """`fp4rl train` of `config` in a fresh Python process (its memory peak and warm-up its own);
    returns the run's metrics records."""
    with tempfile.TemporaryDirectory(prefix="fp4rl-arm-") as tmp:
        cfg = Path(tmp) / "config.toml"
        cfg.write_text(dump_toml(config))
        # the child imports what this process can (a task's reward function named module:function)
        path = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
        # in a session of its own, so a terminal's Ctrl-C reaches it once, from here: the first one asks it to
        # finish its step with a checkpoint (loop.StopRequest), a second one kills it
        child = subprocess.Popen([sys.executable, "-m", "fp4rl.cli", "train", "--config", str(cfg)],
                                 env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
                                 start_new_session=True)
        interrupted = False
        try:
            try:
                rc = child.wait()
            except KeyboardInterrupt:
                interrupted = True
                child.send_signal(signal.SIGINT)
                try:
                    rc = child.wait()
                except KeyboardInterrupt:  # a second one: stop now
                    child.kill()
                    child.wait()
                    raise
        finally:
            if child.poll() is None:  # (anything else raised here)
                child.kill()
                child.wait()
    if interrupted or rc == 130:  # (130: fp4rl train stopped on a signal of its own, loop.RunInterrupted)
        state = ("finished, and the ablation stops before the next arm" if rc == 0 else
                 "stopped at the end of a step with its checkpoint" if rc == 130 else
                 "stopped before its first step or checkpoint")
        raise ArmInterrupted(f"{config.run_dir}: interrupted ({state}); run the same `fp4rl ablate` "
                             "command again to continue")
    if rc != 0:
        raise ArmFailed(f"training {config.run_dir} failed: `fp4rl train` exited with status {rc}")
    return read_metrics(config.run_dir)


def check_summary_dir(out_dir: Path, arm_names: list[str]) -> None:
    """Refuse a summary directory holding the summary of an ablation of other arms (same run.name)."""
    saved = out_dir / "summary.json"
    if not saved.is_file():
        return
    try:
        held = list(json.loads(saved.read_text())["arms"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{saved} is not an ablation summary ({e}): remove {out_dir} or pick another "
                          "run.name") from None
    if sorted(held) != sorted(arm_names):
        raise ConfigError(f"{out_dir} holds the summary of an ablation of other arms ({', '.join(held)}; "
                          f"these: {', '.join(arm_names)}): pick another run.name (--set run.name=...) or "
                          f"remove {out_dir}")


def summarize(arms: dict[str, list[dict]]) -> dict:
    """Per arm: steps, held-out accuracy first -> last, means of the MEAN_KEYS over the training steps
    (over the finite values; "non-finite KEY": how many steps logged NaN/inf, when any arm has one),
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
            logged = [float(r[key]) for r in steps if isinstance(r.get(key), (int, float))]
            vals = [v for v in logged if math.isfinite(v)]
            if vals:
                row[f"mean {key}"] = statistics.fmean(vals)
            if len(vals) < len(logged):  # a NaN/inf step is counted, not hidden by the mean of the rest
                row[f"non-finite {key}"] = len(logged) - len(vals)
        rewards = [float(r["reward/mean"]) for r in steps if isinstance(r.get("reward/mean"), (int, float))
                   and math.isfinite(r["reward/mean"])]
        if rewards:
            row["last quarter reward/mean"] = statistics.fmean(rewards[-max(1, len(rewards) // 4):])
        peaks = [r["memory/peak_bytes"] for r in steps
                 if isinstance(r.get("memory/peak_bytes"), (int, float))]
        if peaks:
            row["memory/peak_bytes"] = max(peaks)
        out[name] = row
    for key in {k for row in out.values() for k in row if k.startswith("non-finite ")}:
        for row in out.values():  # 0, not a blank cell, for the arms whose steps were all finite
            row.setdefault(key, 0)
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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def series(records, key):
        pairs = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    keys = [k for k in PLOT_KEYS if any(series(r, k)[0] for r in arms.values())]
    if not keys:
        return None
    fig = Figure(figsize=(7, 2.8 * len(keys)))  # its own Agg canvas: pyplot's backend is left alone
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, squeeze=False, sharex=True)
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
    fd, tmp = tempfile.mkstemp(prefix=".arms.", suffix=".png", dir=out_dir)
    try:  # written whole, then renamed over the old one
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ablate(config_file: str | None, base_sets: list[str], arm_sets: dict[str, list[str]],
           train_fn=None) -> tuple[dict, Path]:
    """Run every arm (train_fn: train_in_subprocess by default, one process per arm), then write the
    summary; returns (summary, the summary directory). Every arm's run directory and the summary
    directory are checked before the first arm trains."""
    in_subprocess = train_fn is None
    if train_fn is None:
        train_fn = train_in_subprocess
    configs = {name: arm_config(config_file, base_sets, name, sets) for name, sets in arm_sets.items()}
    base = load_config(config_file, base_sets)
    out_dir = Path(base.run.dir) / f"{base.run.name}-{SUMMARY_SUFFIX}"
    check_summary_dir(out_dir, list(arm_sets))
    states = {name: arm_state(cfg) for name, cfg in configs.items()}  # all checked before any trains
    records = {}
    for name, cfg in configs.items():
        print(f"== arm {name}: {' '.join(arm_sets[name])} -> {cfg.run_dir}")
        records[name] = run_arm(cfg, train_fn, states[name])
    summary = summarize(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "summary.json", json.dumps(
        {"process": "one per arm" if in_subprocess else "train_fn given by the caller",
         "arms": {n: {"overrides": arm_sets[n], "run_dir": str(configs[n].run_dir), **summary[n]}
                  for n in arm_sets}}, indent=1) + "\n")
    write_atomic(out_dir / "summary.md", table(summary))
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
        if os.environ.get("FP4RL_TRACEBACK") == "1":
            raise
        print(f"fp4rl ablate: error: {e}", file=sys.stderr)
        return 2
    except ArmFailed as e:
        print(f"fp4rl ablate: error: {e}", file=sys.stderr)
        return 1
    except (ArmInterrupted, RunInterrupted) as e:
        print(f"fp4rl ablate: {e}", file=sys.stderr)
        return 130
    print(table(summary))
    print(f"summary: {out_dir / 'summary.md'}, {out_dir / 'summary.json'}, {out_dir / 'plots'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp4rl ablate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
