"""Upper bound of what folding the residual add + RMSNorm into the GEMMs around it could save in a decode step
(a diagnostic, not a result: the outputs are wrong). Runs fp4rl.benchmarks.sampler_gpu with its arguments,
with fused.add_rmsnorm replaced by a launch-free stand-in wherever its output feeds a W4A16 consumer (no
quant, no MoE combine): x' = x and y = x (no add, no norm), so the step has every kernel but those launches,
the GEMMs reading the same shapes. Compare its step time with an arm of the defaults in a fresh process
(bench/device_run195.sh): the gain a fold that costs nothing in the GEMMs would give (gpu_kernels.md,
fifty-ninth session, Next 1)."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script: the repository's fp4rl)
from fp4rl.kernels import fused  # noqa: E402

_original = fused.add_rmsnorm


def _no_launch(x, h, weight, eps, *, quant=None, moe=None, **kw):
    if quant is not None or moe is not None:  # W4A4 consumers need Q(y); the MoE combine is a real reduction
        return _original(x, h, weight, eps, quant=quant, moe=moe, **kw)
    return x, x, None


fused.add_rmsnorm = _no_launch
sys.argv[0] = "fp4rl.benchmarks.sampler_gpu"
runpy.run_module("fp4rl.benchmarks.sampler_gpu", run_name="__main__", alter_sys=False)
