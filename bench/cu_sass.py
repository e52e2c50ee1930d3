"""Static SASS of quant.cu's kernels for sm_90 without a GPU (dev tool for bench/gpu_kernels.md): NVRTC (the
dev extra) builds the cubin, nvdisasm (Triton's wheel) lists it, and the instructions are counted per function
and per execution pipe as the H100 / H200 issue them: `alu` (logic, shifts, integer add, compares, min/max,
selects, permutes: 16 lanes a cycle per SM sub-partition), `fma` (FP32 add / multiply / FMA: 32 lanes,
fmaheavy + fmalite), `imad` (integer multiply-add, also how the compiler moves and shifts on the FMA pipe:
fmaheavy only, 16 lanes), `xu` (MUFU, conversions), `mem`, `ctl`, `uniform`. A kernel whose inner loop
issues A alu, I imad and F fma warp instructions needs at least max(A + I + F, 2A, 2I, I + F) cycles per
sub-partition (`bound` below, per function): the twenty-sixth session measured the 4/6 row kernel near it.

  python3 bench/cu_sass.py                      # the 4/6 MSE row kernel at the launcher's defaults
  python3 bench/cu_sass.py FAST46=0 BPT=4       # override compile keys
  python3 bench/cu_sass.py --list               # the listing too
  python3 bench/cu_sass.py --hot                # rare paths cut (the exact errors, FAST46 3's general path):
                                                # the static count then approximates the common path's
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from fp4rl.kernels.quantize import cuda as qc  # noqa: E402

ALU = {"LOP3", "LOP", "IADD3", "IADD", "SHF", "LEA", "ISETP", "FSETP", "FMNMX", "IMNMX", "VIMNMX", "VIMNMX3",
       "SEL", "FSEL", "PRMT", "MOV", "PLOP3", "P2R", "R2P", "BMSK", "SGXT", "IABS", "VABSDIFF", "VABSDIFF4",
       "F2FP", "FCHK", "HMNMX2", "ICMP", "CS2R", "S2R", "VOTE", "BREV", "VIADD"}
# (VIADD counted as ALU and the packed-half compares as FMA: assumed, not measured)
FMA = {"FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD", "HSET2", "HSETP2"}
IMAD = {"IMAD", "IMUL", "IDP", "IDP4A"}
XU = {"MUFU", "F2I", "I2F", "F2F", "I2I", "POPC", "FLO", "FRND"}
MEM = {"LDG", "STG", "LDS", "STS", "LDC", "LD", "ST", "ATOM", "ATOMG", "RED", "ATOMS", "LDL", "STL", "SHFL",
       "REDUX", "LDGSTS", "BAR", "MEMBAR", "DEPBAR", "ULDC"}
CTL = {"BRA", "EXIT", "BSSY", "BSYNC", "CALL", "RET", "NOP", "WARPSYNC", "BPT", "YIELD", "JMP", "BRX",
       "ACQBULK", "ELECT"}


def pipe(op: str) -> str:
    base = op.split(".")[0]
    if base.startswith("U") and base not in ("UNKNOWN",) and base[1:] in ALU | IMAD | MEM | {"FLO", "POPC"}:
        return "uniform"
    for name, group in (("alu", ALU), ("fma", FMA), ("imad", IMAD), ("xu", XU), ("mem", MEM), ("ctl", CTL)):
        if base in group:
            return name
    return "other:" + base


def _nvrtc():
    import nvidia.cuda_nvrtc as pkg
    found = sorted(p for root in pkg.__path__ for p in Path(root).glob("lib/libnvrtc.so.1[0-9]"))
    return ctypes.CDLL(str(found[-1]))


def cubin(src: str, arch: str = "sm_90") -> bytes:
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if rc:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode(errors="replace")[:4000])
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def listing(binary: bytes) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(binary)
    try:
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def functions(text: str) -> dict[str, list[str]]:
    """Function name -> its opcodes (with modifiers), in order."""
    out, cur = {}, None
    for line in text.splitlines():
        h = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if h:
            cur = h.group(1)
            out.setdefault(cur, [])
            continue
        i = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if i and cur is not None:
            out[cur].append(i.group(1))
    return out


def summary(ops: list[str]) -> tuple[dict, str]:
    pipes = collections.Counter(pipe(o) for o in ops)
    a, i, f = pipes["alu"], pipes["imad"], pipes["fma"]
    bound = max(sum(pipes.values()), 2 * a, 2 * i, i + f)
    ops_hist = collections.Counter(o.split(".")[0] for o in ops)
    text = (f"{len(ops)} instr; " + " ".join(f"{k}:{v}" for k, v in sorted(pipes.items()))
            + f"; cycle bound {bound} (issue {sum(pipes.values())}, alu {2 * a})\n  "
            + " ".join(f"{k}:{v}" for k, v in ops_hist.most_common(30)))
    return dict(pipes, bound=bound, total=len(ops)), text


def default_key(**over) -> dict:
    nb_row = int(over.pop("NB_ROW", 256))
    fast46 = int(over.get("FAST46", qc.FAST46))
    bpt = int(over.get("BPT", qc.FAST46_MAX_BPT if fast46 else 4))
    mae = bool(int(over.get("MAE", 0)))
    _, _, key = qc.rows_config(torch.bfloat16, True, mae, False, nb_row, bpt, fast46)
    d = dict(key)
    d.update({k: int(v) for k, v in over.items()})
    return d


def hot_source(src: str) -> str:
    """quant.cu with its out-of-line rare paths cut (calls replaced by constants), for static counts."""
    src = re.sub(r"(?<!void )errors_(exact|ieee)\(r,[^;]*\)", "0", src)
    fallback = "if (!lean46(r, sc, bamax, codes, sbits)) quantize46(r, sc, bamax, codes, sbits);"
    assert fallback in src, "quant.cu's FAST46 3 fallback changed: update hot_source"
    return src.replace(fallback, "lean46(r, sc, bamax, codes, sbits);")


def main(argv: list[str]) -> None:
    over = dict(a.split("=", 1) for a in argv if "=" in a)
    key = default_key(**over)
    src = qc.source(key)
    text = listing(cubin(hot_source(src) if "--hot" in argv else src))
    print("key:", " ".join(f"{k}={v}" for k, v in sorted(key.items())))
    for name, ops in functions(text).items():
        print(f"{name}: {summary(ops)[1]}")
    if "--list" in argv:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
