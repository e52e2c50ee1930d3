"""`fp4rl bench NAME` refuses a numeric option out of range when it parses the arguments, naming the option
and the valid range (it was a RuntimeError traceback from torch, "no median for empty data", or a refusal
after minutes of timing), before anything is timed."""

import argparse

import pytest

from fp4rl.benchmarks import int_at_least, int_list_at_least, memory, quantize, rollout
from fp4rl.cli import main

REFUSED = [
    (["quantize", "--size", "-16"], "argument --size: '-16': expected an integer >= 16 and a multiple of 16"),
    (["quantize", "--size", "20"], "argument --size: '20': expected an integer >= 16 and a multiple of 16"),
    (["quantize", "--snr-size", "20"], "argument --snr-size: '20': expected an integer >= 16"),
    (["quantize", "--threads", "0"], "argument --threads: '0': expected comma-separated integers, each >= 1"),
    (["quantize", "--threads", "1,x"], "argument --threads: '1,x': expected comma-separated integers"),
    (["quantize", "--repeats", "0"], "argument --repeats: '0': expected an integer >= 1"),
    (["memory", "--features", "-16"], "argument --features: '-16': expected an integer >= 16"),
    (["memory", "--tokens", "0"], "argument --tokens: '0': expected an integer >= 1"),
    (["memory", "--batch", "0"], "argument --batch: '0': expected an integer >= 1"),
    (["memory", "--seq", "1"], "argument --seq: '1': expected an integer >= 2"),
    (["gpu_kernels", "--workers", "-1"], "argument --workers: '-1': expected an integer >= 0"),
    (["gpu_kernels", "--rows", "1,0"], "argument --rows: '1,0': expected comma-separated integers, each >= "
                                       "1"),
    (["gpu_kernels", "--context", "x"], "argument --context: 'x': expected comma-separated integers"),
    (["gpu_kernels", "--shapes", "4096x20"], "argument --shapes: '4096x20': expected NxK, N >= 1 and K a "
                                             "multiple of 16"),
    (["sampler_gpu", "--prompt", "0"], "argument --prompt: '0': expected an integer >= 1"),
    (["sampler_gpu", "--repeats", "0"], "argument --repeats: '0': expected an integer >= 1"),
    (["sampler_gpu", "--batch", ""], "argument --batch: '': expected comma-separated integers, each >= 1"),
    (["sampler_gpu", "--profile-batch", "0"], "argument --profile-batch: '0': expected comma-separated"),
]


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_out_of_range_numbers_are_refused_when_parsed(argv, message, capsys, monkeypatch):
    for name in ("quantize", "memory", "rollout"):  # nothing may be timed
        monkeypatch.setattr(f"fp4rl.benchmarks.{name}.run", lambda args: pytest.fail("ran the benchmark"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"fp4rl bench {argv[0]}: error: {message}" in err and "Traceback" not in err


def test_valid_numbers_parse_and_lists_come_back_cleaned():
    parser = argparse.ArgumentParser()
    quantize.add_arguments(parser)
    args = parser.parse_args(["--size", "32", "--threads", " 1, 2", "--repeats", "1", "--snr-size", "16"])
    assert (args.size, args.threads, args.repeats, args.snr_size) == (32, "1,2", 1, 16)
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    assert parser.parse_args([]).features == 4096  # the defaults pass as they are
    assert int_at_least(0)("0") == 0 and int_list_at_least(1, empty_ok=True)("") == ""


def test_rollout_threads_below_one_is_refused_before_timing(monkeypatch):
    """`--threads -1` reached torch.set_num_threads (a bare RuntimeError after the model loaded), and 0 was
    taken silently as 'the current count'."""
    monkeypatch.setattr(rollout, "throughput", lambda args: pytest.fail("timed before checking the options"))
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    for threads in ("-1", "0"):
        with pytest.raises(ValueError, match=f"--threads {threads}: must be >= 1"):
            rollout.run(parser.parse_args(["--threads", threads]))
