"""`fp4rl generate`: sample completions for one prompt from the default model, a Hugging Face model folder or
an NVFP4 export (in the precision it was exported with), with fp4rl.sampler.Sampler."""

from __future__ import annotations

import argparse

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fp4rl.kvcache import KV_CACHE_KINDS
    from fp4rl.precision import PRESETS

    parser.add_argument("--prompt", required=True, help="the user message (the chat template is applied for "
                        "chat models)")
    parser.add_argument("--model", default="default", help="'default', a local Hugging Face model dir, or an "
                        "NVFP4 export (fp4rl export OUT: sampled with the precision it was exported with)")
    parser.add_argument("--precision", default=None, choices=PRESETS,
                        help="PrecisionContract preset (default: bf16, or an export's own)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the sampler runs")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--kv-cache", default="bf16", choices=KV_CACHE_KINDS, help="default bf16")
    parser.add_argument("--temperature", type=float, default=1.0, help="default 1.0")
    parser.add_argument("--top-p", type=float, default=1.0, help="default 1.0 (no nucleus filter)")
    parser.add_argument("--top-k", type=int, default=0, help="default 0 (no top-k filter)")
    parser.add_argument("--n", type=int, default=1, help="completions to sample")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")


def run(args) -> int:
    from fp4rl.hf import load_model
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler, SamplingParams

    try:  # the sampling options first: a bad one is refused before the model loads
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, greedy=args.greedy,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"fp4rl generate: {exc} (the SamplingParams field is the --option of the same name, "
                         "with - for _)") from None
    model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer; fp4rl generate needs one")
    exported = getattr(model, "precision_contract", None)  # an NVFP4 export: its linears hold its bytes
    if exported is not None:
        if args.precision not in (None, exported.preset):
            raise SystemExit(f"{args.model} is an NVFP4 export ({exported.preset}); --precision "
                             f"{args.precision} would quantize its dequantized weights again: leave it out")
    else:
        convert(model, PrecisionContract(args.precision or "bf16"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    sampler = Sampler(model, tokenizer, kv_cache=args.kv_cache, dtype=getattr(torch, args.dtype),
                      device=args.device)
    if getattr(tokenizer, "chat_template", None) and not args.raw:
        from fp4rl.tasks import apply_chat_template

        prompt = apply_chat_template(tokenizer, args.prompt, tokenize=True)
    else:
        prompt = tokenizer(args.prompt)["input_ids"]
    for c in sampler.generate([prompt], params):
        if params.n > 1:
            print(f"--- sample {c.sample_index} ({c.finish_reason}, {len(c.completion_ids)} tokens)")
        print(c.text)
    return 0
