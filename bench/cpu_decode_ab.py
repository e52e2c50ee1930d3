"""A decode step in one C call (cpu_step.WHOLE_STEP) against one Python call per kernel, same process.

The BF16 NVFP4 sampler on the default model generates a batch (16 prompts of 24-40 tokens, 32 new
tokens, greedy) with the whole-step path on and off, alternating, after checking that both give the
same tokens; prints the median generate time of each and the median of per-repeat ratios.

    python bench/cpu_decode_ab.py [--preset nvfp4-w4a16] [--batch 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from fp4rl import cpu_step
from fp4rl.benchmarks.rollout import load, make_prompts
from fp4rl.sampler import Sampler, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="nvfp4-w4a16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load("default", args.preset)
    sampler = Sampler(model, None, dtype=torch.bfloat16, eos_token_ids=[])
    prompts = make_prompts(args.batch, model.config.vocab_size)
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens, seed=0)
    tokens = {}
    for flag in (True, False):
        cpu_step.WHOLE_STEP = flag
        tokens[flag] = [c.completion_ids for c in sampler.generate(prompts, params)]
    if tokens[True] != tokens[False]:
        raise SystemExit("the two paths generated different tokens")
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for flag in (True, False):
            cpu_step.WHOLE_STEP = flag
            start = time.perf_counter()
            sampler.generate(prompts, params)
            times[flag].append(time.perf_counter() - start)
    cpu_step.WHOLE_STEP = True
    paired = statistics.median(b / a for a, b in zip(times[True], times[False]))
    tok = args.batch * args.new_tokens
    now = datetime.datetime.now(datetime.UTC)
    print(f"Date: {now:%Y-%m-%d %H:%M} UTC; {args.preset}, batch {args.batch}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s); same tokens: yes")
    print(f"one C call per step: {statistics.median(times[True]):.3f} s per generate "
          f"({tok / statistics.median(times[True]):.1f} tok/s); one call per kernel: "
          f"{statistics.median(times[False]):.3f} s ({tok / statistics.median(times[False]):.1f} tok/s); "
          f"paired speedup {paired:.2f}x (median of {args.repeats})")


if __name__ == "__main__":
    main()
