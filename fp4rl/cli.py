"""The `fp4rl` command: RL of LLMs in NVFP4 (train, generate, export, bench, plot, ablate).

Each subcommand lives in the module that owns the idea: that module defines
`add_arguments(parser)` and `run(args) -> int | None` (every module is imported to build the
parser). A refused input (ValueError: a bad option value, config or model; OSError: a missing,
misplaced or unreadable file; their messages name the problem and the fix) prints that message and
exits 2 instead of a traceback; FP4RL_TRACEBACK=1 shows the traceback too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fp4rl.loop", "run an RL job (TOML config + --set key=value; --resume RUN_DIR)"),
    "generate": ("fp4rl.generate", "sample a completion for one prompt (chat template applied)"),
    "export": ("fp4rl.export", "write an NVFP4 checkpoint for vLLM/SGLang (ModelOpt or compressed-tensors)"),
    "bench": ("fp4rl.benchmarks", "run a benchmark (quantize, memory, rollout, gpu_kernels, sampler_gpu)"),
    "plot": ("fp4rl.metrics", "draw a run's curves as PNGs into RUN_DIR/plots/"),
    "ablate": ("fp4rl.ablate", "run the same job under several settings (arms) and compare them"),
}


def build_parser() -> argparse.ArgumentParser:
    from fp4rl import __version__

    parser = argparse.ArgumentParser(prog="fp4rl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"fp4rl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        code = importlib.import_module(args._module).run(args)
    except BrokenPipeError:  # the output piped into a reader that stopped (`fp4rl ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when stdout flushes
        return 0
    except (ValueError, OSError) as exc:  # the library's refusals of bad input, and file errors
        if os.environ.get("FP4RL_TRACEBACK") == "1":
            raise
        print(f"fp4rl {args.command}: error: {exc}\n(FP4RL_TRACEBACK=1 shows where it was raised)",
              file=sys.stderr)
        return 2
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
