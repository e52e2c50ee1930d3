"""Run metrics: one JSON object per step in runs/<name>/metrics.jsonl, TensorBoard, plots.

metrics.jsonl is the source of truth: every line is `{"step": s, key: value, ...}` with
strictly increasing steps, appended, flushed and fsynced as each step ends, so a crashed run keeps
every finished step (a last line cut short by the crash is dropped with a warning when read).
Resuming from the checkpoint of step k truncates the lines after step k (they belong to steps that
will be redone) so no step appears twice; TensorBoard gets the same `purge_step`. wandb is used only
when asked for and imported only then.

`plot(run_dir)` (also `fp4rl plot RUN_DIR`) draws PNGs into runs/<name>/plots/ from the JSONL:
reward and accuracy, sampler/trainer mismatch (|logprob diff|, KL), gradient norm, and held-out
accuracy (every `eval/*accuracy*` key). Keys follow DESIGN.md (`reward/mean`,
`mismatch/logprob_abs_diff`, `mismatch/kl_k3`, `train/grad_norm`, ...).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import tempfile
import uuid
import warnings
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"  # the wandb run this run logs to (logging.wandb)


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory, fsynced, then renamed over
    it: a reader (or a kill) sees the old file or the new one, never a truncated one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:  # owns fd from here: closed however the rest ends
            os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # not mkstemp's 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All step records of a run (or of a metrics.jsonl path), in file order.

    A last line without its newline that is not JSON is a write cut short (a kill, a full disk, or a
    live run's line being written): it is dropped with a warning. A line that is not JSON anywhere
    else is damage this refuses (ValueError naming the file and line).
    """
    path = Path(run_dir)
    path = path if path.suffix == ".jsonl" and not path.is_dir() else path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {path.parent} a run directory?")
    records = []
    with open(path) as fh:
        lines = fh.read().splitlines(keepends=True)
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
                    or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{line_no}: {line[:60].strip()!r} is not a step record (a JSON "
                                 "object with an integer \"step\"): the file is damaged; repair or delete "
                                 "that line")
            # the non-finite values the logger wrote as strings (JSON has no NaN/Inf) are floats again
            records.append({k: _finite_back(v) for k, v in record.items()})
        except json.JSONDecodeError as e:
            if line_no == len(lines) and not line.endswith("\n"):
                warnings.warn(f"{path}:{line_no}: dropped its last line, a write cut short (no newline, not "
                              f"JSON: {line[:40]!r}...); a resume rewrites the file without it", stacklevel=2)
                continue
            raise ValueError(f"{path}:{line_no}: not a JSON record ({e}): the file is damaged; repair or "
                             "delete that line (each line is one step's JSON object)") from e
    return records


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _finite_back(value):
    """What _jsonable wrote, read back: its "nan" / "inf" / "-inf" strings are floats again, in lists too."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [_finite_back(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite_back(v) for k, v in value.items()}
    return value


def _jsonable(value, key: str = ""):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        return value if math.isfinite(value) else str(value)  # JSON has no NaN/Inf: "nan", "inf"
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v, key) for k, v in value.items()}
    if hasattr(value, "item") and hasattr(value, "shape"):  # tensor / numpy array or scalar
        if math.prod(value.shape) != 1:
            raise ValueError(f"metric {key!r}: a tensor/array of shape {tuple(value.shape)}; log a number "
                             "(e.g. its mean) or a list (.tolist())")
        return _jsonable(value.item(), key)
    return value


def _line(record: dict) -> str:
    """One metrics.jsonl line: NaN / Inf as the strings "nan" / "inf" / "-inf" (read back as floats)."""
    return json.dumps({k: _jsonable(v, k) for k, v in record.items()}) + "\n"


class MetricsLogger:
    """Append step metrics to metrics.jsonl, TensorBoard and (optionally) wandb.

    resume_step=k keeps the records of steps <= k and drops the rest; resume_step=None starts a
    new log and refuses to touch an existing non-empty one unless overwrite=True.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "fp4rl",
        config: dict | None = None,
        resume_step: int | None = None,
        overwrite: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.last_step: int | None = None
        if resume_step is not None:
            kept = (
                [r for r in read_metrics(self.path) if r["step"] <= resume_step] if self.path.exists() else []
            )
            # read back, "nan" / "inf" are floats again: written as the logger writes them (JSON has no NaN)
            write_atomic(self.path, "".join(_line(r) for r in kept))  # a kill keeps the old
            self.last_step = kept[-1]["step"] if kept else None
        elif self.path.exists() and self.path.stat().st_size > 0 and not overwrite:
            raise FileExistsError(
                f"{self.path} already holds metrics; resume the run, pick another run.name, "
                "or pass overwrite=True"
            )
        else:
            self.path.write_text("")
        self._file = open(self.path, "a")  # noqa: SIM115 (held open for the run; closed by close())
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError as e:
                raise RuntimeError(
                    "logging.wandb = true but wandb is not installed: pip install wandb "
                    "(or set logging.wandb = false)"
                ) from e
            # one wandb run per fp4rl run: its id is kept in the run directory, so a resume continues it
            # (without an id, resume="allow" started a new wandb run at every resume). wandb keeps a run's
            # steps increasing and ignores, with a warning each, steps below the one it has: the steps a
            # resume redoes that wandb already holds are not sent again (the resume is exact: the same values)
            id_file = self.run_dir / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if id_file.is_file() else ""
            if not run_id:
                run_id = uuid.uuid4().hex[:16]
                write_atomic(id_file, run_id + "\n")
            self._wandb = wandb_module.init(
                project=wandb_project,
                name=self.run_dir.name,
                id=run_id,
                dir=str(self.run_dir),
                config=config,
                resume="allow",
            )
            self._wandb_from = int(getattr(self._wandb, "step", 0) or 0)  # wandb's step counter now

    def log(self, step: int, metrics: dict) -> None:
        """Record the metrics of `step` (must be larger than every step logged before)."""
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} logged after step {self.last_step}: steps must increase")
        record = {"step": int(step), **{k: _jsonable(v, k) for k, v in metrics.items() if k != "step"}}
        self._file.write(_line(record))
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the step's checkpoint: one fsync per step (seconds)
        self.last_step = int(step)
        scalars = {  # NaN / Inf too (written as strings to the JSON file): a diverging run shows it
            k: _NONFINITE.get(v, v) if isinstance(v, str) else v
            for k, v in record.items()
            if k != "step" and (isinstance(v, (int, float)) and not isinstance(v, bool)
                                or isinstance(v, str) and v in _NONFINITE)  # a list value is no scalar
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None and step >= self._wandb_from:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------- progress

_PROGRESS_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.2f}"),
    ("mismatch/logprob_abs_diff", "|dlp|", "{:.4f}"),
    ("mismatch/kl_k3", "kl", "{:.1e}"),
    ("train/grad_norm", "gn", "{:.2f}"),
)


def format_progress(metrics: dict) -> str:
    """The key figures of a step as one short line for tqdm's set_postfix_str.

    Held-out accuracies (`eval/accuracy`, `eval/accuracy_t1`, ...) are shown when present.
    """

    def is_number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    parts = [
        f"{label} {fmt.format(metrics[key])}"
        for key, label, fmt in _PROGRESS_KEYS
        if is_number(metrics.get(key))
    ]
    parts += [
        f"eval{key[len('eval/accuracy') :]} {value:.2f}"
        for key, value in metrics.items()
        if key.startswith("eval/accuracy") and is_number(value)
    ]
    return " ".join(parts)


# ---------------------------------------------------------------------------------- plots


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot(run_dir: str | Path) -> list[Path]:
    """Draw the run's curves as PNGs into <run_dir>/plots/; returns the files written.

    A figure whose metrics the run never logged is not drawn.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and "accuracy" in k})
    figures = [
        ("reward", "reward and training accuracy", [["reward/mean", "reward/accuracy"]], False),
        (
            "mismatch",
            "sampler vs trainer",
            [
                ["mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff_max"],
                ["mismatch/kl_k3"],
                ["mismatch/tis_clip_frac", "mismatch/mis_mask_frac"],
            ],
            True,
        ),
        ("grad_norm", "gradient norm", [["train/grad_norm"]], False),
        ("eval", "held-out accuracy", [eval_keys], False),
    ]
    written = []
    for name, title, panels, log_y in figures:
        panels = [[k for k in keys if _series(records, k)[0]] for keys in panels]
        panels = [keys for keys in panels if keys]
        if not panels:
            continue
        # a Figure on its own Agg canvas: pyplot's global backend (a notebook's) is left alone
        fig = Figure(figsize=(7, 3.2 * len(panels)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)
        for ax, keys in zip(axes[:, 0], panels):
            for key in keys:
                steps, values = _series(records, key)
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
            if log_y and all(v > 0 for k in keys for v in _series(records, k)[1]):
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0, 0].set_title(f"{run_dir.name}: {title}")
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl (e.g. runs/default)")


def run(args) -> int:
    run_dir = Path(args.run_dir)
    if run_dir.suffix == ".jsonl" and run_dir.is_file():  # `fp4rl plot RUN/metrics.jsonl`: its run
        if run_dir.name != METRICS_FILE:
            raise ValueError(f"{run_dir}: pass a run directory (the one holding {METRICS_FILE}); its plots "
                             "are written there")
        run_dir = run_dir.parent
    written = plot(run_dir)
    if not written:
        print(f"{run_dir}: no plottable metrics in {METRICS_FILE}")
        return 1
    for path in written:
        print(path)
    return 0
