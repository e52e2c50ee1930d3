"""Upper bound of what folding the dense MLP's SiLU(gate) * up into the gate/up GEMM could save in a
decode step (a diagnostic, not a result: the outputs are wrong). Runs fp4rl.benchmarks.sampler_gpu with its
arguments, with fused.silu_mul replaced by a launch-free view of gate (y = gu[:, :I], no Q(y)): the step
then has every kernel but the SiLU * up launch, and the down projection reads rows of stride 2I. Compare its
step time with an arm of the defaults in a fresh process (bench/device_run191.sh)."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script: the repository's fp4rl)
from fp4rl.kernels import fused  # noqa: E402

_original = fused.silu_mul


def _no_launch(gu, *, quant=None, write_y=True, block=None, chunk=None):
    if quant is not None:  # W4A4 down projections need Q(y): keep the real kernel there
        return _original(gu, quant=quant, write_y=write_y, block=block, chunk=chunk)
    return gu[:, : gu.shape[1] // 2], None


fused.silu_mul = _no_launch
sys.argv[0] = "fp4rl.benchmarks.sampler_gpu"
runpy.run_module("fp4rl.benchmarks.sampler_gpu", run_name="__main__", alter_sys=False)
