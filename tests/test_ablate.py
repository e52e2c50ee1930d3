"""`fp4rl ablate` on the tiny job: arms parsed and checked, every arm run as its own run directory with
the same seeds, a summary of all of them; a finished ablation is read back without training, an
unfinished arm resumes from its checkpoint to the records of an uninterrupted run, and a run directory
holding another config is refused."""

import json

import pytest
from test_loop import TINY, assets, deterministic, tiny_sets  # noqa: F401  (assets: a fixture)

from fp4rl import ablate
from fp4rl.cli import main as cli_main
from fp4rl.config import ConfigError, load_config
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
    with pytest.raises(ConfigError, match="not a precision preset"):
        ablate.parse_arms([], "bf16,nvfp5", base)
    with pytest.raises(ConfigError, match="NAME:KEY=VALUE"):
        ablate.parse_arms(["no-colon"], None, base)
    with pytest.raises(ConfigError, match="two arms"):
        ablate.parse_arms(["only:trainer.lr=1e-4"], None, base)
    with pytest.raises(ConfigError, match="two arms"):
        ablate.parse_arms([], None, load_config(TINY, ["precision.preset=bf16"]))


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
