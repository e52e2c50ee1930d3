"""The rules of a run directory (runs/<name>/: config.toml, metrics.jsonl, checkpoints/) at the start of
`fp4rl train`: a new run never overwrites one (check_fresh); a resume refuses what would lose the run's
records or go back to fewer steps (check_resumable); `fp4rl train --resume RUN_DIR` continues the run
where the folder is now, even if it was moved (resume_config); a resume with settings other than its
checkpoint's is named in a warning (warn_changed_settings). Nothing here loads a model or writes a file.
"""

from __future__ import annotations

import json
import re
import tomllib
import warnings
from pathlib import Path

from fp4rl.config import ConfigError, RunConfig, load_config
from fp4rl.metrics import METRICS_FILE, read_metrics
from fp4rl.trainer import _STATE_FILE, CHECKPOINT_DIR, latest_checkpoint


def check_fresh(run_dir: Path) -> None:
    """FileExistsError if run_dir already holds a run (metrics or a checkpoint): a new run never overwrites
    one."""
    metrics = run_dir / METRICS_FILE
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        raise FileExistsError(f"{run_dir} already holds a run: continue it with `fp4rl train --resume "
                              f"{run_dir}` (or run.resume = true), or pick another run.name")
    if metrics.exists() and metrics.stat().st_size > 0:
        try:
            trained = any(isinstance(r.get("step"), int) and r["step"] > 0 for r in read_metrics(metrics))
        except ValueError:
            trained = True
        fix = ("it has no checkpoint to continue from (trainer.checkpoint_every = 0 writes one only after "
               "the last step): move it away, or pick another run.name" if trained else
               f"it stopped before its first step: continue it with `fp4rl train --resume {run_dir}`, or "
               "pick another run.name")
        raise FileExistsError(f"{run_dir} already holds a run; {fix}")


def check_resumable(config: RunConfig, checkpoint: Path | None) -> None:
    """ConfigError, before anything is loaded or written, for a resume that would lose what the run has
    (trained steps' metrics without a checkpoint to continue from), that asks for fewer steps than its
    checkpoint has done, or whose metrics.jsonl is damaged; a warning when there is nothing to continue
    (stopped before the end of step 1; the at-start eval of step 0 is redone): the run starts at step 1."""
    run_dir, steps = config.run_dir, config.trainer.steps
    metrics = run_dir / METRICS_FILE
    if not (run_dir / "config.toml").is_file() and checkpoint is None and not metrics.exists():
        # (a job that always resumes, requeued or launched the first time): it starts, said loudly in case
        # run.dir / run.name has a typo and another run was meant
        warnings.warn(f"run.resume = true but {run_dir} holds no run (no config.toml, metrics or "
                      "checkpoint): starting it at step 1. If you meant to resume another run, check run.dir "
                      "and run.name", stacklevel=3)
        return
    try:  # a damaged metrics.jsonl is named now, before anything is loaded or written
        logged = [r.get("step") for r in read_metrics(metrics)] if metrics.exists() else []
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if checkpoint is None:
        trained = [s for s in logged if isinstance(s, int) and s > 0]  # the at-start eval (step 0) is redone
        if trained:
            every = config.trainer.checkpoint_every
            raise ConfigError(
                f"cannot resume {run_dir}: its {METRICS_FILE} holds the records of steps {trained[0]}.."
                f"{trained[-1]} but there is no checkpoint to continue from (trainer.checkpoint_every = "
                f"{every}{'; 0 writes one only after the last step' if every == 0 else ''}), so resuming "
                "would start again from step 1 and drop them. To start over, move the run directory away "
                "or pick another run.name"
                + ("; set trainer.checkpoint_every > 0 to make a run resumable after a kill" if every == 0
                   else ""))
        warnings.warn(f"resuming {run_dir}: no checkpoint and no trained step there (stopped before the end "
                      "of its first step), so the run starts at step 1", stacklevel=3)
        return
    done = int(checkpoint.name.removeprefix("step_"))
    if done > steps:
        raise ConfigError(
            f"cannot resume {run_dir} with trainer.steps = {steps}: its newest checkpoint "
            f"({checkpoint.name}) is after step {done}, and a run cannot go back to fewer steps (nothing "
            f"would be trained, and its config.toml would say {steps}); set trainer.steps to {done} or more")


def resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The config of `fp4rl train --resume RUN_DIR`: RUN_DIR/config.toml with the --set overrides, resuming,
    at RUN_DIR itself (run.dir / run.name follow the folder if it moved)."""
    if (run_dir / _STATE_FILE).is_file() or (run_dir.parent.name == CHECKPOINT_DIR
                                              and re.fullmatch(r"step_\d+", run_dir.name)):
        run = run_dir.parent.parent
        raise ConfigError(f"--resume {run_dir} is a checkpoint of the run {run}: resume the run directory, "
                          f"`fp4rl train --resume {run}` (it continues from its newest checkpoint; to go on "
                          f"from this one, move the newer ones out of {run_dir.parent})")
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(f"--resume {run_dir}: no config.toml there; is it a run directory "
                          f"(runs/<name>/ with config.toml, metrics.jsonl, {CHECKPOINT_DIR}/)?")

    def key(override: str) -> str:  # as the TOML parser reads it: '"run" . name' is run.name
        return ".".join(part.strip().strip("'\"") for part in override.split("=", 1)[0].split("."))

    named = [o for o in overrides if key(o) in ("run.dir", "run.name", "run.resume")]
    if named:
        raise ConfigError(f"--resume {run_dir} names the run and resumes it: {', '.join(named)} cannot "
                          "change that (to start another run from its config, copy its config.toml and use "
                          "--config)")
    try:  # only run.dir / run.name: the rest is validated below, with the --set fixes applied
        run = tomllib.loads((run_dir / "config.toml").read_text()).get("run", {})
        default = RunConfig().run
        named_dir = Path(str(run.get("dir", default.dir))) / str(run.get("name", default.name))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
        named_dir = None  # load_config below names the problem
    where = ["run.resume=true"]
    here = run_dir.resolve()
    if named_dir is None or named_dir.resolve() != here:  # moved, or a relative run.dir from elsewhere:
        # it continues where it is now
        where += [f"run.dir={json.dumps(str(here.parent))}", f"run.name={here.name}"]
    return load_config(run_dir / "config.toml", [*overrides, *where])


# what a resume may change without changing the run's numbers: its length, logging, evaluation schedule and
# where the shards run (the numbers depend on distributed.samplers, never on the backend or its GPUs)
RESUME_FREE_KEYS = ("run.", "logging.", "trainer.steps", "trainer.checkpoint_every",
                    "trainer.checkpoint_keep", "task.eval_every", "eval.", "distributed.backend",
                    "distributed.gpus_per_sampler")


def warn_changed_settings(checkpoint: Path, c: RunConfig) -> None:
    """Warn, naming them, about the settings a resume changes against the checkpoint's config.toml (the run
    continues with the new ones, no longer what an uninterrupted run would do); the run's length, logging and
    evaluation schedule are free to change."""
    path = Path(checkpoint) / "config.toml"
    if not path.is_file():
        return
    try:
        was = load_config(path).to_dict()
    except (ConfigError, OSError):
        return

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("kwargs",):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    old, new = dict(flat(was)), dict(flat(c.to_dict()))
    changed = [k for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and not k.startswith(RESUME_FREE_KEYS)]
    if old.get("trainer.steps") != new.get("trainer.steps") and new.get("trainer.lr_schedule") != "constant":
        warnings.warn(f"resuming {checkpoint} with trainer.steps {old.get('trainer.steps')} -> "
                      f"{new.get('trainer.steps')} under trainer.lr_schedule = "
                      f"{new.get('trainer.lr_schedule')!r}: "
                      "the schedule spans trainer.steps, so the learning rates from here on follow the new "
                      "length and the run matches no uninterrupted run of either length (only a constant "
                      "schedule extends exactly)", stacklevel=3)
    if changed:
        warnings.warn(f"resuming {checkpoint} with settings other than it was trained with: "
                      + "; ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:8])
                      + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
                      + ": the run continues with the new ones, so it is no longer what the uninterrupted "
                      "run would have done", stacklevel=3)


def checkpoint_of(path: Path, what: str) -> Path | None:
    """The trainer checkpoint a folder names, for commands that read a run's weights (`fp4rl export`,
    `fp4rl generate --model`): a checkpoint (it holds the trainer state) is itself, a run directory
    (checkpoints/ or metrics.jsonl, no config.json) its newest complete checkpoint; None for anything else
    (a model folder). FileNotFoundError, naming `what` (the command), for a run directory with no complete
    checkpoint yet."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return None
    if (path / _STATE_FILE).is_file():
        return path
    if (path / "config.json").is_file():
        return None  # a model folder
    if (path / CHECKPOINT_DIR).is_dir() or (path / METRICS_FILE).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"{what}: run directory {path} has no complete checkpoint yet (one is "
                                    "written after the last step, or every trainer.checkpoint_every steps)")
        return latest
    return None
