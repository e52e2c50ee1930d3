"""Resuming and stopping the RL loop on a tiny random model (configs/tiny.toml + a JSONL task): resume after
kill -9, Ctrl-C / SIGTERM or a stop request equals an uninterrupted run, sync and async (an async run resumed
with more steps too, from the rollouts its checkpoint holds past its last step); what --resume refuses or
warns about (no checkpoint, a checkpoint folder, fewer steps, other settings), and the run directory it
keeps. The rest of the loop: tests/test_loop.py (its helpers are shared)."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from rl_fixtures import TINY_CONFIG as TINY
from rl_fixtures import run_tiny, tiny_assets, tiny_sets
from test_loop import ROOT, deterministic

from fp4rl.config import ConfigError, load_config
from fp4rl.loop import main
from fp4rl.metrics import read_metrics
from fp4rl.trainer import list_checkpoints


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def _wait_for_step(path, step, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            if lines and lines[-1]["step"] >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before step {step}: "
                                 f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no step {step} in {path} after {timeout} s")


def _train_in_a_process(assets, tmp_path, name: str, sets: list[str]) -> subprocess.Popen:
    """`fp4rl train` of the tiny job in a process of its own (stderr captured as text)."""
    argv = [sys.executable, "-m", "fp4rl.loop", "--config", str(TINY)]
    for item in tiny_sets(assets, tmp_path, name, *sets):
        argv += ["--set", item]
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": path}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_after_kill_9_matches_an_uninterrupted_run(assets, tmp_path, mode):
    sets = ["trainer.steps=8", "trainer.checkpoint_every=1", f"loop.mode={mode}", "loop.max_staleness=2",
            "eval.at_start=true", "task.eval_every=3", "trainer.lr_schedule=cosine", "trainer.warmup_steps=2"]
    full = run_tiny(assets, tmp_path, "full", *sets)

    run_dir = tmp_path / "killed"
    proc = _train_in_a_process(assets, tmp_path, "killed", sets)
    try:
        _wait_for_step(run_dir / "metrics.jsonl", 3, proc)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -9, "the run finished before it could be killed"
    killed_at = read_metrics(run_dir)[-1]["step"]
    assert 3 <= killed_at < 8

    # what a kill during a checkpoint save leaves behind must not be taken for a checkpoint
    (run_dir / "checkpoints" / ".tmp-step_000099-x").mkdir()
    (run_dir / "checkpoints" / "step_000098").mkdir()
    assert main(["--resume", str(run_dir)]) == 0
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(9))  # no step lost or repeated
    assert deterministic(resumed) == deterministic(full)


@pytest.mark.parametrize("mode,sig", [("sync", "SIGINT"), ("async", "SIGTERM")])
def test_an_interrupted_run_checkpoints_its_last_step_and_resumes_exactly(assets, tmp_path, mode, sig):
    """Ctrl-C (or SIGTERM) with the default checkpointing (only after the last step): the run stops at the end
    of the step in progress with that step's checkpoint, exit 130 and the command to continue; the resumed
    run equals an uninterrupted one. Before, everything trained was lost and the run could not be resumed."""
    import signal

    sets = ["trainer.steps=6", f"loop.mode={mode}", "loop.max_staleness=1", "eval.at_start=true",
            "task.eval_every=2", "trainer.checkpoint_every=0"]
    full = run_tiny(assets, tmp_path, "full", *sets)
    run_dir = tmp_path / "stopped"
    proc = _train_in_a_process(assets, tmp_path, "stopped", sets)
    try:
        _wait_for_step(run_dir / "metrics.jsonl", 2, proc)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert 2 <= stopped_at < 6, "the run finished before it could be stopped"
    assert f"stopped after step {stopped_at}" in err and f"fp4rl train --resume {run_dir}" in err
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step_{stopped_at:06d}"]
    assert main(["--resume", str(run_dir)]) == 0
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(7))
    assert deterministic(resumed) == deterministic(full)


@pytest.mark.parametrize("at_start", [True, False])
def test_a_stop_request_ends_the_run_at_the_next_boundary(assets, tmp_path, monkeypatch, at_start):
    """A Ctrl-C that arrived before step 0's held-out eval ended ends the run right after it (nothing
    trained, a resume redoes the eval); without that eval, after step 1 with step 1's checkpoint."""
    from fp4rl import loop

    class Requested(loop.StopRequest):
        def __enter__(self):
            self.requested = "SIGINT"
            return self

    monkeypatch.setattr(loop, "StopRequest", Requested)
    sets = ["trainer.steps=3", "trainer.checkpoint_every=0", f"eval.at_start={str(at_start).lower()}"]
    with pytest.raises(loop.RunInterrupted) as stopped:
        run_tiny(assets, tmp_path, "stop", *sets)
    run_dir = tmp_path / "stop"
    if at_start:
        assert stopped.value.step == 0 and "nothing trained yet" in str(stopped.value)
        assert [r["step"] for r in read_metrics(run_dir)] == [0] and not list_checkpoints(run_dir)
    else:
        assert stopped.value.step == 1 and "after step 1 with its checkpoint written" in str(stopped.value)
        assert [p.name for p in list_checkpoints(run_dir)] == ["step_000001"]
    monkeypatch.undo()
    assert main(["--resume", str(run_dir)]) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == ([0] if at_start else []) + [1, 2, 3]


def test_resume_of_a_finished_run_changes_nothing(assets, tmp_path, capsys):
    records = run_tiny(assets, tmp_path, "done", "trainer.steps=2")
    run_dir = tmp_path / "done"
    assert main(["--resume", str(run_dir)]) == 0
    assert read_metrics(run_dir) == records
    # fewer steps than the checkpoint has done: refused, nothing rewritten (config.toml keeps steps = 2)
    config, metrics = (run_dir / "config.toml").read_bytes(), (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["--resume", str(run_dir), "--set", "trainer.steps=1"]) == 2
    assert "trainer.steps = 1: its newest checkpoint (step_000002)" in capsys.readouterr().err
    assert (run_dir / "config.toml").read_bytes() == config
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    # more steps: no warning; another setting: named (the run is no longer the uninterrupted one)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--resume", str(run_dir), "--set", "trainer.steps=3"]) == 0
    assert not [w for w in caught if "settings other than" in str(w.message)]
    with pytest.warns(UserWarning, match=r"step_000003 with settings other than it was trained with: "
                                         r"trainer.weight_decay 0.0 -> 0.5: the run continues with the new"):
        assert main(["--resume", str(run_dir), "--set", "trainer.steps=4",
                     "--set", "trainer.weight_decay=0.5"]) == 0
    assert load_config(run_dir / "config.toml").trainer.weight_decay == 0.5


def test_resume_without_a_checkpoint_refuses_to_drop_metrics(assets, tmp_path, capsys):
    """Killed before its first checkpoint (checkpoint_every = 0, the default, writes one only after the last
    step) with metrics logged: --resume is refused before anything is written, naming the fixes, and the
    metrics stay. Stopped before step 1 (a config, no metrics, no checkpoint): it starts over with a warning,
    losing nothing, also when the only line is one cut short."""
    records = run_tiny(assets, tmp_path, "killed", "trainer.steps=2", "trainer.checkpoint_every=0")
    run_dir = tmp_path / "killed"
    shutil.rmtree(run_dir / "checkpoints")
    config, metrics = (run_dir / "config.toml").read_bytes(), (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    for part in ("holds the records of steps 1..2 but there is no checkpoint", "trainer.checkpoint_every = 0",
                 "move the run directory away", "another run.name", "trainer.checkpoint_every > 0"):
        assert part in err
    assert (run_dir / "config.toml").read_bytes() == config
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert not (run_dir / "checkpoints").exists()

    # a damaged metrics.jsonl: refused before anything is loaded or written, --set values not saved
    (run_dir / "metrics.jsonl").write_text('not json\n{"step": 1}\n')
    assert main(["--resume", str(run_dir), "--set", "trainer.lr=1.0"]) == 2
    assert "metrics.jsonl:1: not a JSON record" in capsys.readouterr().err
    assert (run_dir / "config.toml").read_bytes() == config

    (run_dir / "metrics.jsonl").write_text('{"step": 1, "rew')  # nothing whole was logged
    with pytest.warns(UserWarning, match="no checkpoint and no trained step there .*starts at step 1"):
        assert main(["--resume", str(run_dir)]) == 0
    assert deterministic(read_metrics(run_dir)) == deterministic(records)


def test_resume_refuses_a_checkpoint_folder_a_missing_run_and_a_quoted_run_key(assets, tmp_path, capsys):
    """--resume on a checkpoint (runs/x/checkpoints/step_N) is refused and names the run folder (before, it
    started a new run from the base model inside the checkpoint, rewriting its config.toml); run.resume = true
    on a run folder that holds nothing is refused (a typo in run.name used to start a fresh run); a quoted
    '"run".name' override is a run key too; a fresh run over a folder with metrics but no checkpoint is told
    it cannot be resumed, not to --resume it."""
    run_tiny(assets, tmp_path, "base", "trainer.steps=2", "trainer.checkpoint_every=1")
    run_dir = tmp_path / "base"
    step = run_dir / "checkpoints" / "step_000002"
    config = (step / "config.toml").read_bytes()
    capsys.readouterr()
    assert main(["--resume", str(step)]) == 2
    err = capsys.readouterr().err
    assert f"is a checkpoint of the run {run_dir}" in err and f"fp4rl train --resume {run_dir}" in err
    assert (step / "config.toml").read_bytes() == config and not (step / "metrics.jsonl").exists()
    assert main(["--resume", str(run_dir), "--set", '"run".name=other']) == 2
    assert "cannot change that" in capsys.readouterr().err and not (tmp_path / "other").exists()
    # a run folder that holds nothing: started, with a warning (a job that always resumes, requeued or not)
    with pytest.warns(UserWarning, match=r"run.resume = true but .*typo holds no run .*check run.dir"):
        run_tiny(assets, tmp_path, "typo", "run.resume=true", "trainer.steps=1")
    # a run directory inside a folder that happens to be named "checkpoints" is a run, not a checkpoint
    run_tiny(assets, tmp_path / "checkpoints", "inner", "trainer.steps=1")
    assert main(["--resume", str(tmp_path / "checkpoints" / "inner"), "--set", "trainer.steps=2"]) == 0
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(FileExistsError, match="no checkpoint to continue from .*move it away"):
        run_tiny(assets, tmp_path, "base", "trainer.steps=2")


def test_extending_a_run_under_a_decaying_schedule_warns(assets, tmp_path):
    """trainer.steps may change on --resume, but a linear / cosine schedule spans it: the learning rates from
    there on differ from both runs', which is said (a constant schedule extends exactly, silently)."""
    sets = ["trainer.steps=2", "trainer.checkpoint_every=1"]
    run_tiny(assets, tmp_path, "lin", *sets, "trainer.lr_schedule=linear")
    with pytest.warns(UserWarning, match=r"trainer.steps 2 -> 3 under trainer.lr_schedule = 'linear'"):
        assert main(["--resume", str(tmp_path / "lin"), "--set", "trainer.steps=3"]) == 0
    run_tiny(assets, tmp_path, "const", *sets)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--resume", str(tmp_path / "const"), "--set", "trainer.steps=3"]) == 0
    assert not [w for w in caught if "lr_schedule" in str(w.message)]


def test_a_run_killed_during_step_1_resumes_from_its_step_0_eval(assets, tmp_path, capsys):
    """Killed after the at-start eval (step 0's record) but before step 1's checkpoint: the eval is redone
    exactly and the run continues (it was refused as 'metrics without a checkpoint', advising
    checkpoint_every > 0 even when it was 1)."""
    sets = ("trainer.steps=2", "trainer.checkpoint_every=1", "eval.at_start=true")
    records = run_tiny(assets, tmp_path, "early", *sets)
    run_dir = tmp_path / "early"
    assert records[0]["step"] == 0
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.warns(UserWarning, match="no trained step there"):
        assert main(["--resume", str(run_dir)]) == 0
    assert deterministic(read_metrics(run_dir)) == deterministic(records)
    # with a trained step's record and no checkpoint it is refused, without advising the setting it has
    shutil.rmtree(run_dir / "checkpoints")
    capsys.readouterr()
    assert main(["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "steps 1..2 but there is no checkpoint" in err and "checkpoint_every > 0" not in err


def _in_thread(fn, *args, timeout=120):
    """fn(*args) in a daemon thread: its result, or a failure (not a hung test session) after `timeout` s."""
    out = {}

    def target():
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # re-raised below
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn.__name__}{args} still running after {timeout} s: hung"
    if "error" in out:
        raise out["error"]
    return out["result"]


def _weights(checkpoint):
    from fp4rl.hf import load_state_dict

    return load_state_dict(checkpoint)


@pytest.mark.parametrize("staleness,from_last,trace", [(1, True, False), (2, True, False), (2, False, False),
                                                      (1, True, True)])
def test_async_resume_with_more_steps_matches_an_uninterrupted_run(assets, tmp_path, staleness, from_last,
                                                                   trace):
    """An async run of 3 steps resumed with trainer.steps = 5 (from its final checkpoint, or from the
    one before when the final one is lost; TRACE on or off) equals one run of 5 steps: metrics and
    weights. The final checkpoint stores the rollouts of steps 4 .. 3 + k, sampled by versions
    3 - k .. 2, which the resumed sampler (at version 3) cannot make any more (without them the resumed
    run hung). Resuming with an equal or smaller trainer.steps changes nothing."""
    sets = ["trainer.checkpoint_every=1", "loop.mode=async", f"loop.max_staleness={staleness}",
            "eval.at_start=true", "task.eval_every=3",  # both runs evaluate after step 3
            f"precision.trace={str(trace).lower()}"]
    full = run_tiny(assets, tmp_path, "full", "trainer.steps=5", *sets)
    run_tiny(assets, tmp_path, "short", "trainer.steps=3", *sets)
    run_dir = tmp_path / "short"
    if not from_last:  # as if killed while writing the final checkpoint
        shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    assert _in_thread(main, ["--resume", str(run_dir), "--set", "trainer.steps=5"]) == 0
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(6))
    assert deterministic(resumed) == deterministic(full)
    got, want = _weights(list_checkpoints(run_dir)[-1]), _weights(list_checkpoints(tmp_path / "full")[-1])
    assert list_checkpoints(run_dir)[-1].name == "step_000005" and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)

    for steps, code in ((5, 0), (4, 2)):  # nothing left to do: the run ends at once; fewer steps: refused
        assert _in_thread(main, ["--resume", str(run_dir), "--set", f"trainer.steps={steps}"]) == code
        assert read_metrics(run_dir) == resumed
    assert load_config(run_dir / "config.toml").trainer.steps == 5


def test_async_checkpoint_without_the_rollouts_past_the_last_step(assets, tmp_path, capsys):
    """A checkpoint written before final checkpoints stored the rollouts past trainer.steps (after step 2
    of 3, k = 2: step 3's only) still resumes to its run's end, exactly; raising trainer.steps past what
    it holds is refused before any step, not hung (the resumed sampler cannot go back to version 1)."""
    sets = ["trainer.steps=3", "trainer.checkpoint_every=1", "loop.mode=async", "loop.max_staleness=2",
            "task.eval_every=0"]
    records = run_tiny(assets, tmp_path, "old", *sets)
    run_dir = tmp_path / "old"
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    state_file = list_checkpoints(run_dir)[-1] / "trainer.pt"
    state = torch.load(state_file, weights_only=False)
    assert sorted(state["extra"]["pending_rollouts"]) == [3, 4]
    del state["extra"]["pending_rollouts"][4]  # as the old code wrote it
    torch.save(state, state_file)
    assert _in_thread(main, ["--resume", str(run_dir)]) == 0
    assert deterministic(read_metrics(run_dir)) == deterministic(records)
    capsys.readouterr()
    assert _in_thread(main, ["--resume", str(run_dir), "--set", "trainer.steps=4"]) == 2
    assert "step 4 trains on one of policy version 1" in capsys.readouterr().err
    assert deterministic(read_metrics(run_dir)) == deterministic(records)
    # a larger loop.max_staleness: step 4 would need version 4 - 1 - 3 = 0, refused the same way
    assert _in_thread(main, ["--resume", str(run_dir), "--set", "trainer.steps=4",
                             "--set", "loop.max_staleness=3"]) == 2
    assert "loop.max_staleness = 3" in capsys.readouterr().err


def test_resume_keeps_the_run_dir_its_config_names(tmp_path, monkeypatch):
    """--resume RUN_DIR keeps config.toml's own run.dir / run.name when they name RUN_DIR (so `fp4rl ablate`
    still recognises an arm resumed by hand), takes RUN_DIR's location when the run was moved, and refuses
    --set run.dir / run.name / run.resume, which it would silently override."""
    from types import SimpleNamespace

    from fp4rl.config import dump_toml, save_config
    from fp4rl.loop import config_from_args

    monkeypatch.chdir(tmp_path)
    saved = load_config(None, ["run.dir=runs", "run.name=arm", "trainer.lr=3e-3"])
    save_config(saved, tmp_path / "runs" / "arm" / "config.toml")

    def resume(path, *sets):
        return config_from_args(SimpleNamespace(resume=str(path), config=None, overrides=list(sets)))

    c = resume("runs/arm")
    assert (c.run.dir, c.run.name, c.run.resume) == ("runs", "arm", True)
    assert dump_toml(load_config(None, [])) != dump_toml(c) and c.trainer.lr == 3e-3
    assert resume(tmp_path / "runs" / "arm").run.dir == "runs"  # the same directory, named absolutely
    (tmp_path / "moved").mkdir()
    (tmp_path / "runs" / "arm").rename(tmp_path / "moved" / "arm2")
    c = resume("moved/arm2")
    assert (c.run.dir, c.run.name) == (str(tmp_path / "moved"), "arm2")
    with pytest.raises(ConfigError, match="run.name=other cannot change that"):
        resume("moved/arm2", "run.name=other")
