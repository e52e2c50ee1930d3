"""The CUDA C++ sources compile for the H100 / H200 (sm_90; sm_90a for the wgmma GEMM) with NVRTC on a machine
without a GPU, and ptxas reports no register spills in the configurations the launchers pick and no
serialized wgmma (warning C7515). That much of the GPU code CI can check; its results are GPU tests
(`pytest -m gpu`). NVRTC comes from the PyPI wheel nvidia-cuda-nvrtc-cu12 (the dev extra)."""

import ctypes
import re
from pathlib import Path

import pytest
import torch

from fp4rl.kernels import gemv_cuda, gemv_cuda_prenorm
from fp4rl.kernels.gemv_cuda_grouped import choose_grouped
from fp4rl.kernels.quantize import cuda as qc

nvrtc_pkg = pytest.importorskip("nvidia.cuda_nvrtc", reason="pip install nvidia-cuda-nvrtc-cu12 (dev extra)")


def _lib():
    """libnvrtc.so.<major> of the wheel (12 from the dev extra; a CUDA 13 torch may bring 13 instead)."""
    found = sorted(p for root in nvrtc_pkg.__path__ for p in Path(root).glob("lib/libnvrtc.so.1[0-9]"))
    if not found:
        pytest.fail(f"no libnvrtc.so.1x under {list(nvrtc_pkg.__path__)}")
    return ctypes.CDLL(str(found[-1]))


LIB = _lib()


def compile_log(src: str, arch: str) -> str:
    """NVRTC -> cubin for arch with ptxas -v; the log. A compile error fails the test with the log."""
    rc, text = _compile(src, arch)
    assert rc == 0, f"NVRTC failed for {arch}:\n{text[:3000]}"
    return text


def _compile_error(src: str, arch: str = "sm_90") -> str:
    """The log of a source that must not compile."""
    rc, text = _compile(src, arch)
    assert rc != 0, "the source compiled"
    return text


def _compile(src: str, arch: str) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
    rc = LIB.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    LIB.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    LIB.nvrtcGetProgramLog(prog, log)
    LIB.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def _output(src: str, arch: str, kind: str) -> bytes:
    """What NVRTC makes of src: kind "PTX" (for arch's virtual architecture) or "CUBIN" (for arch)."""
    prog = ctypes.c_void_p()
    assert LIB.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    target = arch.replace("sm_", "compute_") if kind == "PTX" else arch
    opts = [f"--gpu-architecture={target}".encode(), b"-std=c++17"]
    assert LIB.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
    n = ctypes.c_size_t()
    getattr(LIB, f"nvrtcGet{kind}Size")(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    getattr(LIB, f"nvrtcGet{kind}")(prog, buf)
    LIB.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def _ptx(src: str, arch: str) -> str:
    """The PTX NVRTC makes of src for arch's virtual architecture."""
    return _output(src, arch, "PTX").rstrip(b"\0").decode(errors="replace")


def spills(log: str) -> dict[str, tuple[int, int]]:
    """Per function: (spill store bytes, spill load bytes)."""
    pat = (r"Function properties for (\w+)\s*\n\s*ptxas\s+\.\s+\d+ bytes stack frame, "
           r"(\d+) bytes spill stores, (\d+) bytes spill loads")
    found = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(pat, log)}
    assert found, f"no ptxas function report in:\n{log[:2000]}"
    return found


def _quant_configs():
    for dtype in (torch.bfloat16, torch.float32):
        for rule46, mae, nf in ((False, False, False), (True, False, False), (True, True, True)):
            for nb, bpt in ((1, 1), (256, 1), (256, 2), (256, 4), (896, 2), (896, 4),
                            (qc.rows_max_blocks(dtype), 1)):
                for fast46 in ((3, 2, 0) if rule46 else (0,)):  # 4/6 under and over FAST46_MIN_BLOCKS
                    key = qc.rows_config(dtype, rule46, mae, nf, nb, bpt, fast46)[2]
                    yield f"rows {dtype} {rule46} {nb}x{bpt} fast46 {fast46}", key
            if rule46:  # lean46's row kernel reading each block twice (cuda.RELOAD46)
                for nb, bpt in ((1, 8), (256, 8), (256, 4), (896, 8), (qc.rows_max_blocks(dtype), 8)):
                    key = qc.rows_config(dtype, rule46, mae, nf, nb, bpt, 3, True)[2]
                    yield f"rows {dtype} {rule46} {nb}x{bpt} fast46 3 reload", key
            for src, given_rows in ((0, False), (2, True), (3, False)):
                for fast46 in ((3, 2, 0) if rule46 else (0,)):
                    key = qc.flat_config(dtype, rule46, mae, nf, src, given_rows, fast46)
                    yield f"flat {dtype} {rule46} src{src} fast46 {fast46}", key
                    if not given_rows:  # the 16x16 tile kernel with 2 and 4 tile pairs a warp (cuda.TILE16_U)
                        for u in (2, 4):
                            yield (f"tile {dtype} {rule46} src{src} fast46 {fast46} x{u}",
                                   qc.flat_config(dtype, rule46, mae, nf, src, False, fast46, TILE_U=u))
                            if u == 2 or dtype == torch.bfloat16:  # staged through shared memory
                                yield (f"tile {dtype} {rule46} src{src} fast46 {fast46} x{u} staged",
                                       qc.flat_config(dtype, rule46, mae, nf, src, False, fast46, TILE_U=u,
                                                      TILE_SMEM=1))


@pytest.mark.parametrize("name,key", list(_quant_configs()), ids=lambda v: v if isinstance(v, str) else "")
def test_quantize_kernels_compile_without_spills(name, key):
    found = spills(compile_log(qc.source(dict(key)), "sm_90"))
    for fn, (stores, loads) in found.items():
        assert stores == 0 and loads == 0, f"{name}: {fn} spills {stores} B / loads {loads} B"
    assert {"nvfp4_amax"} <= set(found)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_quantize_kernels_compile_before_hopper(arch):
    """quant.cu builds for Ampere and Ada too (cuda.usable takes compute capability >= 8): lean46's packed
    bfloat16 compare is sm_90 PTX, with a fallback below it."""
    for mae in (False, True):
        for key in (qc.rows_config(torch.bfloat16, True, mae, False, 256, 2, 3)[2],
                    qc.rows_config(torch.bfloat16, True, mae, False, 256, 8, 3, True)[2],
                    qc.flat_config(torch.bfloat16, True, mae, False, 0, False, 3)):
            compile_log(qc.source(dict(key)), arch)


def _eight_warps(cfg: dict) -> dict:
    """A wgmma configuration in its 8-warp form (the WS and ASH builds take no WARPS 4)."""
    return {key: v for key, v in cfg.items() if key != "WARPS"}


def _gemm_configs():
    sms = 132
    for n, k in ((4096, 14336), (14336, 4096), (4096, 6144)):
        for m in (1, 8, 16):
            yield f"mma16 {n}x{k} m{m}", gemv_cuda.choose(n, k, m, sms), "sm_90"
        for m in (32, 64, 128, 256, 512):  # MG 4 (XPRE 1), 8 and 16 (XPRE 2), several row blocks (NT by fill)
            yield f"wgmma {n}x{k} m{m}", gemv_cuda.choose_wide(n, k, m, sms), "sm_90a"
    for m, depth in ((128, 3), (512, 3), (64, 4)):  # ASH: the weights' A in shared memory (sweep variant)
        cfg = dict(_eight_warps(gemv_cuda.choose_wide(4096, 14336, m, sms)), NT=1, XPRE=2, ASH=1, DEPTH=depth)
        yield f"wgmma ash 4096x14336 m{m} d{depth}", cfg, "sm_90a"
    # the warp-specialized build (WS, FP4RL_WIDE_WS: a producer warp and the bulk / tensor copy engine):
    # MG 3 and 4 at splits 2-8, MG 8, 16 and 13 in row blocks, NT 2 at MG 8 (the most it takes), depths 2-6
    for (n, k), m, depth in (((4096, 4096), 32, 4), ((24576, 4096), 32, 6), ((4096, 12288), 24, 4),
                             ((4096, 14336), 64, 3), ((4096, 4096), 128, 2), ((4096, 4096), 300, 2)):
        cfg = dict(_eight_warps(gemv_cuda.choose_wide(n, k, m, sms)), WS=1, DEPTH=depth)
        yield f"wgmma ws {n}x{k} m{m} d{depth}", cfg, "sm_90a"
    cfg = dict(gemv_cuda.choose_wide(24576, 4096, 64, sms), WS=1, DEPTH=3, NT=2)
    yield "wgmma ws nt2 24576x4096 m64", cfg, "sm_90a"
    # one warpgroup a CTA (WARPS 4; the rule's 4096 x K above at 32 / 64 rows): MG 16 and 13 (an A/B key past
    # 64 rows), x's addresses per step (XPRE 0), a 3-deep ring
    for (n, k), m, extra in (((1008, 1280), 128, {}), ((4096, 4096), 200, {}),
                             ((4096, 4096), 32, {"XPRE": 0}), ((4096, 4096), 64, {"DEPTH": 3})):
        cfg = dict(gemv_cuda.choose_wide(n, k, m, sms), NT=1, WARPS=4, **extra)
        yield f"wgmma warps4 {n}x{k} m{m} MG {cfg['MG']} {extra}", cfg, "sm_90a"
    # 2-16 rows on the wgmma build (choose_narrow): one and two row groups, depth 2 and 3, clusters of 2-8
    for (n, k), m in (((4096, 4096), 8), ((24576, 4096), 4), ((4096, 14336), 16)):
        yield f"narrow {n}x{k} m{m}", gemv_cuda.choose_narrow(n, k, m, sms), "sm_90a"
    # WARPS 4 in the mma.sync builds (A/B key): the staged x slice and the streamed one (XSTREAM)
    for (n, k), m in (((4096, 4096), 8), ((4096, 14336), 16), ((24576, 4096), 16)):
        yield f"mma16 warps4 {n}x{k} m{m}", {**gemv_cuda.choose(n, k, m, sms), "WARPS": 4}, "sm_90"
    # the plain build's register bound (MINB, A/B): depth 3 at 4 CTAs a SM fits 64 registers without spills
    cfg = dict(gemv_cuda.choose_wide(24576, 4096, 32, sms), DEPTH=3, MINB=4)
    yield "wgmma mb4 d3 24576x4096 m32", cfg, "sm_90a"
    yield "grouped 2048x768", choose_grouped(2048, 768, 8, sms), "sm_90"
    yield "grouped gather 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1}, "sm_90"
    # the MoE down projection with SiLU(gate) * up in the x staging: 128 experts' 2048x768 at 1 token of top-8
    # (8 slots: split 2) and at 8 tokens (64 slots: split 1), and 1536x2048 on 8 slots
    for slots in (8, 64):
        cfg = {**choose_grouped(2048, 768, slots, sms), "SILU": 1}
        yield f"grouped silu 2048x768 s{slots}", cfg, "sm_90"
    yield "grouped silu 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "SILU": 1}, "sm_90"
    # per-row global scales read before the stream (GSR): one-row q/k/v and o, the experts' gate / up
    yield "mma16 gsr 5120x2048 m1", {**gemv_cuda.choose(5120, 2048, 1, sms), "GSR": 1}, "sm_90"
    yield "mma16 gsr 2048x4096 m1", {**gemv_cuda.choose(2048, 4096, 1, sms), "GSR": 1}, "sm_90"
    yield "grouped gather gsr 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1,
                                           "GSR": 1}, "sm_90"
    # the offsets and x_rows by volatile loads (LDVOL)
    yield "grouped gather ldvol 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1,
                                             "SLOTTABLE": 4, "LDVOL": 1}, "sm_90"
    yield "grouped silu ldvol 2048x768", {**choose_grouped(2048, 768, 8, sms), "SILU": 1,
                                          "SLOTTABLE": 4, "LDVOL": 1}, "sm_90"
    # the gate / up letting the next launch start once past its wait (TRIGGER 3: FP4RL_MMA16_GTRIGGER=3)
    yield "grouped gather trigger3 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1,
                                                "SLOTTABLE": 4, "TRIGGER": 3}, "sm_90"
    # the one-token gate / up with K over 2 warps (FP4RL_MMA16_GFILL=2: 192 CTAs; the default 3: 4 warps)
    yield "grouped gather kw2 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1,
                                           "SLOTTABLE": 4, "KW": 2}, "sm_90"
    # the experts' offsets in one round trip (SLOTTABLE 4: 128 experts, 8: 256)
    yield "grouped gather slottable 1536x2048", {**choose_grouped(1536, 2048, 8, sms), "GATHER": 1,
                                                 "SLOTTABLE": 4}, "sm_90"
    yield "grouped silu slottable 2048x768", {**choose_grouped(2048, 768, 64, sms), "SILU": 1,
                                              "SLOTTABLE": 8}, "sm_90"
    # the dense gate | up with SiLU * up in its epilogue (GU_SILU): Qwen3-8B / 14B at one row (in-CTA split),
    # Qwen3-4B (the plain build), KW 4, 8 rows, two row groups with x streamed
    for n, k in ((24576, 4096), (34816, 5120), (19456, 2560)):
        yield f"mma16 gu_silu {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "GU_SILU": 1}, "sm_90"
    yield "mma16 gu_silu kw4 8192x2048 m1", {**gemv_cuda.choose(8192, 2048, 1, sms), "GU_SILU": 1}, "sm_90"
    yield "mma16 gu_silu 2048x1280 m8", dict(NT=1, MG=1, SPLIT=1, DEPTH=2, GU_SILU=1), "sm_90"
    # the cluster's ranks finishing gate / up pairs (mma.sync, FP4RL_NARROW_WGMMA=0) and the wgmma builds the
    # gate | up gets at 2-64 rows (choose_narrow's one warpgroup, choose_wide's one and two)
    yield "mma16 gu_silu cluster 24576x4096 m8", {**gemv_cuda.choose(24576, 4096, 8, sms), "GU_SILU": 1}, \
        "sm_90"
    for (n, k), m in (((24576, 4096), 4), ((19456, 2560), 8), ((34816, 5120), 16)):
        yield f"narrow gu_silu {n}x{k} m{m}", {**gemv_cuda.choose_narrow(n, k, m, sms), "GU_SILU": 1}, \
            "sm_90a"
    for (n, k), m in (((24576, 4096), 32), ((19456, 2560), 24), ((34816, 5120), 64)):
        yield f"wgmma gu_silu {n}x{k} m{m}", {**gemv_cuda.choose_wide(n, k, m, sms), "GU_SILU": 1}, "sm_90a"
    yield "mma16 gu_silu xstream 2048x1280 m16", dict(NT=1, MG=2, SPLIT=1, DEPTH=2, XSTREAM=1, GU_SILU=1), \
        "sm_90"
    # the residual add + RMSNorm split over two GEMMs (RN_OUT / RN_IN): Qwen3-8B / 14B / 4B's o_proj and
    # down_proj, q/k/v (GSR: its per-row scales) and gate | up (GU_SILU) at one row; KW 4 / 2 at 8 rows
    for n, k in ((4096, 4096), (4096, 12288), (5120, 5120), (5120, 17408), (2560, 9728)):
        yield f"mma16 rn_out {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "RN_OUT": 1}, "sm_90"
    for n, k in ((6144, 4096), (8192, 5120)):
        yield f"mma16 rn_in gsr {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "RN_IN": 1, "GSR": 1}, "sm_90"
    for n, k in ((24576, 4096), (34816, 5120)):
        yield f"mma16 rn_in gu_silu {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "RN_IN": 1,
                                                  "GU_SILU": 1}, "sm_90"
    yield "mma16 rn_out kw4 2048x1024 m8", dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=4, RN_OUT=1), "sm_90"
    # RN_IN on the plain build (Qwen3-4B's gate | up at one row), 16 rows (two row groups, x staged)
    yield "mma16 rn_in gu_silu 19456x2560 m1", {**gemv_cuda.choose(19456, 2560, 1, sms), "RN_IN": 1,
                                                 "GU_SILU": 1}, "sm_90"
    yield "mma16 rn_in 1024x512 m16", dict(NT=1, MG=2, SPLIT=1, DEPTH=2, RN_IN=1), "sm_90"
    # RN_IN 2 (rstd after the stream, the sums copied with x): q/k/v, gate | up on the in-CTA split and plain
    yield "mma16 rn_in2 gsr 6144x4096 m1", {**gemv_cuda.choose(6144, 4096, 1, sms), "RN_IN": 2, "GSR": 1}, \
        "sm_90"
    for n, k in ((24576, 4096), (19456, 2560)):
        yield f"mma16 rn_in2 gu_silu {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "RN_IN": 2,
                                                   "GU_SILU": 1}, "sm_90"
    yield "mma16 rn_in2 1024x512 m16", dict(NT=1, MG=2, SPLIT=1, DEPTH=2, RN_IN=2), "sm_90"
    # GU_SILU's row scales read early (GSU): the three Qwen3 gate | ups at one row, with RN_IN 1 / 2, 8 rows
    for n, k in ((24576, 4096), (34816, 5120), (19456, 2560)):
        yield f"mma16 gu_silu gsu {n}x{k} m1", {**gemv_cuda.choose(n, k, 1, sms), "GU_SILU": 1, "GSU": 1}, \
            "sm_90"
    yield "mma16 gu_silu gsu rn_in 24576x4096 m1", {**gemv_cuda.choose(24576, 4096, 1, sms), "GU_SILU": 1,
                                                     "GSU": 1, "RN_IN": 1}, "sm_90"
    yield "mma16 gu_silu gsu rn_in2 19456x2560 m1", {**gemv_cuda.choose(19456, 2560, 1, sms), "GU_SILU": 1,
                                                      "GSU": 1, "RN_IN": 2}, "sm_90"
    yield "mma16 gu_silu gsu kw4 8192x2048 m8", dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=4, GU_SILU=1, GSU=1), \
        "sm_90"
    yield "mma16 rn_in kw2 1024x512 m8", dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2, RN_IN=1), "sm_90"


@pytest.mark.parametrize("name,cfg,arch", list(_gemm_configs()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_gemm_kernel_compiles_without_spills_or_serialized_wgmma(name, cfg, arch):
    w4a16_grouped = bool(cfg.get("GATHER", 0) or cfg.get("SILU", 0))  # builds for grouped W4A16 only
    w4a16 = w4a16_grouped or any(cfg.get(key) for key in ("GU_SILU", "RN_OUT", "RN_IN"))  # (dense W4A16)
    variants = ((False, False, name.startswith("grouped")), (True, not w4a16, w4a16_grouped))
    for wg_row, xg_row, grouped in variants:
        log = compile_log(gemv_cuda.source(cfg, wg_row, xg_row, grouped), arch)
        assert "C7515" not in log, f"{name}: ptxas serialized the wgmma pipeline:\n{log[:2000]}"
        for fn, (stores, loads) in spills(log).items():
            assert stores == 0 and loads == 0, f"{name} {cfg}: {fn} spills {stores} B / loads {loads} B"


@pytest.mark.parametrize("name,cfg,grouped,arch", [
    ("one row, in-CTA split", gemv_cuda.in_cta_split(gemv_cuda.choose(5120, 2048, 1, 132), 2048, 1), False,
     "sm_90"),
    ("8 rows, cluster split", gemv_cuda.choose(5120, 2048, 8, 132), False, "sm_90"),
    ("grouped silu", {**choose_grouped(2048, 768, 8, 132), "SILU": 1}, True, "sm_90"),
    ("wgmma", gemv_cuda.choose_wide(4096, 4096, 64, 132), False, "sm_90a"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_stamped_builds_compile_and_read_the_global_timer(name, cfg, grouped, arch):
    """The diagnostics build (fp4rl.benchmarks.stamps: STAMP_BUF) compiles on every exit path without spills,
    and only it reads %globaltimer."""
    plain = gemv_cuda.source(cfg, False, False, grouped)
    assert "STAMP_BUF" not in plain.split("\n", 1)[0]
    log = compile_log("#define STAMP_BUF 0x7f0000000000ull\n" + plain, arch)
    for fn, (stores, loads) in spills(log).items():
        assert stores == 0 and loads == 0, f"{name} stamped: {fn} spills {stores} B / loads {loads} B"
    stamped = _ptx("#define STAMP_BUF 0x7f0000000000ull\n" + plain, arch)
    assert "%globaltimer" not in _ptx(plain, arch)
    assert stamped.count("%globaltimer") >= 5, f"{name}: a stamp at each of five points expected"
    assert "atom.add.u64" in stamped, f"{name}: the record's slot is taken by an atomic"


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("name,cfg,grouped", [
    ("one row, in-CTA split", gemv_cuda.in_cta_split(gemv_cuda.choose(5120, 2048, 1, 132), 2048, 1), False),
    ("grouped silu, table", {**choose_grouped(2048, 768, 8, 132), "SILU": 1, "SLOTTABLE": 4}, True),
], ids=lambda v: v if isinstance(v, str) else "")
def test_stamps_taken_earlier_compile(name, cfg, grouped, at):
    """STAMP_AT (gemv_cuda.STAMP_AT, diagnostics): the third stamp once the expert is found (1) or x is issued
    (2) instead of staged; still five stamps, no spills, and a different program than the default's."""
    plain = gemv_cuda.source(cfg, False, False, grouped)
    head = "#define STAMP_BUF 0x7f0000000000ull\n"
    log = compile_log(f"{head}#define STAMP_AT {at}\n" + plain, "sm_90")
    for fn, (stores, loads) in spills(log).items():
        assert stores == 0 and loads == 0, f"{name} STAMP_AT {at}: {fn} spills {stores} B / loads {loads} B"
    moved = _ptx(f"{head}#define STAMP_AT {at}\n" + plain, "sm_90")
    assert moved.count("%globaltimer") >= 5, f"{name}: a stamp at each of five points expected"
    assert moved != _ptx(head + plain, "sm_90")


def _sass_text(src: str, arch: str = "sm_90") -> str:
    """nvdisasm's listing of src's cubin (NVRTC here, nvdisasm from the triton wheel)."""
    import subprocess
    import tempfile

    import triton

    cubin = _output(src, arch, "CUBIN")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


_SASS_INSN = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);"


def _sass_ops(src: str, arch: str = "sm_90") -> list[str]:
    """The opcodes of src's cubin in program order."""
    return [op for op, _ in re.findall(_SASS_INSN, _sass_text(src, arch))]


def _sass_insns(src: str, arch: str = "sm_90") -> list[tuple[str, str]]:
    """(opcode, operands) of src's cubin's instructions in program order."""
    return [(op, args.strip()) for op, args in re.findall(_SASS_INSN, _sass_text(src, arch))]


@pytest.mark.parametrize("extra", [{}, {"LDVOL": 1}], ids=["default", "ldvol"])
@pytest.mark.parametrize("name,cfg,wg_row,xg_row", [
    ("gather", {**choose_grouped(1536, 2048, 8, 132), "GATHER": 1, "SLOTTABLE": 4, "GSR": 1},
     True, False),
    ("silu", {**choose_grouped(2048, 768, 8, 132), "SILU": 1, "SLOTTABLE": 4}, False, False),
    ("plain, per-row scales", {**choose_grouped(1536, 2048, 8, 132), "SLOTTABLE": 4, "GSR": 1},
     True, False),
    ("w4a4, 64 slots", {**choose_grouped(1536, 2048, 64, 132), "SLOTTABLE": 4}, False, True),
    ("gather, K over 2 warps", {**choose_grouped(1536, 2048, 8, 132), "GATHER": 1, "SLOTTABLE": 4, "GSR": 1,
                                "KW": 2}, True, False),
], ids=lambda v: v if isinstance(v, str) else "")
def test_grouped_builds_load_nothing_before_the_wait(name, cfg, wg_row, xg_row, extra):
    """The routed experts' GEMMs read the offsets (and x_rows, x) the kernel before them writes: no global
    load or copy may come before griddepcontrol.wait (ACQBULK) in the SASS. ptxas moved the offsets'
    ld.global.nc above it in an L2-prefetch build (e14c14c) before its loads became volatile (LDVOL). Nor may
    any prefetch (CCTL): the builds have none."""
    ops = _sass_ops(gemv_cuda.source({**cfg, **extra}, wg_row, xg_row, True))
    wait = ops.index("ACQBULK")
    early = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "LDGSTS", "UBLKCP", "UTMALDG"))]
    assert not early, f"{name} {extra}: {early} before the wait"
    assert not any(op.startswith("CCTL") for op in ops[:wait]), f"{name} {extra}: a prefetch before the wait"


@pytest.mark.parametrize("name,cfg,wg_row,grouped", [
    ("gate / up", {**choose_grouped(1536, 2048, 8, 132), "GATHER": 1, "SLOTTABLE": 4}, True, True),
    ("down", {**choose_grouped(2048, 768, 8, 132), "SILU": 1, "SLOTTABLE": 4}, False, True),
    ("dense one row", gemv_cuda.choose(5120, 2048, 1, 132), True, False),
], ids=lambda v: v if isinstance(v, str) else "")
def test_where_each_trigger_goes(name, cfg, wg_row, grouped):
    """launch_dependents (PREEXIT): TRIGGER 1 before griddepcontrol.wait (ACQBULK); 3 once past the first
    wait and before the first multiply (HMMA), so that the next launch starts after the offsets' writer
    finished and overlaps this one's stream; 2 after the last multiply."""
    def where(trigger):
        ops = _sass_ops(gemv_cuda.source({**cfg, "TRIGGER": trigger}, wg_row, False, grouped))
        pre = [i for i, op in enumerate(ops) if op.startswith("PREEXIT")]
        mma = [i for i, op in enumerate(ops) if op.startswith("HMMA")]
        assert len(pre) == 1 and mma, (name, trigger, pre)
        return pre[0], ops.index("ACQBULK"), mma[0], mma[-1]

    pre, wait, _, _ = where(1)
    assert pre < wait, name
    pre, wait, first, _ = where(3)
    assert wait < pre < first, name
    pre, _, _, last = where(2)
    assert pre > last, name


def test_warps_4_is_refused_where_the_kernel_has_no_such_build():
    # WARPS 4 (64 weight rows a CTA) only for the plain dense builds: not with WS, ASH, the in-CTA split (KW),
    # the routed experts (GROUPED) or the fused RMSNorm (PRENORM)
    cfg = dict(gemv_cuda.choose_wide(4096, 4096, 32, 132), WARPS=4)
    one = gemv_cuda.in_cta_split(gemv_cuda.choose(4096, 4096, 1, 132), 4096, 1)
    assert one.get("KW", 1) > 1
    for bad, arch, grouped in ((dict(cfg, WS=1), "sm_90a", False),
                               (dict(cfg, ASH=1, DEPTH=3), "sm_90a", False),
                               ({**one, "WARPS": 4}, "sm_90", False),
                               ({**choose_grouped(2048, 768, 8, 132), "WARPS": 4}, "sm_90", True)):
        log = _compile_error(gemv_cuda.source(bad, False, False, grouped), arch)
        assert "WARPS 4 is for the plain dense builds" in log, bad


def test_gate_up_trigger_1_is_refused():
    import os
    import subprocess
    import sys

    env = {**os.environ, "FP4RL_MMA16_GTRIGGER": "1"}
    run = subprocess.run([sys.executable, "-c", "import fp4rl.kernels.gemv_cuda_grouped"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "FP4RL_MMA16_GTRIGGER=1" in run.stderr and "offsets" in run.stderr


def test_row_scales_early_need_the_in_cta_split():
    cfg = dict(gemv_cuda.choose(5120, 2048, 8, 132), GSR=1)  # 8 rows: the cluster split, no KW
    assert "GSR is for the in-CTA split" in _compile_error(gemv_cuda.source(cfg, True, False, False))


def test_volatile_offsets_need_grouped():
    cfg = dict(gemv_cuda.choose(5120, 2048, 1, 132), LDVOL=1)
    assert "LDVOL is for GROUPED" in _compile_error(gemv_cuda.source(cfg, False, False, False))


def test_gather_needs_grouped_w4a16():
    cfg = {**choose_grouped(1536, 2048, 8, 132), "GATHER": 1}
    for wg_row, xg_row, grouped in ((False, False, False), (False, True, True)):
        prog_log = _compile_error(gemv_cuda.source(cfg, wg_row, xg_row, grouped))
        assert "GATHER is for GROUPED W4A16" in prog_log


def test_silu_needs_grouped_w4a16_with_staged_x():
    """SILU (SiLU(gate) * up computed by the x staging) compiles only for grouped W4A16 with x staged whole:
    not dense, not W4A4 (XG_ROW), not with GATHER, not with x streamed (XSTREAM)."""
    cfg = {**choose_grouped(2048, 768, 8, 132), "SILU": 1}
    assert "XSTREAM" not in cfg and "WGMMA" not in cfg  # what launch_grouped builds (see the compile test)
    for c, wg_row, xg_row, grouped in ((cfg, False, False, False), (cfg, False, True, True),
                                       ({**cfg, "GATHER": 1}, False, False, True),
                                       ({**cfg, "XSTREAM": 1}, False, False, True)):
        prog_log = _compile_error(gemv_cuda.source(c, wg_row, xg_row, grouped))
        assert "SILU is for GROUPED W4A16" in prog_log, c


def test_gu_silu_needs_a_dense_w4a16_build_with_gate_up_pairs():
    """GU_SILU (the gate | up pairs in the epilogue) compiles only for dense W4A16 with an even number of
    n-tiles a CTA: not the warp-specialized build, W4A4 (XG_ROW), GSR, grouped or one n-tile a CTA (KW 8);
    gemv_cuda.gu_silu_ok refuses the configurations among them."""
    plain = dict(NT=1, MG=1, SPLIT=1, DEPTH=2, GU_SILU=1)
    ws = dict(_eight_warps(gemv_cuda.choose_wide(24576, 4096, 32, 132)), WS=1, DEPTH=3, GU_SILU=1)
    for c, wg_row, xg_row, grouped in ((ws, True, False, False), (plain, False, True, False),
                                       (dict(plain, KW=2, GSR=1), True, False, False),
                                       (plain, False, False, True), (dict(plain, KW=8), False, False, False)):
        prog_log = _compile_error(gemv_cuda.source(c, wg_row, xg_row, grouped))
        assert "GU_SILU needs a dense W4A16 build" in prog_log, c
    assert not gemv_cuda.gu_silu_ok(ws, 24576) and not gemv_cuda.gu_silu_ok(dict(plain, KW=8), 24576)
    compile_log(gemv_cuda.source(plain, True, False, False), "sm_90")


def test_rn_builds_need_the_dense_w4a16_in_cta_split():
    """RN_OUT / RN_IN compile only for a dense W4A16 GEMM that stages x whole (not the cluster, x streamed,
    W4A4, grouped), RN_OUT only on the in-CTA split and without GU_SILU or RN_IN; gemv_cuda.rn_ok refuses the
    same."""
    kw = dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=4)
    for c, xg_row, grouped in ((dict(kw, KW=1, SPLIT=4, RN_IN=1), False, False),
                               (dict(kw, KW=1, MG=2, XSTREAM=1, RN_IN=1), False, False),
                               (dict(kw, RN_IN=1), True, False), (dict(kw, RN_OUT=1), False, True)):
        assert "RN_OUT / RN_IN are for a dense W4A16 build that stages x whole" in _compile_error(
            gemv_cuda.source(c, False, xg_row, grouped)), c
    log = _compile_error(gemv_cuda.source(dict(kw, KW=1, RN_OUT=1), False))
    assert "RN_OUT is for the in-CTA split" in log
    log = _compile_error(gemv_cuda.source(dict(kw, KW=2, NT=3, RN_OUT=1), False))  # 192 rows a CTA
    assert "RN_OUT: a thread's epilogue columns must be one" in log
    for extra in ({"GU_SILU": 1}, {"RN_IN": 1}):
        assert "RN_OUT writes x' and xt of a plain y" in _compile_error(
            gemv_cuda.source(dict(kw, RN_OUT=1, **extra), False)), extra
    assert not gemv_cuda.rn_ok(dict(kw, KW=1), 1024) and gemv_cuda.rn_ok(kw, 1024)
    assert gemv_cuda.rn_ok(dict(kw, KW=1), 1024, out=False)  # (RN_IN: the plain build too)


def test_rn_builds_read_what_the_previous_kernels_wrote_after_the_wait():
    """RN_OUT reads the next norm's weight before griddepcontrol.wait (read-only in a step, as the weights)
    and the residual after it, by ld.global.cg; RN_IN reads the tile sums after it, the same way; the plain
    build has no such loads."""
    cfg = gemv_cuda.choose(4096, 4096, 1, 132)
    out = _ptx(gemv_cuda.source({**cfg, "RN_OUT": 1}, False), "sm_90")
    wait = out.index("griddepcontrol.wait")
    assert "ld.global.cg.b16" in out[wait:] and "ld.global.cg.b16" not in out[:wait]
    assert re.search(r"ld\.global\.nc\.[ub]16", out[:wait]), "the norm weight is read before the wait"
    cons = _ptx(gemv_cuda.source({**gemv_cuda.choose(6144, 4096, 1, 132), "RN_IN": 1}, False), "sm_90")
    wait = cons.index("griddepcontrol.wait")
    assert "ld.global.cg.f32" in cons[wait:] and "ld.global.cg" not in cons[:wait]
    assert "ld.global.cg.f32" not in _ptx(gemv_cuda.source(cfg, False), "sm_90")


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (5120, 5120)])
def test_rn_out_waits_for_the_residual_only_in_its_epilogue(n, k):
    """RN_OUT's residual load (issued after the wait, while x lands) is first read after the weight stream's
    last MMA: its first build converted it right after the staging barrier, so each CTA's first warp waited
    an L2 round trip before streaming (the producer GEMMs of Qwen3-8B / 14B at one row)."""
    insns = _sass_insns(gemv_cuda.source({**gemv_cuda.choose(n, k, 1, 132), "RN_OUT": 1}, False))
    loads = [i for i, (op, _) in enumerate(insns) if op.startswith("LDG.E.U16.STRONG")]
    assert loads, "the residual's ld.global.cg.b16"
    reg = re.match(r"(R\d+),", insns[loads[0]][1]).group(1)
    last_mma = max(i for i, (op, _) in enumerate(insns) if op.startswith("HMMA"))
    reads = [i for i, (_, args) in enumerate(insns) if i > loads[0]
             and re.search(rf"\b{reg}\b", args.split(",", 1)[1] if "," in args else "")]
    assert reads and min(reads) > last_mma, (reg, loads[0], min(reads, default=None), last_mma)


@pytest.mark.parametrize("n,k", [(24576, 4096), (34816, 5120), (19456, 2560)])
def test_gu_silu_row_scales_early_leave_nothing_to_load_after_the_stream(n, k):
    """The one-row GU_SILU gate | ups with per-row scales: the default build loads its gate / up row scales
    after the last MMA (an L2 round trip on each CTA's tail); GSU reads them before the stream and loads
    nothing there. GSU is refused where x is not staged whole (the cluster)."""
    cfg = {**gemv_cuda.choose(n, k, 1, 132), "GU_SILU": 1}

    def late_loads(c):
        insns = _sass_insns(gemv_cuda.source(c, True))
        last_mma = max(i for i, (op, _) in enumerate(insns) if op.startswith("HMMA"))
        return [op for op, _ in insns[last_mma:] if op.startswith("LDG")]

    assert late_loads(cfg) and not late_loads({**cfg, "GSU": 1})
    assert gemv_cuda.gsu_ok(cfg) and not gemv_cuda.gsu_ok(dict(cfg, KW=1, SPLIT=2))
    log = _compile_error(gemv_cuda.source(dict(NT=1, MG=1, SPLIT=2, DEPTH=2, GU_SILU=1, GSU=1), True))
    assert "GSU is for GU_SILU builds with SPLIT 1" in log


def test_gu_silu_build_pairs_gate_and_up_tiles_in_each_cta():
    """The GU_SILU source: each logical n-tile streams its physical tile through PTILE (gate's half of the
    CTA's tiles, then up's from N / 2), the three epilogues (SPLIT 1, KW, the cluster) call silu_up1 on the
    bf16-rounded pair and write column blockIdx.x NB / 2 + nl of y; the plain build keeps PTILE(lt) = lt."""
    src = gemv_cuda.source(dict(NT=1, MG=1, SPLIT=1, DEPTH=2, GU_SILU=1), True)
    assert "#define GU_SILU 1\n" in src and "(ntiles >> 1)" in src
    assert src.count("to_bf16(silu_up1(") == 3 and src.count("blockIdx.x * (NB / 2) + nl") >= 4
    assert "const u64 tile = ok[j] ? (u64)PTILE(tile0 + j) : 0;" in src
    assert "#define PTILE(lt) (lt)" in src  # (the #else branch: every other build)


def test_silu_build_uses_accurate_expf_and_ieee_division():
    """The SILU staging must be fused.silu_mul's arithmetic: libdevice's accurate expf (no fast-math option
    in the launcher's NVRTC options, no __expf in the source), the IEEE division (silu_div: checked against
    __fdiv_rn on every bf16 input by tests/test_gemv_cuda_grouped.py on the GPU), one rounded multiply."""
    cfg = {**choose_grouped(2048, 768, 8, 132), "SILU": 1}
    src = gemv_cuda.source(cfg, False, False, True)
    body = src[src.index("float silu_up1("):src.index("}", src.index("float silu_up1("))]
    assert "expf(-g)" in body and "__expf" not in body and "silu_div(" in body and "__fmul_rn(" in body
    assert "__fadd_rn(1.f, expf(-g))" in body
    launcher = Path(gemv_cuda.__file__).read_text()
    assert "fast_math" not in launcher and "fast-math" not in launcher and "ftz" not in launcher
    assert "#define SILU 1\n" in src


def test_every_c_and_cuda_source_ships_in_the_package():
    """pyproject's package-data patterns cover every .c / .cu / .h file under fp4rl/ (a wheel without
    kernels/quantize/quant.cu had no CUDA quantizer)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [p for ext in ("*.c", "*.cu", "*.h", "*.cuh") for p in (root / "fp4rl").rglob(ext)]
    assert sources
    missing = [str(p.relative_to(root)) for p in sources
               if not any(fnmatch.fnmatch(p.name, pat)
                          for pat in data.get(".".join(p.parent.relative_to(root).parts), []))]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


def test_in_cta_split_refuses_what_it_cannot_build():
    """KW (K split between the warps of a CTA) compiles only with SPLIT 1, x staged whole (no XSTREAM, no
    wgmma) and KW dividing the CTA's 8 warps; the configurations choose() makes compile (above)."""
    base = dict(NT=1, MG=1, DEPTH=2)
    for cfg in (dict(base, SPLIT=2, KW=2), dict(base, SPLIT=1, KW=2, XSTREAM=1), dict(base, SPLIT=1, KW=3)):
        assert "KW (in-CTA split-K) needs" in _compile_error(gemv_cuda.source(cfg, False)), cfg
    assert _compile(gemv_cuda.source(dict(base, SPLIT=1, KW=4), False), "sm_90")[0] == 0


_ROUTER_PLANS = [(1, 8, 128, 2048), (8, 8, 128, 2048), (8, 4, 60, 2048), (2, 2, 8, 576), (8, 16, 256, 1024),
                 (3, 6, 20, 296), (8, 16, 64, 4096)]


@pytest.mark.parametrize("t,k,e,h", _ROUTER_PLANS)
@pytest.mark.parametrize("norm,asy,prenorm", [(True, 0, 0), (False, 0, 0), (True, 1, 0), (True, 0, 1)])
def test_moe_router_route_compiles_without_spills(t, k, e, h, norm, asy, prenorm):
    """Spill-free; the static shared memory ptxas reports is at most moe_route_cuda.static_smem_bytes (the
    launcher adds it to the dynamic part to decide the opt-in past 48 KB), and the two fit one CTA (the
    largest plan here: 128 KB of dynamic shared memory, 200 KB with PRENORM's h rows and norm weight)."""
    from fp4rl.kernels import moe_route_cuda

    cfg = dict(moe_route_cuda.plan(t, k, e, h), ASYNC=asy, PRENORM=prenorm)
    log = compile_log(moe_route_cuda.source(cfg, norm), "sm_90")
    assert spills(log) == {"moe_router_route": (0, 0)}, log
    static = int(re.search(r"(\d+) bytes smem", log).group(1))
    assert moe_route_cuda.static_smem_bytes(cfg) - 32 < static <= moe_route_cuda.static_smem_bytes(cfg), log
    assert moe_route_cuda.smem_bytes(cfg) + static <= gemv_cuda.SMEM_MAX


@pytest.mark.parametrize("t,k,e,h", _ROUTER_PLANS[:3])
def test_moe_router_route_prenorm_reads_its_weights_before_the_wait_and_the_rows_after(t, k, e, h):
    """PRENORM (norm_router_route): before griddepcontrol.wait the router rows and the norm weight go to
    shared memory (LDGSTS: EPW x NCH + ceil(NCH 32 / 256) per thread) and nothing else is read from global
    memory (xr and hr are the previous kernels' outputs); their copies, CTA 0's stores of x' and y and the
    cluster barrier come after it."""
    from fp4rl.kernels import moe_route_cuda

    cfg = dict(moe_route_cuda.plan(t, k, e, h), ASYNC=0, PRENORM=1)
    insns = _sass_insns(moe_route_cuda.source(cfg, True))
    ops = [op for op, _ in insns]
    wait = ops.index("ACQBULK")
    # after the wait: every copy waited for (DEPBAR to 0 outstanding groups), then the block barriers of the
    # norm (rows staged, the warps' sums, y in place) before the cluster barrier's wait
    cluster = ops.index("UCGABAR_WAIT", wait)
    depbar = next(i for i in range(wait, cluster) if ops[i] == "DEPBAR.LE")
    assert insns[depbar][1].replace(" ", "").endswith(",0x0"), insns[depbar]
    assert ops[depbar:cluster].count("BAR.SYNC.DEFER_BLOCKING") == 3, ops[depbar:cluster]
    before = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "UBLKCP", "UTMALDG", "STG"))]
    weights = cfg["EPW"] * cfg["NCH"] + -(-cfg["NCH"] * 32 // 256)  # router rows, norm weight
    assert before.count("LDGSTS.E.BYPASS.128") == weights, before
    assert not [op for op in before if not op.startswith(("LDGSTS", "LDGDEPBAR"))], before
    after = ops[wait:]
    assert after.count("LDGSTS.E.BYPASS.128") >= 2 and "UCGABAR_WAIT" in after
    assert after.count("STG.E.128") >= 2  # x' and y, 16 bytes a store


@pytest.mark.parametrize("asy", [0, 1])
@pytest.mark.parametrize("t,k,e,h", _ROUTER_PLANS[:3])
def test_moe_router_route_reads_its_weight_before_the_wait_and_x_after(t, k, e, h, asy):
    """Before griddepcontrol.wait (ACQBULK) the SASS copies the warps' router rows to shared memory (LDGSTS,
    EPW x NCH per thread) and loads nothing else from global memory (x is the previous kernel's output);
    x's copies come after it, then the remote stores of the logits: with the cluster barrier (release: a
    MEMBAR.ALL.GPU), or ASYNC by st.async (STAS) and CTA 0's mbarrier wait (SYNCS...TRYWAIT), no MEMBAR; then
    CTA 0's top-k on redux.sync (REDUX, two per slot)."""
    from fp4rl.kernels import moe_route_cuda

    cfg = dict(moe_route_cuda.plan(t, k, e, h), ASYNC=asy)
    ops = _sass_ops(moe_route_cuda.source(cfg, True))
    wait = ops.index("ACQBULK")
    before = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "UBLKCP", "UTMALDG"))]
    assert before.count("LDGSTS.E.BYPASS.128") == cfg["EPW"] * cfg["NCH"], before
    assert not [op for op in before if not op.startswith(("LDGSTS", "LDGDEPBAR"))], before
    after = ops[wait:]
    assert "LDGSTS.E.BYPASS.128" in after and "UCGABAR_WAIT" in after
    if asy:
        assert "STAS" in after and not any(op.startswith("MEMBAR") for op in ops)
        assert after.index("LDGSTS.E.BYPASS.128") < after.index("STAS")
        assert any(op.startswith("SYNCS.PHASECHK") for op in after[after.index("STAS"):])
    else:
        assert "STAS" not in ops and "MEMBAR.ALL.GPU" in after
        assert after.index("LDGSTS.E.BYPASS.128") < after.index("UCGABAR_ARV")
    assert sum(op.startswith("REDUX") for op in after) == 2 * k
    assert ops.index("PREEXIT") < wait


def test_moe_router_route_uses_accurate_expf_and_ieee_division():
    """The softmax is moe_route_cuda.reference's: libdevice's accurate expf (torch's exp on the GPU), IEEE
    division; the launcher passes no fast-math option."""
    from fp4rl.kernels import moe_route_cuda

    src = moe_route_cuda.source(moe_route_cuda.plan(1, 8, 128, 2048), True)
    assert "expf(l[s] - mx)" in src and "__expf" not in src and "__fdiv_rn(l[s], sum)" in src
    launcher = Path(moe_route_cuda.__file__).read_text()
    assert "fast_math" not in launcher and "fast-math" not in launcher and "ftz" not in launcher


def _prenorm_plans():
    """The PRENORM builds prenorm_plan makes for Qwen3-8B's q/k/v and gate/up, 30B-A3B's q/k/v, a 4096-wide
    weight and an odd K (640: the last lanes' chunks past K), at 1-8 rows, with per-row (fused groups) and
    per-tensor global scales; PRENORM 2 (the MoE combine, 8 experts a token, bf16 or fp32 weights) for
    30B-A3B's q/k/v and the 8B-wide one."""
    shapes = ((6144, 4096), (24576, 4096), (4096, 4096), (5120, 2048), (144, 640))
    cases = [(n, k, 0, False) for n, k in shapes]
    cases += [(5120, 2048, 8, False), (5120, 2048, 8, True), (6144, 4096, 8, False), (144, 640, 3, True)]
    for n, k, ktop, f32 in cases:
        seen = set()
        for m in range(1, 9):
            cfg = gemv_cuda_prenorm.prenorm_plan(n, k, m, 132, ktop, f32)
            if cfg is not None and tuple(sorted(cfg.items())) not in seen:
                seen.add(tuple(sorted(cfg.items())))
                for wg_row in (True, False):
                    yield (f"{n}x{k} m{m} ktop {ktop} f32 {f32} wg_row {wg_row}",
                           gemv_cuda._row_scale_key(cfg, wg_row), wg_row)


@pytest.mark.parametrize("name,cfg,wg_row", list(_prenorm_plans()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_gemm_prenorm_builds_compile_without_spills(name, cfg, wg_row):
    """Spill-free, and the static shared memory is at most prenorm_static_bytes (the row sums; PRENORM 2: and
    the experts' positions and weights), which the launcher adds to the dynamic size when it opts in past 48
    KB."""
    log = compile_log(gemv_cuda.source(cfg, wg_row), "sm_90")
    assert spills(log) == {"w4a16_mma16": (0, 0)}, f"{name}:\n{log[:2000]}"
    static = re.search(r"(\d+) bytes smem", log)
    assert static and int(static.group(1)) <= gemv_cuda_prenorm.prenorm_static_bytes(cfg), log


@pytest.mark.parametrize("n,k,m", [(6144, 4096, 1), (24576, 4096, 1), (5120, 2048, 1), (6144, 4096, 4)])
def test_gemm_prenorm_reads_only_weights_before_the_wait_and_writes_x_prime_in_16_bytes(n, k, m):
    """PRENORM: before griddepcontrol.wait (ACQBULK) the SASS copies the first weight steps and the norm
    weight to shared memory (LDGSTS) and reads at most the weight's one global scale (LDG.E.CONSTANT, GSE /
    GSR); the residual's and hr's rows (the previous kernels' outputs) are copied after it, every copy is
    waited for (DEPBAR to 0 groups), then three block barriers (rows staged; the warps' sums; y in place)
    before the first multiply, and CTA 0's x' goes out in 16-byte stores (STG.E.128) between the last two."""
    cfg = gemv_cuda._row_scale_key(gemv_cuda_prenorm.prenorm_plan(n, k, m, 132), True)
    insns = _sass_insns(gemv_cuda.source(cfg, True))
    ops = [op for op, _ in insns]
    wait = ops.index("ACQBULK")
    before = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "UBLKCP", "UTMALDG", "STG"))]
    assert before.count("LDG.E.CONSTANT") <= 1, before
    assert not [op for op in before if not op.startswith(("LDGSTS", "LDGDEPBAR", "LDG.E.CONSTANT"))], before
    weights = cfg["DEPTH"] * cfg["NT"] * 3  # two 16-byte copies of weight words and one of scales a step
    assert sum(op.startswith("LDGSTS") for op in before) > weights, before  # and the norm weight's
    first_mma = next(i for i in range(wait, len(ops)) if ops[i].startswith("HMMA"))
    depbar = next(i for i in range(wait, first_mma) if ops[i] == "DEPBAR.LE")
    assert insns[depbar][1].replace(" ", "").endswith(",0x0"), insns[depbar]
    assert any(op.startswith("LDGSTS") for op in ops[wait:depbar])  # the rows, after the wait
    bars = [i for i in range(depbar, first_mma) if ops[i] == "BAR.SYNC.DEFER_BLOCKING"]
    assert len(bars) == 3, ops[depbar:first_mma]
    stores = [i for i in range(depbar, first_mma) if ops[i].startswith("STG")]
    assert stores and all(ops[i] == "STG.E.128" and bars[1] < i < bars[2] for i in stores), \
        [ops[i] for i in stores]


def test_gemm_prenorm_is_refused_where_x_is_not_staged_whole():
    """PRENORM compiles only for a dense W4A16 build that stages x's whole K: not with a cluster split of K,
    x streamed in chunks, the wgmma build, routed experts, W4A4's x scales or SiLU staging."""
    base = dict(NT=1, MG=1, SPLIT=1, DEPTH=2, PRENORM=1)
    for cfg, args in ((dict(base, SPLIT=2), (False,)), (dict(base, MG=2, XSTREAM=1), (False,)),
                      (dict(base, KW=2), (False, False, True)), (dict(base, KW=2), (False, True))):
        log = _compile_error(gemv_cuda.source(cfg, *args))
        assert "PRENORM needs a dense W4A16 build" in log, (cfg, args)
    assert _compile(gemv_cuda.source(dict(base, KW=2), False), "sm_90")[0] == 0


@pytest.mark.parametrize("f32", [False, True])
@pytest.mark.parametrize("n,k,m", [(5120, 2048, 1), (5120, 2048, 2)])
def test_gemm_prenorm_combine_reads_the_route_after_the_wait_then_gathers(n, k, m, f32):
    """PRENORM 2 (the MoE combine): before griddepcontrol.wait only the weights' and the norm weight's copies
    (and the one global scale); after it the route's pos and weights come from L2 (LDG.E.STRONG.GPU, .U16 for
    bf16 weights: ld.global.cg, not an L1 line of an earlier layer), a block barrier, then the gathers of the
    experts' rows (LDGSTS), every copy waited for, and three barriers more before the first multiply."""
    cfg = gemv_cuda._row_scale_key(gemv_cuda_prenorm.prenorm_plan(n, k, m, 132, 8, f32), True)
    insns = _sass_insns(gemv_cuda.source(cfg, True))
    ops = [op for op, _ in insns]
    wait = ops.index("ACQBULK")
    before = [op for op in ops[:wait] if op.startswith(("LDG", "LD.", "UBLKCP", "UTMALDG", "STG"))]
    assert not [op for op in before if not op.startswith(("LDGSTS", "LDGDEPBAR", "LDG.E.CONSTANT"))], before
    first_mma = next(i for i in range(wait, len(ops)) if ops[i].startswith("HMMA"))
    route = [i for i in range(wait, first_mma) if ops[i].startswith("LDG.E") and "STRONG.GPU" in ops[i]]
    u16 = ["U16" in ops[i] for i in route]  # the bf16 weights' 2-byte loads; pos (and fp32 weights): 4 bytes
    assert route and not all(u16) and any(u16) != f32, [ops[i] for i in route]
    bars = [i for i in range(wait, first_mma) if ops[i] == "BAR.SYNC.DEFER_BLOCKING"]
    assert len(bars) == 4 and route[-1] < bars[0], (route, bars)
    gathers = [i for i in range(bars[0], bars[1]) if ops[i].startswith("LDGSTS")]
    depbar = next(i for i in range(bars[0], bars[1]) if ops[i] == "DEPBAR.LE")
    assert gathers and gathers[-1] < depbar and insns[depbar][1].replace(" ", "").endswith(",0x0")
