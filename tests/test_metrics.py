"""Metrics logging, resume truncation, progress line and plots on a synthetic run."""

import json
import math
import sys

import pytest
import torch

from fp4rl import metrics as metrics_module
from fp4rl.metrics import MetricsLogger, format_progress, plot, read_metrics


def _step_metrics(step):
    m = {
        "policy_version": step,
        "reward/mean": 0.3 + 0.01 * step,
        "reward/accuracy": torch.tensor(0.25 + 0.01 * step),  # 0-d tensors are accepted
        "mismatch/logprob_abs_diff": 0.03 / step,
        "mismatch/logprob_abs_diff_max": 0.5,
        "mismatch/kl_k3": 1e-3 / step,
        "train/grad_norm": 1.0 + math.sin(step),
        "time/rollout_s": 10,
    }
    if step % 5 == 0:
        m["eval/accuracy"] = 0.5 + 0.02 * step
        m["eval/accuracy_t1"] = 0.3 + 0.02 * step
    return m


def test_log_writes_one_line_per_step_and_tensorboard(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=True) as log:
        for step in range(1, 4):
            log.log(step, _step_metrics(step))
            assert len((run / "metrics.jsonl").read_text().splitlines()) == step  # flushed per step
        with pytest.raises(ValueError, match="steps must increase"):
            log.log(3, {"reward/mean": 0.0})
        log.log(4, {"loss": float("nan")})
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["reward/accuracy"] == pytest.approx(0.26) and records[0]["time/rollout_s"] == 10
    assert math.isnan(records[3]["loss"])  # "nan" in the JSON file, a float again when read
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[3])["loss"] == "nan"
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_non_finite_values_reach_every_reader(tmp_path):
    """NaN / Inf are logged as the strings "nan" / "inf" (JSON has none); every reader sees floats again:
    the ablation summary counts them, TensorBoard gets them, plots draw the key (they vanished from all
    three). A line that is not a step record is refused by file and line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fp4rl import ablate

    run = tmp_path / "run"
    with MetricsLogger(run, tensorboard=True) as log:
        log.log(1, {"train/grad_norm": 1.0, "reward/mean": 0.5, "mismatch/kl_k3": 0.1})
        log.log(2, {"train/grad_norm": math.nan, "reward/mean": math.inf, "mismatch/kl_k3": math.nan})
    records = read_metrics(run)
    summary = ablate.summarize({"a": records, "b": records})
    assert summary["a"]["non-finite train/grad_norm"] == 1 and summary["a"]["steps"] == 2
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("mismatch/kl_k3")]
    assert got[0] == (1, pytest.approx(0.1)) and got[1][0] == 2 and math.isnan(got[1][1])
    assert plot(run)  # the keys are plottable (a NaN step is a gap)
    for bad in ("[1, 2]", '{"reward/mean": 0.5}', '{"step": "3"}'):
        (run / "metrics.jsonl").write_text('{"step": 1}\n' + bad + "\n")
        with pytest.raises(ValueError, match=r"metrics.jsonl:2: .* is not a step record"):
            read_metrics(run)


def test_new_run_refuses_to_overwrite(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, {"reward/mean": 1.0})
    with pytest.raises(FileExistsError, match="resume"):
        MetricsLogger(tmp_path, tensorboard=False)
    with MetricsLogger(tmp_path, tensorboard=False, overwrite=True) as log:
        log.log(1, {"reward/mean": 2.0})
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 2.0}]


def test_resume_truncates_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True) as log:
        for step in range(1, 8):
            log.log(step, {"reward/mean": float(step)})
    # crashed after step 7, last checkpoint at step 5: steps 6 and 7 are redone
    with MetricsLogger(tmp_path, tensorboard=True, resume_step=5) as log:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
        with pytest.raises(ValueError):
            log.log(5, {"reward/mean": 0.0})
        for step in (6, 7, 8):
            log.log(step, {"reward/mean": 10.0 + step})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[5]["reward/mean"] == 16.0
    # resuming a run that has no metrics yet starts empty
    with MetricsLogger(tmp_path / "fresh", tensorboard=False, resume_step=3) as log:
        log.log(4, {"reward/mean": 1.0})
    assert read_metrics(tmp_path / "fresh") == [{"step": 4, "reward/mean": 1.0}]


def test_resume_keeps_non_finite_values_valid_json_and_lists_are_logged(tmp_path):
    """A resume rewrites the kept records: the NaN / Inf read back as floats are written as the logger
    writes them ("nan"), not as bare NaN (not JSON); a list value is logged, not a TypeError."""
    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log(1, {"train/grad_norm": math.nan, "a": math.inf, "b": -math.inf, "lens": [3, 4]})
        log.log(2, {"train/grad_norm": 1.0, "names": ["x", "nan"]})
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=1):
        pass
    text = (tmp_path / "metrics.jsonl").read_text()
    line = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text!r}"))
    assert line == {"step": 1, "train/grad_norm": "nan", "a": "inf", "b": "-inf", "lens": [3, 4]}
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["train/grad_norm"]) and record["a"] == math.inf and record["b"] == -math.inf


def test_wandb_missing_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(RuntimeError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=True)


def test_format_progress():
    line = format_progress(
        {
            "reward/mean": 0.4567,
            "reward/accuracy": 0.375,
            "mismatch/logprob_abs_diff": 0.0123,
            "mismatch/kl_k3": 2.5e-4,
            "train/grad_norm": 0.81,
            "other": 1,
        }
    )
    assert line == "reward 0.457 acc 0.38 |dlp| 0.0123 kl 2.5e-04 gn 0.81"
    assert format_progress({}) == ""
    assert (
        format_progress({"eval/accuracy": 0.7, "eval/accuracy_t1": 0.55, "eval/other": 1})
        == "eval 0.70 eval_t1 0.55"
    )


def test_plot_draws_every_figure(tmp_path):
    run = tmp_path / "runs" / "synthetic"
    run.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, **{k: float(v) for k, v in _step_metrics(s).items()}}) for s in range(1, 21)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    written = plot(run)
    names = sorted(p.name for p in written)
    assert names == ["eval.png", "grad_norm.png", "mismatch.png", "reward.png"]
    for path in written:
        assert path.parent == run / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_plot_skips_missing_metrics_and_cli(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/grad_norm": 2.0}) + "\n")
    assert [p.name for p in plot(tmp_path)] == ["grad_norm.png"]

    class Args:
        run_dir = str(tmp_path)

    assert metrics_module.run(Args) == 0
    assert "grad_norm.png" in capsys.readouterr().out
    Args.run_dir = str(tmp_path / "metrics.jsonl")  # the metrics file itself: its run is plotted
    assert metrics_module.run(Args) == 0
    assert str(tmp_path / "plots" / "grad_norm.png") in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="run directory"):
        plot(tmp_path / "nope")


def test_resume_rewrite_is_atomic(tmp_path, monkeypatch):
    """The resume rewrite of metrics.jsonl (and config.toml, written the same way) goes through a renamed
    temporary file: a failure (a kill) before the rename leaves the old file whole and no temporary behind."""
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 5):
            log.log(step, {"reward/mean": float(step)})
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt  # what a kill between the write and the rename would leave

    monkeypatch.setattr(metrics_module.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()
    (tmp_path / "metrics.jsonl").chmod(0o640)
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2):
        pass
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "metrics.jsonl").stat().st_mode & 0o777 == 0o640  # its mode kept (not mkstemp's 0600)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path):
    """A write cut short (kill, full disk) leaves a last line without its newline that is not JSON: reading
    drops it with a warning naming the file, a resume's truncation rewrites the file without it, and the
    plot CLI draws; a damaged line elsewhere is refused with the file and line named."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:2: dropped its last line"):
        assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]
    with pytest.warns(UserWarning, match="dropped its last line"):
        assert [p.name for p in plot(tmp_path)] == ["reward.png"]
    with pytest.warns(UserWarning, match="dropped its last line"), \
            MetricsLogger(tmp_path, tensorboard=False, resume_step=1) as log:
        log.log(2, {"reward/mean": 0.75})
    assert path.read_text() == '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.75}\n'
    # a last record whose newline alone was lost is whole: kept
    path.write_text('{"step": 1}\n{"step": 2}')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    # not the last line, or the last line with its newline: damage, not a cut-short write
    for text in ('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n', '{"step": 1}\n{"step": 2, "r\n'):
        path.write_text(text)
        with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record .*damaged"):
            read_metrics(tmp_path)


def test_write_atomic_closes_and_removes_its_temporary_file_when_chmod_fails(tmp_path, monkeypatch):
    import os

    target = tmp_path / "config.toml"
    target.write_text("old\n")

    def refused(*args, **kwargs):
        raise PermissionError("chmod refused")

    fds_before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(metrics_module.os, "chmod", refused)
    for _ in range(3):
        with pytest.raises(PermissionError):
            metrics_module.write_atomic(target, "new\n")
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # no descriptor leaked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml"] and target.read_text() == "old\n"


def test_wandb_resumes_its_own_run(tmp_path, monkeypatch):
    """logging.wandb: the run's wandb id is kept in the run directory and passed again on resume (without an
    id every resume started a second wandb run of the same name)."""
    import types

    calls = []

    class Run:
        step = 0  # wandb's counter: the last step logged (a resumed run starts at its run's)

        def log(self, metrics, step):
            assert step >= Run.step, "wandb ignores a step below its counter, with a warning"
            Run.step = step
            calls.append(("log", step))

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["id"], kw["resume"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path / "run", tensorboard=False, wandb=True) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"a": float(step)})
    # killed after step 3, resumed from the checkpoint of step 1: steps 2 and 3 are redone; wandb has up to 3
    with MetricsLogger(tmp_path / "run", tensorboard=False, wandb=True, resume_step=1) as logger:
        for step in (2, 3, 4):
            logger.log(step, {"a": float(step)})
    first, second = calls[0], calls[4]
    assert first[0] == second[0] == "init" and first[1] == second[1] and first[2] == "allow"
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2, 3, 3, 4]
    assert (tmp_path / "run" / metrics_module.WANDB_ID_FILE).read_text().strip() == first[1]


def test_nan_inside_lists_and_arrays_and_a_run_named_like_a_file(tmp_path, monkeypatch):
    """NaN inside a list is written as JSON too ("nan"); an array metric is refused naming the key; a run
    directory whose name ends in .jsonl is a run directory; plotting leaves pyplot's backend alone."""
    import matplotlib

    with MetricsLogger(tmp_path / "v1.jsonl", tensorboard=False) as logger:
        logger.log(1, {"a/list": [1.0, math.nan], "reward/mean": 0.5})
        with pytest.raises(ValueError, match=r"metric 'b': a tensor/array of shape \(2,\)"):
            logger.log(2, {"b": torch.ones(2)})
    text = (tmp_path / "v1.jsonl" / "metrics.jsonl").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
    back = read_metrics(tmp_path / "v1.jsonl")[0]
    assert back["reward/mean"] == 0.5 and back["a/list"][0] == 1.0 and math.isnan(back["a/list"][1])
    matplotlib.use("svg")
    try:
        assert plot(tmp_path / "v1.jsonl")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use("Agg")


def test_cli_version_and_plot_of_another_jsonl(tmp_path, capsys):
    from fp4rl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("fp4rl ")
    (tmp_path / "other.jsonl").write_text('{"step": 1}\n')
    assert main(["plot", str(tmp_path / "other.jsonl")]) == 2
    assert "pass a run directory" in capsys.readouterr().err
