"""`fp4rl bench rollout`: CPU rollout speed of fp4rl's sampler vs transformers, and what it costs.

1. Throughput: tokens/s of `Sampler.generate` vs transformers' `generate` on the same model, the
   same prompts (B token-id prompts of 24-40 tokens, left-padded) and exactly the same number of
   new tokens (fp4rl: no EOS; transformers: min_new_tokens = max_new_tokens), greedy and sampled
   (T = 1, full vocabulary: the RL setting), at each batch size and dtype, measured in one
   process, the engines alternating, the median of a few repeats after a warm-up. fp4rl runs the
   "bf16" contract (same weights as transformers) and NVFP4 presets (packed weights; in BF16 on an
   AMX CPU the linears read them directly, see fp4rl/nvfp4/cpu_gemm.py).
2. Memory and weight sync per NVFP4 preset: packed bytes of the quantized linears vs BF16, the
   payload's size and bits per quantized parameter, and the time of one sync (build, serialise,
   parse, load with verification).
3. Mismatch: mean and max |sampler logprob - trainer logprob| over sampled completions (T = 1),
   the trainer scoring with a full FP32 forward of the QAT model, per preset and KV-cache dtype
   (FP32 sampler), and for a BF16 sampler with a BF16 cache.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from fp4rl.sampler import Sampler, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' or a local HF model directory")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes (1,16)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes to time (both)")
    parser.add_argument("--presets", default="bf16,nvfp4-w4a16",
                        help="fp4rl presets to time (bf16,nvfp4-w4a16; W4A4 emulation is slow on a CPU)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per sequence (32)")
    parser.add_argument("--modes", default="greedy,sample",
                        help="decoding to time: greedy and/or sample (T = 1, no top-k/top-p: RL rollout)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats, median shown (3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: current)")
    parser.add_argument("--mismatch-presets", default="bf16,nvfp4-w4a16,nvfp4-linear",
                        help="presets of the logprob-mismatch table ('' skips it)")
    parser.add_argument("--mismatch-prompts", type=int, default=4, help="prompts x 2 samples scored (4)")
    parser.add_argument("--mismatch-tokens", type=int, default=24, help="new tokens per scored sample (24)")
    parser.add_argument("--results", default=None, help="append the section to this markdown file")


def make_prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(24, 41, (batch,), generator=g).tolist()
    low = min(100, vocab // 2)  # skip the first ids (special tokens) of a real vocabulary
    return [torch.randint(low, min(vocab, 20000), (n,), generator=g).tolist() for n in lengths]


def load(model_name: str, preset: str, dtype=torch.float32):
    from fp4rl.hf import load_model
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert

    model, tokenizer = load_model(model_name, dtype=dtype)
    contract = PrecisionContract(preset)
    return convert(model, contract), tokenizer, contract


def hf_model_dir(model_name: str) -> str:
    from fp4rl.hf import default_model_dir

    return str(default_model_dir(convert=True) if model_name == "default" else model_name)


def time_engines(hf, samplers: dict, batch: int, new: int, repeats: int,
                 mode: str = "greedy") -> dict[str, float]:
    """Median (wall, CPU) seconds of transformers and of each sampler for one batch, engines alternating,
    and the median over repeats of (transformers' wall seconds / the engine's) in the same repeat: on a
    shared machine whose speed drifts between phases, a ratio of neighbouring runs is steadier than a
    ratio of medians. mode "greedy" (argmax) or "sample" (T = 1 from the full softmax, seeded)."""
    prompts = make_prompts(batch, hf.config.vocab_size)
    T = max(map(len, prompts))
    ids = torch.zeros(batch, T, dtype=torch.long)
    mask = torch.zeros(batch, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = torch.tensor(p), 1
    greedy = mode == "greedy"
    params = SamplingParams(greedy=greedy, temperature=1.0, max_new_tokens=new, seed=0)
    sampling = {} if greedy else dict(temperature=1.0, top_k=0, top_p=1.0)  # transformers defaults top_k=50

    def run_hf():
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, **sampling)
        assert out.shape == (batch, T + new)

    engines = {"transformers": run_hf}
    for preset, sampler in samplers.items():
        engines[f"fp4rl {preset}"] = lambda s=sampler: s.generate(prompts, params)
    for fn in engines.values():  # warm-up (builds the dequantized caches)
        fn()
    wall, cpu = {name: [] for name in engines}, {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    ref = wall["transformers"]
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]),
                   statistics.median(r / w for r, w in zip(ref, wall[name]))) for name in engines}


def throughput(args) -> list[dict]:
    import transformers

    from fp4rl.hf import hub_offline

    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        with hub_offline():  # a local folder only (hf_model_dir), never a download
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir(args.model), dtype=dtype,
                                                                   local_files_only=True).eval()
        samplers = {}
        for preset in args.presets.split(","):
            model, _, _ = load(args.model, preset)
            samplers[preset] = Sampler(model, None, dtype=dtype, eos_token_ids=[])
            del model
        for mode, batch in ((m, int(b)) for m in args.modes.split(",") for b in args.batches.split(",")):
            seconds = time_engines(hf, samplers, batch, args.new_tokens, args.repeats, mode)
            for engine, (wall, cpu, paired) in seconds.items():
                rows.append(dict(engine=engine, dtype=dtype_name, batch=batch, seconds=wall, cpu_seconds=cpu,
                                 paired_ratio=paired, mode=mode, tokens_per_s=batch * args.new_tokens / wall,
                                 tokens_per_cpu_s=batch * args.new_tokens / cpu))
            print(f"  {dtype_name} {mode} batch {batch}: " + ", ".join(
                f"{r['engine']} {r['tokens_per_s']:.1f} tok/s ({r['tokens_per_cpu_s']:.1f} per CPU s, "
                f"{r['paired_ratio']:.2f}x paired)"
                for r in rows[-len(seconds):]), flush=True)
        del hf, samplers
    return rows


def memory_and_sync(args) -> list[dict]:
    from fp4rl.weight_sync import Payload, build_payload

    rows = []
    for preset in [p for p in args.presets.split(",") if p != "bf16"]:
        model, _, contract = load(args.model, preset)
        sampler = Sampler(model, None, eos_token_ids=[])
        sampler.generate([[1, 2, 3]], SamplingParams(greedy=True, max_new_tokens=1))  # builds the CPU cache
        mem = sampler.memory()
        bf16 = Sampler(model, None, eos_token_ids=[], dtype=torch.bfloat16)  # the fast CPU sampler
        bf16.generate([[1, 2, 3]], SamplingParams(greedy=True, max_new_tokens=1))
        mem["bf16_cache_bytes"] = bf16.memory()["dequantized_cache_bytes"]
        del bf16
        start = time.perf_counter()
        payload = build_payload(model, contract, version=1)
        blob = payload.to_bytes()
        sampler.load(Payload.from_bytes(blob), verify=True)
        sync_s = time.perf_counter() - start
        rows.append(dict(preset=preset, **mem, payload_bytes=payload.nbytes, wire_bytes=len(blob),
                         bits=payload.bits_per_quantized_param, sync_s=sync_s))
    return rows


def mismatch(args) -> list[dict]:
    from fp4rl.grpo import token_logprobs

    rows = []
    for preset in [p for p in args.mismatch_presets.split(",") if p]:
        model, _, _ = load(args.model, preset)
        prompts = make_prompts(args.mismatch_prompts, model.config.vocab_size, seed=1)
        # every KV cache with an FP32 sampler, and the BF16 cache with a BF16 sampler (the fast CPU setting)
        settings = (("bf16", "float32"), ("fp8", "float32"), ("nvfp4", "float32"), ("bf16", "bfloat16"))
        for kv, dtype in settings:
            sampler = Sampler(model, None, kv_cache=kv, dtype=DTYPES[dtype], eos_token_ids=[])
            out = sampler.generate(prompts, SamplingParams(n=2, max_new_tokens=args.mismatch_tokens, seed=0))
            diffs = []
            for c in out:
                ids = torch.tensor([c.prompt_ids + c.completion_ids])
                with torch.no_grad():
                    logits = model(ids[:, :-1])
                trainer = token_logprobs(logits, ids[:, 1:])[0, len(c.prompt_ids) - 1:]
                diffs.append((trainer - torch.tensor(c.logprobs)).abs())
            d = torch.cat(diffs)
            rows.append(dict(preset=preset, kv=kv, dtype=dtype, mean=float(d.mean()), max=float(d.max()),
                             tokens=d.numel()))
            r = rows[-1]
            print(f"  mismatch {preset} kv={kv} {dtype}: mean {r['mean']:.2e} max {r['max']:.2e}", flush=True)
        del model
    return rows


def header(args) -> str:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "rollout"] else sys.argv[1:]
    command = " ".join(["fp4rl bench rollout", *argv])
    return (f"Date: {now}. Machine: {cpu}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}. Command: `{command}` (model {args.model!r}), "
            f"at commit {commit}, CPU shared with other jobs.")


def markdown(args, speed, memory, mism) -> str:
    out = ["## rollout", "", header(args), ""]
    if speed:
        out += [f"Throughput: greedy (argmax) or sampled (T = 1 from the full softmax; transformers with "
                f"top_k=0, top_p=1), prompts of 24-40 tokens left-padded, exactly {args.new_tokens} new "
                f"tokens per sequence (prefill included), median of {args.repeats} after a warm-up, "
                "engines alternating in one process. Tokens per wall second, and per CPU second of this "
                "process (less sensitive to other jobs on a shared CPU when torch runs one thread); ratios "
                "are of wall tokens/s, against transformers at the same dtype (of the medians, and the "
                "median of the ratios to the transformers run of the same repeat: steadier when the "
                "machine's speed drifts) and in float32 (its CPU default):", "",
                "| engine | dtype | decoding | batch | tokens/s | tokens/CPU-s | vs transformers, same dtype "
                "| paired | vs transformers fp32 |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
        ref = {(r["dtype"], r["mode"], r["batch"]): r["tokens_per_s"] for r in speed
               if r["engine"] == "transformers"}
        for r in speed:
            same = r["tokens_per_s"] / ref[(r["dtype"], r["mode"], r["batch"])]
            fp32 = ref.get(("float32", r["mode"], r["batch"]))
            vs_fp32 = f"{r['tokens_per_s'] / fp32:.2f}x" if fp32 else "-"
            out.append(f"| {r['engine']} | {r['dtype']} | {r['mode']} | {r['batch']} | "
                       f"{r['tokens_per_s']:.1f} | "
                       f"{r['tokens_per_cpu_s']:.1f} | {same:.2f}x | {r['paired_ratio']:.2f}x | {vs_fp32} |")
        out.append("")
    if memory:
        out += ["Packed weights in the sampler, and one weight sync (build the payload, serialise, parse, "
                "load with verify=True):", "",
                "| preset | quantized params | packed | as BF16 | ratio | FP32 sampler: DQ(W) cache "
                "| BF16 sampler: kernel copy | payload | bits/param | sync time |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        mib = 2**20
        for r in memory:
            out.append(f"| {r['preset']} | {r['quantized_params']:,} | {r['packed_bytes'] / mib:.1f} MiB | "
                       f"{r['bf16_bytes'] / mib:.1f} MiB | {r['packed_vs_bf16']:.3f}x | "
                       f"{r['dequantized_cache_bytes'] / mib:.1f} MiB | "
                       f"{r['bf16_cache_bytes'] / mib:.1f} MiB | {r['payload_bytes'] / mib:.1f} MiB | "
                       f"{r['bits']:.3f} | {r['sync_s']:.2f} s |")
        out.append("")
    if mism:
        out += ["Sampler vs trainer logprobs: the trainer scores the sampled tokens with a full FP32 forward "
                f"of the QAT model; {args.mismatch_prompts} prompts x 2 samples x {args.mismatch_tokens} "
                "tokens, T = 1:", "",
                "| preset | sampler dtype | KV cache | mean abs diff | max abs diff | tokens |",
                "|---|---|---|---:|---:|---:|"]
        for r in mism:
            out.append(f"| {r['preset']} | {r['dtype']} | {r['kv']} | {r['mean']:.2e} | {r['max']:.2e} | "
                       f"{r['tokens']} |")
        out.append("")
    return "\n".join(out)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for a value the benchmark would refuse only after minutes of timing.
    The comma lists it accepts are written back onto args cleaned (items stripped, empty ones dropped): the
    run splits them as checked, not ' bfloat16' (a KeyError after the timing)."""
    from fp4rl.precision import PRESETS

    def items(opt, text, allowed, empty_ok=False):
        got = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in got if v not in allowed]
        if bad or (not got and not empty_ok):
            raise ValueError(f"bench rollout --{opt}: {bad or text!r} not among {', '.join(allowed)} "
                             "(comma-separated)")
        setattr(args, opt.replace("-", "_"), ",".join(got))

    items("dtypes", args.dtypes, tuple(DTYPES))
    items("presets", args.presets, PRESETS)
    items("mismatch-presets", args.mismatch_presets, PRESETS, empty_ok=True)
    items("modes", args.modes, ("greedy", "sample"))
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise ValueError(f"bench rollout --batches {args.batches!r}: comma-separated integers >= 1")
    args.batches = ",".join(map(str, batches))
    for opt in ("new_tokens", "repeats", "mismatch_prompts", "mismatch_tokens"):
        if getattr(args, opt) < 1:
            raise ValueError(f"bench rollout --{opt.replace('_', '-')} {getattr(args, opt)}: must be >= 1")
    if args.threads is not None and args.threads < 1:  # (torch.set_num_threads: a bare RuntimeError)
        raise ValueError(f"bench rollout --threads {args.threads}: must be >= 1 (leave it out for the "
                         "current count)")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print("throughput ...", flush=True)
    speed = throughput(args)
    print("memory and weight sync ...", flush=True)
    memory = memory_and_sync(args)
    print("mismatch ...", flush=True)
    mism = mismatch(args)
    text = markdown(args, speed, memory, mism)
    print(text)
    if args.results:
        with open(Path(args.results), "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))
