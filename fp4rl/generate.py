"""`fp4rl generate`: sample completions for one prompt from the default model, a Hugging Face model folder, an
NVFP4 export (in the precision it was exported with) or a training run (its newest checkpoint, or a checkpoint
folder, in the precision it was trained with: the contract of its config.toml, the tokenizer of its
model.name), with fp4rl.sampler.Sampler."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fp4rl.kvcache import KV_CACHE_KINDS
    from fp4rl.precision import PRESETS

    parser.add_argument("--prompt", required=True, help="the user message (the chat template is applied for "
                        "chat models)")
    parser.add_argument("--model", default="default", help="'default', a local Hugging Face model dir, an "
                        "NVFP4 export (fp4rl export OUT: in the precision it was exported with), or a run "
                        "directory / checkpoint (runs/NAME[/checkpoints/step_N]: in the run's precision)")
    parser.add_argument("--precision", default=None, choices=PRESETS,
                        help="PrecisionContract preset (default: bf16, an export's own, or a run's)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="where the tokenizer is, for a model folder or run without one (default: the "
                        "model's own, or a run's model.name)")
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

    if args.greedy:  # argmax decoding ignores the sampling options: asking for both is a mistake
        given = [f"--{k.replace('_', '-')} {v}" for k, v, default in (
            ("temperature", args.temperature, 1.0), ("top_p", args.top_p, 1.0), ("top_k", args.top_k, 0))
            if v != default]
        if given:
            raise SystemExit(f"fp4rl generate: --greedy takes the most likely token, so {', '.join(given)} "
                             "would do nothing: drop --greedy to sample with them, or drop them")
        if args.n > 1:
            raise SystemExit(f"fp4rl generate: --greedy --n {args.n} would print {args.n} identical "
                             "completions: drop --greedy to sample several, or --n")
    try:  # the sampling options first: a bad one is refused before the model loads
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, greedy=args.greedy,
            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"fp4rl generate: {exc} (the SamplingParams field is the --option of the same name, "
                         "with - for _)") from None
    if args.device == "cuda" and not torch.cuda.is_available():  # before minutes of loading
        raise SystemExit("fp4rl generate: --device cuda: no CUDA device here (torch.cuda.is_available() is "
                         "False); use --device cpu")
    run = _run_checkpoint(args.model)
    if run is not None:  # a training run: its weights in the precision it trained with
        model, tokenizer, contract = _load_run(run, args)
        convert(model, contract)
    else:
        model, tokenizer = load_model(args.model)
        if args.tokenizer is not None:
            from fp4rl.hf import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        exported = getattr(model, "precision_contract", None)  # an NVFP4 export: its linears hold its bytes
        if exported is not None:
            if args.precision not in (None, exported.preset):
                raise SystemExit(f"fp4rl generate: {args.model} is an NVFP4 export ({exported.preset}); "
                                 f"--precision {args.precision} would quantize its dequantized weights "
                                 "again: leave it out")
        else:
            convert(model, PrecisionContract(args.precision or "bf16"))
    if tokenizer is None:
        raise SystemExit(f"fp4rl generate: {args.model} has no tokenizer; pass --tokenizer DIR (a folder "
                         "with the base model's tokenizer files)")
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


def _run_checkpoint(model: str):
    """The checkpoint folder `model` names (a run directory: its newest; a checkpoint: itself), else None."""
    from fp4rl.run_dirs import checkpoint_of

    try:
        return checkpoint_of(Path(model), "fp4rl generate")
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None


def _load_run(checkpoint: Path, args):
    """(model, tokenizer, contract) of a trainer checkpoint: its weights, its run's precision contract (or
    --precision's preset with the run's other settings), the tokenizer of --tokenizer or of the run's
    model.name."""
    from fp4rl.config import load_config
    from fp4rl.export import _model_dir
    from fp4rl.hf import load_model, load_tokenizer
    from fp4rl.precision import PrecisionContract

    cfg = load_config(checkpoint / "config.toml")
    kwargs = cfg.precision.contract_kwargs()
    contract = PrecisionContract(**{**kwargs, "preset": args.precision or kwargs["preset"]})
    tok_dir = Path(args.tokenizer) if args.tokenizer else _model_dir(cfg.model.name)
    if tok_dir is None:
        raise SystemExit(f"fp4rl generate: {checkpoint} holds no tokenizer and its run's model.name "
                         f"{cfg.model.name!r} is not on this machine: pass --tokenizer DIR")
    with warnings.catch_warnings():  # the tokenizer comes from tok_dir
        warnings.filterwarnings("ignore", ".*has no tokenizer files")
        model, _ = load_model(checkpoint)
    print(f"{checkpoint}: the run's weights in its precision ({contract.preset})", file=sys.stderr)
    return model, load_tokenizer(tok_dir), contract
