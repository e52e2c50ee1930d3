"""quant.cu's kernels compiled for sm_90 on a machine without a GPU: NVRTC from PyPI (the
nvidia-cuda-nvrtc-cu12 wheel: `pip install --target /tmp/nvrtc nvidia-cuda-nvrtc-cu12`) and cuobjdump from
Triton's bundle, printing each build's registers, stack and local memory (spills) for every configuration of
the kernel named. A check before a device call: a build that fails here would switch the CUDA kernels off on
the GPU.

    python bench/quant_cu_sm90.py [--kernel nvfp4_quant_tile16] [--nvrtc /tmp/nvrtc] [--cuobjdump PATH]
"""

import argparse
import ctypes
import itertools
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import torch  # noqa: E402

from fp4rl.kernels.quantize import cuda as qc  # noqa: E402


def cubin(lib, source: str, arch: str = "sm_90") -> bytes:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"quant.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"-arch={arch}".encode(), b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    if rc:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC failed:\n{log.value.decode()[-3000:]}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, out)
    return out.raw


def usage(cuobjdump: str, binary: bytes, kernel: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(binary)
    try:
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True)
        lines = out.stdout.splitlines()
    finally:
        os.unlink(f.name)
    for i, line in enumerate(lines):
        if kernel in line and i + 1 < len(lines):
            keep = ("REG", "STACK", "LOCAL", "SHARED")
            return " ".join(w for w in lines[i + 1].split() if w.split(":")[0] in keep)
    return "not in the binary"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="nvfp4_quant_tile16")
    ap.add_argument("--nvrtc", default="/tmp/nvrtc")
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args()
    lib = ctypes.CDLL(os.path.join(args.nvrtc, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    import triton

    cuobjdump = args.cuobjdump or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                               "cuobjdump")
    print(f"{args.kernel}, sm_90: dtype, rule, err, src, allow_nonfinite -> registers, stack, local (spills)")
    for dt, rule46, mae, src, nf in itertools.product((torch.bfloat16, torch.float32), (False, True),
                                                      (False, True), (0, 2, 3), (False, True)):
        if mae and not rule46:
            continue
        key = qc.flat_config(dt, rule46, mae, nf, src, False, 0)
        res = usage(cuobjdump, cubin(lib, qc.source(dict(key))), args.kernel)
        rule, err = "4/6" if rule46 else "6", "mae" if mae else "mse"
        print(f"{str(dt)[6:]:8} {rule:3} {err} src{src} nf{int(nf)}: {res}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
