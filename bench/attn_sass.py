"""Offline SASS of the Gluon NVFP4 decode-attention kernel for sm_90 (no GPU needed): registers, spills and
the main loop's instruction mix per 16-token step, for one step mode / warps / register cap.

The kernel is written for Triton 3.6 (the device machine's). On a CPU machine, unpack its wheel and put it
first on the path (ptxas and cuobjdump come with it):
    pip download --no-deps triton==3.6.0 -d /tmp/t36
    python3 -m zipfile -e /tmp/t36/triton-3.6.0-*.whl /tmp/t36/site
    chmod +x /tmp/t36/site/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36/site:. python3 bench/attn_sass.py [--mode 20] [--warps 4] [--maxnreg 168] [--dbg 0]
The main loop is the longest backward branch; the instructions of the rarely taken branches inside it (the
softmax references' update) are reported apart from the common path."""

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")


def compile_kernel(mode: int, warps: int, maxnreg: int | None, dbg: int, pf: int = 3) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fp4rl.kernels.attention import gluon_decode, gluon_ptx

    fn = gluon_decode._decode_attn_fp4_gluon
    ptrs = {"q_ptr": "*bf16", "kw_ptr": "*i32", "ks_ptr": "*i16", "kg_ptr": "*fp32", "vw_ptr": "*i32",
            "vs_ptr": "*u8", "vg_ptr": "*fp32", "len_ptr": "*i32", "start_ptr": "*i32", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "ml_ptr": "*fp32", "lock_ptr": "*i32"}
    const = dict(stride_kt=16, stride_kst=4, stride_vt=16, stride_vst=8, G=4, NUM_SPLITS=6, HAS_START=False,
                 ASM=gluon_ptx._ATTN_ASM[mode], CON=gluon_ptx._ATTN_CON, PF=pf, DBG=dbg)
    names = fn.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32") for n in names}
    src = GluonASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()})
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["cubin"]


def sass_of(cubin: bytes) -> tuple[str, str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        sass = subprocess.run([str(tool), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(tool), "-res-usage", fh.name], capture_output=True, text=True).stdout
    return sass, res


def loop_mix(sass: str):
    """(common-path instructions, rare-branch instructions, opcode counts) of the longest loop."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = (0, 0, 0)
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            best = max(best, (i - at[int(m.group(1), 16)] + 1, at[int(m.group(1), 16)], i))
    n, s, e = best
    skipped = 0
    for i in range(s, e):  # each warp vote guards a rarely taken block: the predicated branch after it
        if "VOTE" not in ins[i][1]:
            continue
        for k in range(i + 1, min(i + 40, e)):
            m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins[k][1])
            if m:
                j = at.get(int(m.group(1), 16), -1)
                if k < j <= e:
                    skipped += j - k - 1
                break
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                              for _, t in ins[s:e + 1])
    return n - skipped, skipped, ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", type=int, default=20)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int, default=168)
    ap.add_argument("--dbg", type=int, default=0)
    args = ap.parse_args()
    sass, res = sass_of(compile_kernel(args.mode, args.warps, args.maxnreg or None, args.dbg))
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    common, rare, ops = loop_mix(sass)
    print(f"registers {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'} B, "
          f"local loads/stores {len(re.findall(r'LDL|STL', sass))}")
    print(f"main loop (2 steps): {common} instructions on the common path ({common / 2:.1f} per step), "
          f"{rare} in rarely taken branches")
    print("opcodes in the loop:", ", ".join(f"{k} {v}" for k, v in ops.most_common(16)),
          f"(local loads/stores in the loop: {ops['LDL'] + ops['STL']})")


if __name__ == "__main__":
    main()
