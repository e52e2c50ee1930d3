"""Compile a Triton kernel for sm_90 without a GPU and summarise its SASS (dev tool for bench/gpu_kernels.md).

Run with the Triton version the device has (3.6 on the H200 image), e.g.
  PYTHONPATH=/tmp/t36/site python bench/sass.py
Pointer and stride arguments get tt.divisibility=16, as the JIT adds at run time.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, types: dict, constexprs: dict, num_warps=4, num_stages=3, div16=()):
    """types: arg name -> '*u8' / 'i32' ...; constexprs: name -> value; div16: int args divisible by 16."""
    names = fn.arg_names
    sig, attrs, cst = {}, {}, {}
    for i, a in enumerate(names):
        if a in constexprs:
            sig[a] = "constexpr"
            cst[(i,)] = constexprs[a]
        else:
            sig[a] = types[a]
            if types[a].startswith("*") or a in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=cst, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass(k, flag="-sass") -> str:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(bin_dir, "cuobjdump"), flag, f.name], capture_output=True, text=True)
    os.unlink(f.name)
    return out.stdout


def summary(k, label="") -> str:
    s = sass(k)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", s)
    hist = collections.Counter(o.split(".")[0] for o in ops)
    ttg = k.asm.get("ttgir", "")
    conv = ttg.count("convert_layout")
    meta = k.metadata
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", sass(k, "-res-usage"))
    regs = res.group(1) if res else "?"
    local = res.group(4) if res else "?"
    return (f"{label}: regs={regs} local={local} smem={meta.shared} instr={len(ops)} "
            f"convert_layout={conv}\n  " + " ".join(f"{o}:{c}" for o, c in hist.most_common(28)))


def hot_loops(sass_text: str) -> list[str]:
    """Instruction mix of every backward-branch loop body in a SASS listing (the hot loops)."""
    lines = sass_text.splitlines()

    def addr(line):
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        return int(m.group(1), 16) if m else None

    out = []
    for line in lines:
        m = re.search(r"BRA (0x[0-9a-f]+)", line)
        a = addr(line)
        if m and a is not None and int(m.group(1), 16) < a:
            start = int(m.group(1), 16)
            body = [x for x in lines if addr(x) is not None and start <= addr(x) <= a]
            ops = [o.group(1).split(".")[0] for o in
                   (re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", x) for x in body) if o]
            hist = collections.Counter(ops)
            out.append(f"loop {start:#x}-{a:#x}: {len(ops)} instr: "
                       + " ".join(f"{k}:{v}" for k, v in hist.most_common(16)))
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
