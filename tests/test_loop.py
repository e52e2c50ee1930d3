"""The RL loop end to end on a tiny random model (configs/tiny.toml + a JSONL task): sync and
async (staleness bounded and recorded), resume after kill -9 equals an uninterrupted run,
a golden metrics trace, and config errors.

Golden trace: tests/golden/tiny_sync.json holds the metrics of a fixed-seed tiny run. After an
intended change of the numbers (sampler, quantizer, loss...), regenerate it with
    FP4RL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_loop.py -k golden
and say why in the commit.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from rl_fixtures import TINY_CONFIG as TINY
from rl_fixtures import run_tiny, tiny_assets, tiny_sets

from fp4rl.config import ConfigError, load_config
from fp4rl.loop import main, train
from fp4rl.metrics import read_metrics
from fp4rl.trainer import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_sync.json"
GOLDEN_SETS = ["trainer.steps=4", "sampler.n=4", "eval.at_start=true", "task.eval_every=2",
               "trainer.lr=3e-3", "trainer.seed=1", "model.device=cpu"]  # CPU numbers, also on a GPU host
NON_DETERMINISTIC = ("time/", "memory/")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory.mktemp("assets"))


def deterministic(records):
    return [{k: v for k, v in r.items() if not k.startswith(NON_DETERMINISTIC)} for r in records]


def test_sync_run_logs_the_design_keys(assets, tmp_path):
    records = run_tiny(assets, tmp_path, "sync", "trainer.steps=3", "eval.at_start=true",
                       "eval.temperatures=[0.0, 1.0]")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert set(records[0]) >= {"eval/accuracy", "eval/accuracy_t1"} and records[0]["policy_version"] == 0
    for r in records[1:]:
        assert r["policy_version"] == r["step"]
        assert r["rollout/staleness_max"] == 0 and r["rollout/policy_version"] == r["step"] - 1
        keys = {"reward/mean", "reward/accuracy", "response/length_mean", "time/rollout_s", "time/train_s",
                "time/sync_s", "sync/bytes", "memory/peak_bytes", "eval/accuracy", "eval/accuracy_t1"}
        assert keys <= set(r), keys - set(r)
        assert r["sync/bytes"] > 0 and r["memory/peak_bytes"] > 0
        if r["train/sequences"]:
            assert {"mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff_max", "mismatch/kl_k3",
                    "mismatch/tis_clip_frac", "train/grad_norm", "train/loss"} <= set(r)
            assert math.isfinite(r["mismatch/logprob_abs_diff"]) and r["mismatch/kl_k3"] >= 0
    assert any(r.get("train/sequences", 0) > 0 for r in records)
    run_dir = tmp_path / "sync"
    assert load_config(run_dir / "config.toml").trainer.steps == 3
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000002", "step_000003"]  # keep 2
    assert (run_dir / "plots" / "reward.png").is_file()


def test_async_scores_in_the_trainers_thread_and_an_untrained_step_still_measures(assets, tmp_path):
    """An async run whose task has the JSONL default reward, math-verify (its timeouts use signal.alarm, which
    only works in the main thread: scored in the rollout thread, the first rollout failed). On the tiny
    model it scores 0 everywhere, so every group is dropped and no step trains: each step still logs the
    DESIGN keys, the mismatch measured on the whole rollout and a zero gradient."""
    prompts = tmp_path / "prompts.jsonl"  # an answer the tiny vocabulary (digits as words) cannot write
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "answer": "1/7"}) + "\n"
                               for i in range(40)))
    sets = [s for s in tiny_sets(assets, tmp_path, "mv") if not s.startswith("task.kwargs=")]
    sets += [f"task.kwargs={{path = {json.dumps(str(prompts))}}}", "trainer.steps=2", "loop.mode=async",
             "loop.max_staleness=1", "task.eval_size=0"]
    records = train(load_config(TINY, sets))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward/mean"] == 0.0 and r["train/sequences"] == 0
        assert r["train/grad_norm"] == 0.0 and r["train/loss"] == 0.0
        assert 0 < r["mismatch/logprob_abs_diff"] < 1 and r["mismatch/kl_k3"] >= 0
        assert "mismatch/tis_clip_frac" in r


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_in_process_weight_sync_hashes_nothing(assets, tmp_path, monkeypatch, mode):
    """The loop's samplers live in its process: its payloads are unsealed (build_payload(seal=False)), and no
    checksum is computed to build or load them (on an H200 the two hashing passes took 0.85 s of the default
    job's 1.29 s step, bench/RESULTS.md twenty-fifth session)."""
    from fp4rl import weight_sync
    hashed = []
    real = weight_sync.tensor_checksum
    monkeypatch.setattr(weight_sync, "tensor_checksum", lambda n, t: hashed.append(n) or real(n, t))
    sets = ["trainer.steps=2", "task.eval_every=1"] + (["loop.mode=async", "loop.max_staleness=1"]
                                                        if mode == "async" else [])
    records = run_tiny(assets, tmp_path, mode, *sets)
    assert [r["policy_version"] for r in records if r["step"] > 0] == [1, 2]
    assert all(r["time/sync_s"] >= 0 for r in records if r["step"] > 0)
    assert hashed == []


def test_a_bfloat16_sampler_is_a_config_key(assets, tmp_path):
    """sampler.dtype=bfloat16 samples in BF16 (the fast CPU path) while the master weights stay
    FP32: the run works and its sampler/trainer mismatch shows the BF16 rounding."""
    sets = ("trainer.steps=2", "task.eval_every=0", "precision.preset=\"nvfp4-w4a16\"")  # W4A16, FP32 trainer
    fp32 = run_tiny(assets, tmp_path, "fp32", *sets)
    bf16 = run_tiny(assets, tmp_path, "bf16", *sets, "sampler.dtype=bfloat16")
    diff = [r["mismatch/logprob_abs_diff"] for r in bf16 if "mismatch/logprob_abs_diff" in r]
    base = [r["mismatch/logprob_abs_diff"] for r in fp32 if "mismatch/logprob_abs_diff" in r]
    assert diff and base and all(math.isfinite(d) for d in diff)
    assert min(diff) > 2 * max(base)  # measured ~4x on this tiny model


def test_bfloat16_master_weights_warn_that_small_updates_round_away(assets, tmp_path):
    with pytest.warns(UserWarning, match="model.dtype = 'bfloat16'.*rounds away"):
        records = run_tiny(assets, tmp_path, "bf16_master", "trainer.steps=1", "task.eval_every=0",
                           "model.dtype=bfloat16")
    assert any("train/loss" in r for r in records)


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_staleness_is_bounded_and_recorded(assets, tmp_path, staleness):
    records = run_tiny(assets, tmp_path, f"async{staleness}", "trainer.steps=5", "loop.mode=async",
                       f"loop.max_staleness={staleness}", "task.eval_every=0")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for r in steps:
        s = r["step"]
        assert r["rollout/policy_version"] == max(0, s - 1 - staleness)
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == min(s - 1, staleness)
        assert r["policy_version"] == s
    assert "eval/accuracy" in steps[-1] and "eval/accuracy" not in steps[0]
    # the same run again gives the same numbers: thread timing does not enter
    again = run_tiny(assets, tmp_path, f"async{staleness}-again", "trainer.steps=5", "loop.mode=async",
                     f"loop.max_staleness={staleness}", "task.eval_every=0")
    assert deterministic(again) == deterministic(records)


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


def test_generate_samples_a_run_in_its_precision(assets, tmp_path, monkeypatch, capsys):
    """`fp4rl generate --model RUN` (or one of its checkpoints): the run's newest weights, quantized as the
    run trained them (its config.toml's contract), the tokenizer of its model.name. Before, a run folder was
    "no config.json" and a checkpoint "no tokenizer", and one given a tokenizer sampled in BF16."""
    from rl_fixtures import record_sampler_modes

    from fp4rl.cli import main as cli

    run_tiny(assets, tmp_path, "gen", "trainer.steps=1", "precision.preset=nvfp4-linear")
    seen = record_sampler_modes(monkeypatch)
    run_dir = tmp_path / "gen"
    argv = ["generate", "--prompt", "w1 w2", "--max-new-tokens", "3", "--seed", "1"]
    capsys.readouterr()
    assert cli(argv + ["--model", str(run_dir)]) == 0
    first = capsys.readouterr()
    assert "step_000001: the run's weights in its precision (nvfp4-linear)" in first.err
    assert cli(argv + ["--model", str(run_dir / "checkpoints" / "step_000001")]) == 0
    assert capsys.readouterr().out == first.out  # the same weights, precision and seed
    assert cli(argv + ["--model", str(run_dir), "--precision", "bf16"]) == 0
    assert seen == [["w4a4"], ["w4a4"], []]
    for bad, says in ((["--greedy", "--temperature", "0.5"], "--temperature 0.5 would do nothing"),
                      (["--greedy", "--n", "2"], "2 identical completions")):
        with pytest.raises(SystemExit, match=says):
            cli(argv + ["--model", str(run_dir), *bad])


def test_a_plotting_failure_does_not_fail_a_finished_run(assets, tmp_path, monkeypatch):
    from fp4rl import loop

    def broken(run_dir):
        raise OSError("disk full")

    monkeypatch.setattr(loop, "plot", broken)
    with pytest.warns(UserWarning, match=r"plotting .* failed \(OSError: disk full\); the run is complete"):
        records = run_tiny(assets, tmp_path, "plotless", "trainer.steps=1")
    assert records[-1]["step"] == 1


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


def _close(a, b, rel, abs_tol):
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)
    return a == b


def test_golden_trace(assets, tmp_path):
    """Rewards, eval accuracy, lengths and counts exactly; losses, norms and mismatch within 1e-3
    (relative): a change of the sampler, quantizer or loss that moves any sampled token shows."""
    records = deterministic(run_tiny(assets, tmp_path, "golden", *GOLDEN_SETS))
    if os.environ.get("FP4RL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"config": "configs/tiny.toml + tests/rl_fixtures.py tiny model/task",
                                      "sets": GOLDEN_SETS, "records": records}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["sets"] == GOLDEN_SETS
    assert [sorted(r) for r in records] == [sorted(r) for r in golden["records"]]
    exact = ("step", "policy_version", "reward/", "eval/", "response/", "rollout/", "train/sequences",
             "train/tokens", "sync/")
    for got, want in zip(records, golden["records"]):
        for key, value in want.items():
            if key.startswith(exact):
                assert got[key] == value, (got["step"], key)
            else:
                assert _close(got[key], value, 1e-3, 1e-6), (got["step"], key, got[key], value)
    assert any(r.get("train/sequences", 0) > 0 for r in records)


def test_config_errors_name_the_key(tmp_path, capsys, assets):
    assert main(["--set", "trainer.lr=-1"]) == 2
    assert "trainer.lr = -1.0: must be > 0" in capsys.readouterr().err
    assert main(["--set", "trainer.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path / "nope")]) == 2
    assert "no config.toml" in capsys.readouterr().err
    assert main(["--resume", str(tmp_path), "--config", str(TINY)]) == 2
    assert "--resume RUN_DIR reads RUN_DIR/config.toml" in capsys.readouterr().err
    assert main(["--help-config"]) == 0
    assert "trainer.checkpoint_keep" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="precision.trace"):  # TRACE guides W4A4 linears: W4A16 has none
        run_tiny(assets, tmp_path, "trace", "precision.trace=true", "precision.preset=nvfp4-w4a16")
    assert main(["--config", str(TINY), *sum((["--set", x] for x in tiny_sets(
        assets, tmp_path, "trace", "precision.trace=true", "precision.preset=nvfp4-w4a16")), [])]) == 2
    assert "precision.trace" in capsys.readouterr().err
    # rules that make no dense linear W4A4 (TRACE would guide nothing): refused at load time, or once the
    # model is converted when a W4A4 rule matches no dense linear; before any file is written either way
    with pytest.raises(ConfigError, match="precision.trace"):
        run_tiny(assets, tmp_path, "trace_rules", "precision.trace=true", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"lm_head" = "bf16"}')
    # (the tiny model ties lm_head to its embeddings: its only linear a rule could make W4A4 here is refused
    # as such, by the contract, before the TRACE check)
    with pytest.raises(ValueError, match=r"lm_head resolves to w4a4 but is tied to embed_tokens"):
        run_tiny(assets, tmp_path, "trace_rules", "precision.trace=true", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"lm_head" = "w4a4"}')
    assert not (tmp_path / "trace_rules").exists()
    if not torch.cuda.is_available():  # a CUDA device asked for where there is none: named before loading
        with pytest.raises(ConfigError, match="model.device = 'cuda' but torch sees no CUDA device"):
            run_tiny(assets, tmp_path, "cuda", "model.device=cuda")
    try:
        import wandb  # noqa: F401
    except ImportError:  # wandb asked for, not installed: named before loading (a traceback after it)
        with pytest.raises(ConfigError, match="logging.wandb = true but wandb is not installed"):
            run_tiny(assets, tmp_path, "wandb", "logging.wandb=true")
        assert not (tmp_path / "wandb").exists()
    with pytest.raises(ValueError, match="sampler.temperature"):
        run_tiny(assets, tmp_path, "greedy", "sampler.temperature=0")
    for key in ("sampler.max_new_tokens", "eval.max_new_tokens"):  # before the step-0 eval, naming the key
        with pytest.raises(ConfigError, match=f"{key} = 100000 leaves no room for a prompt .*lower {key}"):
            run_tiny(assets, tmp_path, "long", f"{key}=100000", "eval.at_start=true")
        assert not (tmp_path / "long" / "metrics.jsonl").exists()
    run_tiny(assets, tmp_path, "twice", "trainer.steps=1")
    with pytest.raises(FileExistsError, match="--resume"):
        run_tiny(assets, tmp_path, "twice", "trainer.steps=1")
    capsys.readouterr()
    assert main(["--config", str(TINY), *sum((["--set", x] for x in tiny_sets(
        assets, tmp_path, "twice", "trainer.steps=1")), [])]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
def test_default_job_learns_beyond_the_seed_spread(tmp_path):
    """`make run`'s config, three seeds side by side (one torch thread each): held-out greedy
    accuracy after training beats the accuracy before by more than the spread between seeds.
    Run with: .venv/bin/python -m pytest -m slow tests/test_loop.py -k default_job -s"""
    seeds = (0, 1, 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    start = time.monotonic()
    for seed in seeds:
        argv = [sys.executable, "-m", "fp4rl.loop", "--config", str(ROOT / "configs" / "default.toml"),
                "--set", f"run.dir={json.dumps(str(tmp_path))}", "--set", f"run.name=s{seed}",
                "--set", f"trainer.seed={seed}", "--set", "logging.progress=false"]
        log = open(tmp_path / f"s{seed}.log", "w")  # noqa: SIM115 (closed with the process)
        procs[seed] = (subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    for seed, (proc, log) in procs.items():
        code = proc.wait()
        log.close()
        assert code == 0, (tmp_path / f"s{seed}.log").read_text()[-3000:]
    before, after = {}, {}
    for seed in seeds:
        evals = [r for r in read_metrics(tmp_path / f"s{seed}") if "eval/accuracy" in r]
        before[seed], after[seed] = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
        print(f"seed {seed}: held-out greedy accuracy {before[seed]:.2f} -> {after[seed]:.2f}")
    print(f"{len(seeds)} runs side by side: {(time.monotonic() - start) / 60:.1f} min")
    spread = max(after.values()) - min(after.values())
    assert len(set(before.values())) == 1  # greedy decoding of one initial model: seed-independent
    assert min(after[s] - before[s] for s in seeds) > spread, (before, after)


def test_trace_guides_the_trainer_towards_the_samplers_codes(assets, tmp_path):
    """TRACE on the tiny W4A4 job: the same first rollout (same weights, same seed) scored with and
    without guided rounding; the guided trainer reproduces the sampler's codes in the guided layers and
    its logprobs come much closer to the sampler's. The guidance of a checkpointed rollout (async mode's
    pending ones) survives the checkpoint's plain-data round trip."""
    from fp4rl.rollout import Rollout
    from fp4rl.tasks import task_from_config

    plain = run_tiny(assets, tmp_path, "plain", "trainer.steps=2")
    guided = run_tiny(assets, tmp_path, "guided", "trainer.steps=2", "precision.trace=true")
    for r in guided:
        assert {"trace/code_disagree_rtn", "trace/code_disagree_guided",
                "trace/cache_bytes_per_token"} <= set(r)
        assert 0 < r["trace/code_disagree_rtn"] < 1  # some round-to-nearest codes changed, not all
        assert 0 <= r["trace/code_disagree_guided"] < r["trace/code_disagree_rtn"]
        assert r["trace/cache_bytes_per_token"] > 0
    # every W4A4 layer guided (the default): 0.002 vs 0.11 on this job
    assert guided[0]["mismatch/logprob_abs_diff"] < 0.1 * plain[0]["mismatch/logprob_abs_diff"]
    deep = run_tiny(assets, tmp_path, "deep", "trainer.steps=1", "precision.trace=true",
                    "precision.trace_deep_fraction=0.5")  # the deep half only: fewer bytes, less effect
    assert deep[0]["trace/cache_bytes_per_token"] < guided[0]["trace/cache_bytes_per_token"]
    assert guided[0]["mismatch/logprob_abs_diff"] < deep[0]["mismatch/logprob_abs_diff"] < plain[0][
        "mismatch/logprob_abs_diff"]
    assert "trace/code_disagree_rtn" not in plain[0]

    from fp4rl.hf import load_model
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler, SamplingParams

    config = load_config(TINY, tiny_sets(assets, tmp_path, "rt", "precision.trace=true"))
    task = task_from_config(config.task)
    model, _ = load_model(config.model.name)
    sampler = Sampler(convert(model, PrecisionContract("nvfp4-linear")), eos_token_ids=[])
    prompts = task.batch(0, 2)
    completions = sampler.generate([[5, 6, 7], [8, 9]],
                                   SamplingParams(n=2, max_new_tokens=4, guidance=1.0, seed=0))
    for c in completions:
        assert c.guidance and all(g["amax"].shape[0] == len(c.prompt_ids) + len(c.completion_ids) - 1
                                  for g in c.guidance.values())
    back = Rollout.from_state_dict(Rollout(1, prompts, completions, None, 0.0).state_dict(), task, 2)
    for a, b in zip(completions, back.completions):
        assert a.guidance.keys() == b.guidance.keys()
        for k in a.guidance:
            for f in ("bits", "block_scale", "amax"):
                x, y = a.guidance[k][f], b.guidance[k][f]
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


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


def test_trace_guides_the_routed_experts_of_the_recipe(tmp_path):
    """TRACE on an MoE model under the recipe's preset (nvfp4-experts: the routed experts are its only W4A4
    linears): the job runs, logs the guidance counters, and the guided trainer scores the rollout closer
    to the sampler than the unguided one."""
    from rl_fixtures import save_tiny_model, write_prompts

    assets = (save_tiny_model(tmp_path / "moe_model", moe=True), write_prompts(tmp_path / "prompts.jsonl"))
    sets = ("trainer.steps=1", "precision.preset=nvfp4-experts", "precision.bf16_last_fraction=0.0")
    plain = run_tiny(assets, tmp_path, "moe_plain", *sets)
    guided = run_tiny(assets, tmp_path, "moe_guided", *sets, "precision.trace=true")
    r = guided[-1]
    assert r["trace/cache_bytes_per_token"] > 0 and 0 <= r["trace/code_disagree_rtn"] < 1
    assert "trace/code_disagree_rtn" not in plain[-1]
    # 0.0049 vs 0.033 on this job (k3 KL 2.6e-5 vs 1.3e-3)
    assert r["mismatch/logprob_abs_diff"] < 0.3 * plain[-1]["mismatch/logprob_abs_diff"], (r, plain[-1])
    # rules that quantize one layer's experts unalike: refused before any rollout, naming the fix
    with pytest.raises(ConfigError, match="every expert of a layer must quantize"):
        run_tiny(assets, tmp_path, "moe_mixed", "trainer.steps=1", "precision.preset=nvfp4-w4a16",
                 'precision.rules={"*.experts.0.*" = "w4a4"}', "precision.trace=true")
