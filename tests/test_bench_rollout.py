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
