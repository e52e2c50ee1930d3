"""run_dirs.checkpoint_of: the one rule `fp4rl export` and `fp4rl generate --model` read a folder by."""

import pytest

from fp4rl.run_dirs import checkpoint_of
from fp4rl.trainer import _STATE_FILE, CHECKPOINT_DIR


def _checkpoint(run, step):
    path = run / CHECKPOINT_DIR / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / _STATE_FILE).write_bytes(b"state")
    return path


def test_checkpoint_of_reads_runs_checkpoints_and_model_folders(tmp_path):
    run = tmp_path / "run"
    first, newest = _checkpoint(run, 2), _checkpoint(run, 10)
    (run / CHECKPOINT_DIR / ".tmp-step_000011").mkdir()  # a save in progress is not a checkpoint
    assert checkpoint_of(run, "export") == newest  # step 10 after step 2: by number, not by name
    assert checkpoint_of(first, "export") == first  # a checkpoint is itself, though it has a config.json
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert checkpoint_of(model, "export") is None
    assert checkpoint_of(tmp_path / "absent", "export") is None
    assert checkpoint_of(tmp_path / "run" / CHECKPOINT_DIR / ".tmp-step_000011", "export") is None


@pytest.mark.parametrize("layout", ["metrics", "checkpoints"])
def test_a_run_without_a_complete_checkpoint_is_named(tmp_path, layout):
    run = tmp_path / "young"
    if layout == "metrics":
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 0}\n')
    else:
        (run / CHECKPOINT_DIR / ".tmp-step_000001").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"fp4rl generate: run directory .*young has no complete "
                                                r"checkpoint yet"):
        checkpoint_of(run, "fp4rl generate")
