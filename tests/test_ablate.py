"""`fp4rl ablate` on the tiny job: arms parsed and checked, every arm run as its own run directory with
the same seeds, a summary of all of them; a finished ablation is read back without training, an
unfinished arm resumes from its checkpoint to the records of an uninterrupted run, and a run directory
holding another config is refused."""

import json
import math

import pytest
from test_loop import TINY, assets, deterministic, tiny_sets  # noqa: F401  (assets: a fixture)

from fp4rl import ablate
from fp4rl.cli import main as cli_main
from fp4rl.config import ConfigError, load_config, save_config
from fp4rl.metrics import read_metrics
from fp4rl.trainer import list_checkpoints


def test_arms_are_parsed_and_checked():
    base = load_config(TINY)  # precision.preset = nvfp4-linear
    assert ablate.parse_arms([], None, base) == {"bf16": ["precision.preset=bf16"],
                                                  "nvfp4-linear": ["precision.preset=nvfp4-linear"]}
    assert ablate.parse_arms([], "bf16,nvfp4-w4a16", base) == {
        "bf16": ["precision.preset=bf16"], "nvfp4-w4a16": ["precision.preset=nvfp4-w4a16"]}
    assert ablate.parse_arms(["a:trainer.lr=1e-4,grpo.kl_coef=0.1", "b:trainer.lr=1e-5"], None, base) == {
        "a": ["trainer.lr=1e-4", "grpo.kl_coef=0.1"], "b": ["trainer.lr=1e-5"]}
    # list and table values keep their commas (they were split into 'trainer.betas=[0.9' and '0.95]')
    arms = ablate.parse_arms(["a:trainer.betas=[0.9, 0.95],trainer.lr=1e-4",
                              "b:task.kwargs={max_digits = 2, min_digits = 2}",
                              "c:task.suffix=\"a, b\",eval.temperatures=[0.0,1.0]"], None, base)
    assert arms == {"a": ["trainer.betas=[0.9, 0.95]", "trainer.lr=1e-4"],
                    "b": ["task.kwargs={max_digits = 2, min_digits = 2}"],
                    "c": ['task.suffix="a, b"', "eval.temperatures=[0.0,1.0]"]}
    assert load_config(TINY, arms["a"]).trainer.betas == [0.9, 0.95]
    with pytest.raises(ConfigError, match="not a precision preset"):
        ablate.parse_arms([], "bf16,nvfp5", base)
    with pytest.raises(ConfigError, match="NAME:KEY=VALUE"):
        ablate.parse_arms(["no-colon"], None, base)
    with pytest.raises(ConfigError, match="two arms"):
        ablate.parse_arms(["only:trainer.lr=1e-4"], None, base)
    with pytest.raises(ConfigError, match="two arms"):
        ablate.parse_arms([], None, load_config(TINY, ["precision.preset=bf16"]))
    # the arm `ablate` would train into the summary directory; run.* keys are ablate's to set
    with pytest.raises(ConfigError, match="cannot be named 'ablate'"):
        ablate.parse_arms(["ablate:trainer.lr=1e-4", "b:trainer.lr=1e-5"], None, base)
    with pytest.raises(ConfigError, match="run.name=x: an arm cannot set run"):
        ablate.parse_arms(["a:trainer.lr=1e-4,run.name=x", "b:trainer.lr=1e-5"], None, base)
    with pytest.raises(ConfigError, match="run.dir=/tmp/x"):
        ablate.parse_arms(["a:run.dir=/tmp/x", "b:trainer.lr=1e-5"], None, base)


def test_a_quote_inside_a_word_or_an_unbalanced_one_does_not_swallow_the_spec():
    base = load_config(TINY)
    # an apostrophe inside a bare value is a character, not the start of a string
    arms = ablate.parse_arms(["b:task.suffix=Don't guess.,sampler.n=4", "c:task.suffix=\"Don't, guess\""],
                             None, base)
    assert arms == {"b": ["task.suffix=Don't guess.", "sampler.n=4"], "c": ['task.suffix="Don\'t, guess"']}
    assert load_config(TINY, arms["b"]).task.suffix == "Don't guess."
    assert ablate.parse_arms(['d:task.suffix="say \\"hi, x\\"",sampler.n=4', "e:trainer.lr=1e-5"], None,
                             base)["d"] == ['task.suffix="say \\"hi, x\\""', "sampler.n=4"]
    # a string or bracket never closed (or one closed never opened) is refused, naming the spec and the fix
    for spec in ['b:task.suffix="Don\'t guess.,sampler.n=4', "b:trainer.betas=[0.9,sampler.n=4",
                 "b:task.suffix='x,sampler.n=4", "b:task.suffix=x],sampler.n=4"]:
        with pytest.raises(ConfigError) as e:
            ablate.parse_arms([spec, "a:trainer.lr=1e-5"], None, base)
        assert repr(spec) in str(e.value) and 'task.suffix="Don\'t guess."' in str(e.value)


def test_an_arm_config_error_names_the_arm(capsys):
    """--set precision.trace=true suits the config's nvfp4-linear arm but not the implicit bf16 one: the
    error names the arm and its settings, and where a key that differs between arms goes."""
    base = ["precision.trace=true"]
    arms = ablate.parse_arms([], None, load_config(TINY, base))
    assert list(arms) == ["bf16", "nvfp4-linear"]
    with pytest.raises(ConfigError, match=r"arm 'bf16' \(precision.preset=bf16\): precision.trace = true "
                       r".*goes in --arm NAME:KEY=VALUE, not --set"):
        ablate.arm_config(str(TINY), base, "bf16", arms["bf16"])
    assert ablate.arm_config(str(TINY), base, "nvfp4-linear", arms["nvfp4-linear"]).precision.trace
    assert cli_main(["ablate", "--config", str(TINY), "--set", "precision.trace=true"]) == 2
    assert "arm 'bf16' (precision.preset=bf16): precision.trace" in capsys.readouterr().err


def test_an_arm_config_error_says_where_its_key_came_from(tmp_path):
    """The hint named --set even when the refused keys were all the arm's own (--arm): now it names the arm's
    --arm, the --config file, or --set, whichever holds the cause."""
    arms = ["a:precision.trace=true,precision.preset=bf16", "b:trainer.lr=1e-5"]
    parsed = ablate.parse_arms(arms, None, load_config(TINY))
    with pytest.raises(ConfigError) as e:
        ablate.arm_config(str(TINY), [], "a", parsed["a"])
    assert "refused together, whatever --config and --set hold: fix them in --arm a:" in str(e.value)
    assert "not --set" not in str(e.value)
    # the config file (every arm's base) traces, which the implicit bf16 arm cannot
    traced = tmp_path / "traced.toml"
    traced.write_text(TINY.read_text().replace('preset = "nvfp4-linear"',
                                               'preset = "nvfp4-linear"\ntrace = true'))
    with pytest.raises(ConfigError, match=f"clash with {traced}, the base config of every arm") as e:
        ablate.arm_config(str(traced), [], "bf16", ["precision.preset=bf16"])
    assert "not --set" not in str(e.value)


def test_a_larger_trainer_steps_extends_the_arms(assets, tmp_path):  # noqa: F811
    """An ablation run for trainer.steps=1, then asked for 2, was refused ("trainer.steps differ"): as
    `fp4rl train --resume RUN --set trainer.steps=2`, each arm's run goes on from its final checkpoint to the
    records of an uninterrupted 2-step run. Fewer steps than a run has done, or a longer run under an LR
    schedule spanning trainer.steps, is refused, naming the fix."""
    from fp4rl.loop import train

    arms = {"a": ["trainer.lr=1e-4"], "b": ["trainer.lr=1e-5"]}
    def sets(name, steps):
        return tiny_sets(assets, tmp_path, name, f"trainer.steps={steps}", "trainer.checkpoint_every=0")

    ablate.ablate(str(TINY), sets("ext", 1), arms, train_fn=train)
    two = sets("ext", 2)
    resumed = []

    def train_fn(config):
        resumed.append((config.run.name, config.run.resume, config.trainer.steps))
        return train(config)

    summary, _ = ablate.ablate(str(TINY), two, arms, train_fn=train_fn)
    assert resumed == [("ext-a", True, 2), ("ext-b", True, 2)]
    assert summary["a"]["steps"] == summary["b"]["steps"] == 2
    assert load_config(tmp_path / "ext-a" / "config.toml").trainer.steps == 2
    uninterrupted = train(ablate.arm_config(str(TINY), sets("full", 2), "a", arms["a"]))
    assert deterministic(read_metrics(tmp_path / "ext-a")) == deterministic(uninterrupted)
    # back to 1 step: refused (a run does not go back), naming the trainer.steps that reads it back
    with pytest.raises(ConfigError, match=r"ext-a holds this arm's run of trainer.steps = 2, trained to step "
                       r"2.*Set trainer.steps = 2 to read it back"):
        ablate.ablate(str(TINY), sets("ext", 1), arms, train_fn=train_fn)
    # a cosine schedule spans trainer.steps: not extended, and the message gives the command that would
    cosine = ablate.arm_config(str(TINY), tiny_sets(assets, tmp_path, "cos", "trainer.lr_schedule=cosine"),
                               "a", ["trainer.steps=1"])
    cosine.run_dir.mkdir()
    save_config(cosine, cosine.run_dir / "config.toml")
    (cosine.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    longer = ablate.arm_config(str(TINY), tiny_sets(assets, tmp_path, "cos", "trainer.lr_schedule=cosine"),
                               "a", ["trainer.steps=3"])
    with pytest.raises(ConfigError, match=r"under trainer.lr_schedule = 'cosine'.*extend it anyway: `fp4rl "
                       f"train --resume {cosine.run_dir} --set trainer.steps=3`"):
        ablate.arm_state(longer)


def _recording_train(calls):
    def train(config):
        calls.append(config.run.name)
        return [{"step": 1, "reward/mean": 0.5, "train/grad_norm": 1.0},
                {"step": 2, "reward/mean": 0.6, "train/grad_norm": 2.0}]
    return train


def test_every_arm_is_checked_before_the_first_trains(assets, tmp_path):  # noqa: F811
    base = tiny_sets(assets, tmp_path, "pre", "trainer.steps=2")
    arms = {"a": ["trainer.lr=1e-4"], "b": ["trainer.lr=1e-5"]}
    # arm b's run directory holds a run of another config: refused before arm a trains
    other = ablate.arm_config(str(TINY), base, "b", ["trainer.lr=3e-3"])
    other.run_dir.mkdir(parents=True)
    save_config(other, other.run_dir / "config.toml")
    (other.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")
    calls = []
    with pytest.raises(ConfigError, match="pre-b holds a run of another config .*trainer.lr"):
        ablate.ablate(str(TINY), base, arms, train_fn=_recording_train(calls))
    assert calls == []
    # arm b's run directory holds an unfinished run without a checkpoint: also refused up front
    save_config(ablate.arm_config(str(TINY), base, "b", arms["b"]), other.run_dir / "config.toml")
    with pytest.raises(ConfigError, match="unfinished run without a checkpoint .*steps 1..1 "
                       "logged.* move the directory away .*future arms"):
        ablate.ablate(str(TINY), base, arms, train_fn=_recording_train(calls))
    assert calls == []


def test_an_arm_stopped_in_its_first_step_resumes_as_train_resume_does(assets, tmp_path):  # noqa: F811
    """Only the at-start eval of step 0 logged, no checkpoint: `fp4rl train --resume` redoes it from step 1
    (run_dirs.check_resumable), and so does the arm, instead of refusing it."""
    from fp4rl.loop import train

    base = tiny_sets(assets, tmp_path, "first", "trainer.steps=1")
    arms = {"a": ["trainer.lr=1e-4"], "b": ["trainer.lr=1e-5"]}
    configs = {n: ablate.arm_config(str(TINY), base, n, s) for n, s in arms.items()}
    for name, records in (("a", [{"step": 0, "eval/accuracy": 0.25}]),
                          ("b", [{"step": 1, "reward/mean": 0.5}])):  # b: finished, read back
        configs[name].run_dir.mkdir(parents=True)
        save_config(configs[name], configs[name].run_dir / "config.toml")
        (configs[name].run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ablate.arm_state(configs["a"]) == ("resume", [{"step": 0, "eval/accuracy": 0.25}])
    resumed = []

    def train_fn(config):
        resumed.append((config.run.name, config.run.resume))
        return train(config)

    with pytest.warns(UserWarning, match="no checkpoint and no trained step"):
        summary, _ = ablate.ablate(str(TINY), base, arms, train_fn=train_fn)
    assert resumed == [("first-a", True)]
    assert [r["step"] for r in read_metrics(configs["a"].run_dir)] == [1] and summary["a"]["steps"] == 1


def test_summary_of_other_arms_is_not_overwritten(assets, tmp_path):  # noqa: F811
    base = tiny_sets(assets, tmp_path, "sum", "trainer.steps=2")
    calls = []
    summary, out = ablate.ablate(str(TINY), base, {"a": ["trainer.lr=1e-4"], "b": ["trainer.lr=1e-5"]},
                                 train_fn=_recording_train(calls))
    assert calls == ["sum-a", "sum-b"] and out == tmp_path / "sum-ablate"
    before = (out / "summary.json").read_text()
    assert not [p for p in out.rglob(".*.tmp")] and (out / "plots" / "arms.png").is_file()
    with pytest.raises(ConfigError, match="other arms .*pick another run.name .*or remove"):
        ablate.ablate(str(TINY), base, {"a": ["trainer.lr=1e-4"], "c": ["trainer.lr=3e-5"]},
                      train_fn=_recording_train(calls))
    assert calls == ["sum-a", "sum-b"] and (out / "summary.json").read_text() == before
    # the same arms again: the summary is rewritten (in the same order, the arms' records are the same)
    ablate.ablate(str(TINY), base, {"b": ["trainer.lr=1e-5"], "a": ["trainer.lr=1e-4"]},
                  train_fn=_recording_train(calls))
    assert set(json.loads((out / "summary.json").read_text())["arms"]) == {"a", "b"}


def test_non_finite_steps_are_counted():
    nan_arm = [{"step": 1, "train/grad_norm": 1.0, "reward/mean": 0.5},
               {"step": 2, "train/grad_norm": math.nan, "reward/mean": 0.5},
               {"step": 3, "train/grad_norm": math.inf, "reward/mean": 0.5}]
    clean = [{"step": s, "train/grad_norm": 1.0, "reward/mean": 0.5} for s in (1, 2, 3)]
    summary = ablate.summarize({"nan": nan_arm, "clean": clean})
    assert summary["nan"]["non-finite train/grad_norm"] == 2 and summary["nan"]["mean train/grad_norm"] == 1.0
    assert summary["clean"]["non-finite train/grad_norm"] == 0
    assert "non-finite reward/mean" not in summary["nan"]
    assert "non-finite train/grad_norm" in ablate.table(summary).splitlines()[0]


def test_tiny_ablation_runs_reads_back_and_resumes(assets, tmp_path):  # noqa: F811
    base = tiny_sets(assets, tmp_path, "abl", "trainer.steps=2", "trainer.checkpoint_every=1")
    arms = ablate.parse_arms([], "bf16,nvfp4-linear", load_config(TINY, base))
    summary, out = ablate.ablate(str(TINY), base, arms)
    assert out == tmp_path / "abl-ablate"
    for name in arms:
        records = read_metrics(tmp_path / f"abl-{name}")
        assert [r["step"] for r in records] == [1, 2]
        assert load_config(tmp_path / f"abl-{name}" / "config.toml").precision.preset == name
        assert summary[name]["steps"] == 2 and "eval/accuracy_last" in summary[name]
    saved = json.loads((out / "summary.json").read_text())
    assert list(saved["arms"]) == ["bf16", "nvfp4-linear"]
    assert saved["process"] == "one per arm"  # each arm trained in its own process: its memory peak its own
    assert saved["arms"]["bf16"]["overrides"] == ["precision.preset=bf16"]
    assert "| bf16 |" in (out / "summary.md").read_text() and (out / "plots" / "arms.png").is_file()
    # NVFP4 against BF16: the arms differ by precision only, and the NVFP4 arm's sampler/trainer
    # mismatch is larger than the BF16 arm's (whose sampler computes in the trainer's precision)
    assert summary["nvfp4-linear"]["mean mismatch/logprob_abs_diff"] > summary["bf16"][
        "mean mismatch/logprob_abs_diff"]

    full = {name: read_metrics(tmp_path / f"abl-{name}") for name in arms}

    def no_training(config):
        raise AssertionError(f"{config.run_dir} was trained again")

    again, _ = ablate.ablate(str(TINY), base, arms, train_fn=no_training)  # finished: read back
    assert again == summary

    # an interrupted arm: its last step and checkpoint gone; it resumes from step 1 to the same records
    run_dir = tmp_path / "abl-nvfp4-linear"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    last = list_checkpoints(run_dir)[-1]
    assert last.name == "step_000002"
    import shutil
    shutil.rmtree(last)
    ablate.ablate(str(TINY), base, arms)
    assert deterministic(read_metrics(run_dir)) == deterministic(full["nvfp4-linear"])

    # a run directory holding another config is refused, naming the key
    with pytest.raises(ConfigError, match="trainer.lr"):
        ablate.ablate(str(TINY), [*base, "trainer.lr=3e-3"], arms)


def test_cli_reports_bad_arms(capsys):
    assert cli_main(["ablate", "--config", str(TINY), "--presets", "bf16,nvfp5"]) == 2
    assert "not a precision preset" in capsys.readouterr().err
    assert cli_main(["ablate", "--config", str(TINY), "--arm", "ablate:trainer.lr=1e-4",
                     "--arm", "b:trainer.lr=1e-5"]) == 2
    assert "cannot be named 'ablate'" in capsys.readouterr().err
    assert cli_main(["ablate", "--config", str(TINY), "--arm", "a:run.name=x",
                     "--arm", "b:trainer.lr=1e-5"]) == 2
    assert "cannot set run.* keys" in capsys.readouterr().err


@pytest.mark.parametrize("second_ctrl_c, child_rc", [(False, 130), (False, 0), (False, -2), (True, None)])
def test_ctrl_c_lets_the_arms_training_process_checkpoint_its_step(monkeypatch, tmp_path, second_ctrl_c,
                                                                   child_rc):
    """The arm's `fp4rl train` runs in a session of its own: a Ctrl-C is passed to it once (SIGINT), it
    finishes its step with a checkpoint and exits 130 (or 0 if that was its last step, or -2 if it was still
    starting), and the ablation stops saying to run it again: it does not go on to the next arm, nor call it
    a failure (it used to kill the child at once, losing the step); a second Ctrl-C kills it."""
    import signal
    import subprocess

    from fp4rl import ablate as ablate_module

    events = []

    class Child:
        def __init__(self, *args, **kwargs):
            assert kwargs.get("start_new_session") is True
            self.waits, self.rc = 0, None

        def wait(self):
            self.waits += 1
            if self.waits == 1 or (second_ctrl_c and self.waits == 2):
                events.append("ctrl-c")
                raise KeyboardInterrupt
            self.rc = -9 if "kill" in events else child_rc
            return self.rc

        def send_signal(self, sig):
            events.append(signal.Signals(sig).name)

        def poll(self):
            return self.rc

        def kill(self):
            events.append("kill")

    monkeypatch.setattr(subprocess, "Popen", Child)
    config = load_config(None, [f"run.dir={str(tmp_path)!r}", "run.name=arm"])
    if second_ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            ablate_module.train_in_subprocess(config)
        assert events == ["ctrl-c", "SIGINT", "ctrl-c", "kill"]
    else:
        with pytest.raises(ablate_module.ArmInterrupted, match="run the same `fp4rl ablate` command again"):
            ablate_module.train_in_subprocess(config)
        assert events == ["ctrl-c", "SIGINT"]  # passed on once, waited for, never killed
