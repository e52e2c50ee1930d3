"""The integer PTX of the Gluon NVFP4 attention's unpack (fp4rl.kernels.attention.gluon_ptx), run on CPU.

A small interpreter executes the exact instruction text the kernel inlines (shifts, lop3, and)
on numpy words, and the FP16 pairs it leaves must be the E2M1 values x 2^-14 of the codes
(0,4), (2,6), (1,5), (3,7), bit for bit, for every code in every position."""

import re

import numpy as np
import pytest

from fp4rl.kernels.attention.gluon_ptx import _ATTN_MSK, _attn_asm, _attn_unpack

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
M32 = np.uint64(0xFFFFFFFF)


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(8):  # minterm bit = lut bit at index (a << 2 | b << 1 | c)
        if (lut >> bit) & 1:
            ta = a if bit & 4 else ~a & M32
            tb = b if bit & 2 else ~b & M32
            tc = c if bit & 1 else ~c & M32
            out |= ta & tb & tc
    return out


def run_ptx(text: str, regs: dict) -> dict:
    """Interprets the integer instructions of `text` on uint32 values held as uint64 numpy arrays."""

    def val(x):
        x = x.strip()
        if x in regs:
            return regs[x]
        return np.uint64(int(x, 0))

    for line in text.strip().splitlines():
        m = re.fullmatch(r"([\w.]+)\s+(.*);", line.strip())
        assert m, line
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        d = args[0]
        if op == "mov.b32":
            regs[d] = val(args[1]) & M32
        elif op == "shl.b32":
            regs[d] = (val(args[1]) << np.uint64(int(args[2]))) & M32
        elif op == "shr.s32":
            x, n = val(args[1]), int(args[2])
            sign = (x >> np.uint64(31)) & np.uint64(1)
            fill = (sign * np.uint64((0xFFFFFFFF << (32 - n)) & 0xFFFFFFFF))
            regs[d] = ((x >> np.uint64(n)) | fill) & M32
        elif op == "lop3.b32":
            regs[d] = _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0))
        elif op == "and.b32":
            regs[d] = val(args[1]) & val(args[2])
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


def _words():
    rng = np.random.default_rng(0)
    codes = np.stack(np.meshgrid(*[np.arange(16)] * 2, indexing="ij"), -1).reshape(-1, 2)  # all pairs
    words = []
    for pos in range(8):  # every pair of codes in positions (pos, pos') over random others
        other = (pos + 4) % 8
        c = rng.integers(0, 16, size=(len(codes), 8))
        c[:, pos], c[:, other] = codes[:, 0], codes[:, 1]
        words.append(c)
    c = np.concatenate(words + [rng.integers(0, 16, size=(4096, 8))])
    w = np.zeros(len(c), dtype=np.uint64)
    for k in range(8):
        w |= c[:, k].astype(np.uint64) << np.uint64(4 * k)
    return w, c


@pytest.mark.parametrize("mode", [20, 4])
def test_unpack_ptx_is_exact(mode):
    w, c = _words()
    step = _attn_asm(mode)
    const = re.search(r"mov.b32 k70, (0x[0-9a-fA-F]+);", step).group(1)
    regs = {"w": w, "k7": np.uint64(0x07070707), "k70": np.uint64(int(const, 16)),
            "msk": np.uint64(_ATTN_MSK)}
    r = ["r0", "r1", "r2", "r3"]
    assert _attn_unpack("$40", r) in step  # the text run here is the one the step inlines (K word 0)
    out = run_ptx(_attn_unpack("w", r), regs)
    for i, (lo, hi) in enumerate([(0, 4), (2, 6), (1, 5), (3, 7)]):
        r = out[f"r{i}"].astype(np.uint32)
        halves = np.stack([r & 0xFFFF, r >> 16], -1).astype(np.uint16).view(np.float16).astype(np.float64)
        want = np.stack([E2M1[c[:, lo]], E2M1[c[:, hi]]], -1) * 2.0 ** -14
        np.testing.assert_array_equal(halves, want)
        np.testing.assert_array_equal(np.signbit(halves), np.signbit(want))  # -0 stays -0


def test_interpreter_catches_a_wrong_mask():
    w, c = _words()
    regs = {"w": w, "k7": np.uint64(0x07070707), "k70": np.uint64(0x70707070), "msk": np.uint64(_ATTN_MSK)}
    out = run_ptx(_attn_unpack("w", ["r0", "r1", "r2", "r3"]), regs)  # the form needs k70 = 0xF0707070
    r = out["r3"].astype(np.uint32)
    hi = (r >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    assert not np.array_equal(np.signbit(hi), np.signbit(E2M1[c[:, 7]]))
