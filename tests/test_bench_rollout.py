"""`fp4rl bench rollout` on a tiny saved model: both engines, both decodings, the markdown table."""

import argparse

from rl_fixtures import save_tiny_model

from fp4rl.benchmarks import rollout


def test_throughput_times_both_engines_greedy_and_sampled(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    args = argparse.Namespace(model=str(model_dir), batches="2", dtypes="float32,bfloat16", presets="bf16",
                              modes="greedy,sample", new_tokens=4, repeats=1, threads=None)
    speed = rollout.throughput(args)
    keys = {(r["engine"], r["dtype"], r["mode"]) for r in speed}
    assert keys == {(e, d, m) for e in ("transformers", "fp4rl bf16") for d in ("float32", "bfloat16")
                    for m in ("greedy", "sample")}
    assert all(r["tokens_per_s"] > 0 and r["batch"] == 2 for r in speed)
    # the paired ratio is transformers' wall time over the engine's in the same repeat (one repeat here)
    for r in speed:
        ref = next(h for h in speed if h["engine"] == "transformers" and (h["dtype"], h["mode"]) ==
                   (r["dtype"], r["mode"]))
        assert abs(r["paired_ratio"] - ref["seconds"] / r["seconds"]) < 1e-9
    text = rollout.markdown(args, speed, [], [])
    assert text.count("| fp4rl bf16 |") == 4 and "| sample | 2 |" in text


def test_bad_options_are_refused_before_any_timing(monkeypatch):
    """A dtype, preset, mode or batch the benchmark does not take is named before the first timing (an
    unknown dtype raised KeyError; a misspelt mismatch preset failed after the whole throughput phase)."""
    import pytest

    from fp4rl.cli import main

    monkeypatch.setattr(rollout, "throughput", lambda args: pytest.fail("timed before checking the options"))
    monkeypatch.delenv("FP4RL_TRACEBACK", raising=False)
    for option, match in ((["--dtypes", "float16"], "--dtypes: \\['float16'\\] not among float32, bfloat16"),
                          (["--mismatch-presets", "nvfp4-w4a61"], "--mismatch-presets: \\['nvfp4-w4a61'\\]"),
                          (["--presets", "bf16,nvfp5"], "--presets: \\['nvfp5'\\]"),
                          (["--modes", "beam"], "--modes: \\['beam'\\]"),
                          (["--batches", "1,x"], "--batches '1,x'"), (["--repeats", "0"], "--repeats 0")):
        parser = argparse.ArgumentParser()
        rollout.add_arguments(parser)
        args = parser.parse_args(option)
        with pytest.raises(ValueError, match=match):
            rollout.run(args)
    assert main(["bench", "rollout", "--dtypes", "float16"]) == 2  # the CLI's message, not a traceback


def test_comma_lists_are_run_as_checked(monkeypatch):
    """Spaces around the items of a comma list passed the check but reached the run as ' bfloat16' (a
    KeyError after the timing): the phases see the cleaned lists."""
    seen = {}

    def phase(name):
        def record(args):
            seen[name] = {opt: getattr(args, opt).split(",") for opt in
                          ("dtypes", "presets", "modes", "mismatch_presets", "batches")}
            return []
        return record

    for name in ("throughput", "memory_and_sync", "mismatch"):
        monkeypatch.setattr(rollout, name, phase(name))
    monkeypatch.setattr(rollout, "markdown", lambda *a: "")
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    args = parser.parse_args(["--dtypes", "float32, bfloat16", "--presets", " bf16 , nvfp4-linear,",
                              "--modes", "greedy, sample", "--mismatch-presets", " nvfp4-linear",
                              "--batches", "1, 2"])
    assert rollout.run(args) == 0
    want = {"dtypes": ["float32", "bfloat16"], "presets": ["bf16", "nvfp4-linear"],
            "modes": ["greedy", "sample"], "mismatch_presets": ["nvfp4-linear"], "batches": ["1", "2"]}
    assert seen == {name: want for name in ("throughput", "memory_and_sync", "mismatch")}
    assert all(d in rollout.DTYPES for d in args.dtypes.split(","))
