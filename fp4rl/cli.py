"""The `fp4rl` command.

Each subcommand lives in the module that owns the idea: that module defines
`add_arguments(parser)` and `run(args) -> int | None`. Modules are imported only when their
subcommand runs, so `fp4rl --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fp4rl.loop", "run an RL job (TOML config + --set key=value; --resume RUN_DIR)"),
    "generate": ("fp4rl.sampler", "sample a completion for one prompt (chat template applied)"),
    "export": ("fp4rl.export", "write an NVFP4 checkpoint for vLLM/SGLang (ModelOpt or compressed-tensors)"),
    "bench": ("fp4rl.benchmarks", "run a benchmark (quantize, memory, rollout, gpu_kernels)"),
    "plot": ("fp4rl.metrics", "draw a run's curves as PNGs into RUN_DIR/plots/"),
    "ablate": ("fp4rl.ablate", "run the same job under several settings (arms) and compare them"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4rl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    code = importlib.import_module(args._module).run(args)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
