"""The CUDA C++ quantize kernels (quant.cu), compiled by NVRTC at run time: 1x16 blocks, round to nearest,
rule 6 and 4/6, per-tensor, per-row and imposed scales, bfloat16 and float32 input, and 16x16 tiles with a
per-tensor or imposed scale; the same bytes as fp4rl.nvfp4.reference (GPU-tested against it).

``quantize_2d`` takes them on CUDA for those modes (stochastic rounding, float16 input and rows longer than
``ROWS_MAX_BLOCKS`` blocks stay on the Triton kernels). If NVRTC or the launch fails here,
they switch off with a warning and the Triton kernels take over (``STATE["error"]`` keeps why);
``FP4RL_QUANT_CUDA=0`` switches them off from the start.

Launch shapes: the flat kernel (per-tensor or imposed scales) is grid-stride, one 16-element block per
thread per step, 256 threads per CTA, about 16 CTAs per SM. The row kernel (per-row scales in one pass)
gives each row TPR threads (a power of two) holding BPT blocks each, TPR x BPT >= blocks per row. The
tile kernel is grid-stride over warps, a warp two 16x16 tiles side by side (a half-warp a tile, a lane a row's
block), 256 threads per CTA; with rule 6 the strip kernel (STRIP16) takes 16x16 tiles instead: a warp 16 rows
x 16 bfloat16 (8 float32) block columns, a lane 16 bytes of each of the 16 rows.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from fp4rl.kernels import pdl
from fp4rl.kernels._common import INTERPRET

_SOURCE = Path(__file__).with_name("quant.cu")
STATE = {"on": os.environ.get("FP4RL_QUANT_CUDA", "1") != "0", "error": None}
MAX_TPR = 512
MAX_BPT = 8
def _fast46_from_env() -> int:
    raw = os.environ.get("FP4RL_QUANT_FAST46", "3").strip()
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"FP4RL_QUANT_FAST46={raw!r}: use 3 (the default), 2, 1, or 0 for the exact 4/6 "
                         "errors of every block")
    return int(raw)


# rule 4/6: decide most blocks from quant.cu's bounded cheaper error (decide46), the exact errors only where
# it cannot (the same bytes): 3 with FAST46 2's arithmetic in fewer instructions where lean46's guards hold
# (nonzero E4M3 scales, finite blocks: nearly every block), 2 with both candidates' codes from that pass, 1
# with the winner's codes in a pass of their own, 0 the exact errors of every block (FP4RL_QUANT_FAST46; the
# benchmark sets it here)
FAST46 = _fast46_from_env()
ROWS_MAX_BLOCKS = MAX_TPR * MAX_BPT  # K <= 65536 for per-row scales in one pass (bfloat16)
MAX_BLOCKS = 2 ** 31 - 2 ** 26  # 16-element blocks per call (int block indices, grid-stride headroom)
_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
# blocks per thread of the row kernel (at least), per scale rule: None picks by size (`rows_bpt`); benchmarks
# set numbers
ROWS_BPT = {"6": None, "4/6": None}
# CTAs of 256 threads per SM that the registers must allow, per (rule 4/6, blocks per thread), bfloat16 input:
# no spills on the common path (ptxas, sm_90): rule 6 fits 32 / 40 / 64 registers at 1 / 2 / 4 blocks, 4/6
# 64 / 80 / 118 (float32 input: no cap). Rule 4/6 with decide46 (FAST46 1-3): 64 / 64 / 80, the fastest of
# the caps swept on an H200 (bench/RESULTS.md, twenty-sixth session: 2 blocks a thread at 64 registers, 32
# warps an SM, 237.7 us for 32768x4096 against 258.1 at 4 blocks and 128 registers)
_MIN_BLOCKS = {(False, 1): 8, (False, 2): 6, (False, 4): 4, (True, 1): 4, (True, 2): 3, (True, 4): 2}
_MIN_BLOCKS_FAST46 = {1: 4, 2: 4, 4: 3}
FAST46_MAX_BPT = 2  # rule 4/6 with decide46: at most 2 blocks a thread in the row kernel (see above)
# rule 4/6 with lean46 (FAST46 3), bfloat16: the row kernel reading each block twice (RELOAD: the row max,
# then one block at a time from L1 / L2 with the next in flight), 8 or 4 blocks a thread (more per-row work
# shared, fewer threads per row: one warp a row at K <= 4096 and no barrier) where that still leaves
# RELOAD46_MIN_WAVES x the GPU's thread slots (`reload_bpt`), 64 registers (MIN_BLOCKS_RELOAD CTAs of 256
# threads per SM). Measured on an H200 (bench/RESULTS.md, twenty-seventh session): 32768x4096 191.5 -> 183.1
# us, 8192x14336 189.1 -> 163.9 at 8 a thread; 4096x4096 29.7 -> 34.2 (8) / 30.6 (4): too few threads, off
RELOAD46 = os.environ.get("FP4RL_QUANT_RELOAD46", "1") != "0"
RELOAD46_MIN_WAVES = 2.0
# rows of more than RELOAD46_LONG_ROW blocks (K > 8192: held 2 a thread, 512-thread CTAs with a barrier over
# 16 warps a row) read twice at 4 a thread from RELOAD46_MIN_WAVES_LONG x the thread slots (8 a thread from
# RELOAD46_MIN_WAVES as other rows). Measured on an H200 (bench/RESULTS.md, twenty-eighth session), 4/6 mse,
# held / 4 / 8 a thread: 1024x14336 24.8 / 23.5 / 26.9 us, 2048x14336 45.2 / 41.7 / 45.2, 4096x14336 84.1 /
# 75.8 / 78.9, 8192x14336 162.3 / 144.4 / 144.0; K = 8192 gained nothing (2048, 4096 rows: held = 4 a thread)
RELOAD46_LONG_ROW = 512
RELOAD46_MIN_WAVES_LONG = 0.8
MIN_BLOCKS_RELOAD = 4
# decide46 from this many 16-element blocks per call: the exact errors were faster on the H200 up to 128x4096
# (3.5 vs 3.9 us), even at 256 and 512 rows, decide46 faster from 1024 rows (11.8 vs 12.5 us; 4096x4096 34.4
# vs 39.1; bench/RESULTS.md, twenty-sixth session)
FAST46_MIN_BLOCKS = int(os.environ.get("FP4RL_QUANT_FAST46_MIN_BLOCKS", str(1 << 17)))
# 16x16 tiles with rule 6 on CUDA, the strip kernel (STRIP16; nvfp4_quant_strip16: a warp 16 rows x 512
# contiguous bytes, 16 bytes a lane a row held in registers; its register cap is quant.cu's STRIP_MINB, its
# compile key the flat kernel's): on an H100, 32768x4096 bf16, 0.257 -> 0.222 ms with the tensor's amax
# (Triton), 0.162 -> 0.128 with an imposed g; the tile kernel (STRIP16 False) took 0.320 (bench/RESULTS.md,
# forty-fifth session). False: the Triton kernel.
TILE16_RULE6 = True
STRIP16 = True
# tile pairs a warp of the tile kernel at a time, their loads issued together (quant.cu TILE_U: 1, 2 or 4;
# 64 / 80 / 128 registers for bfloat16 4/6), and with TILE16_SMEM staged through the warp's shared memory with
# coalesced loads (TILE_SMEM) where a tile row's pairs are a multiple of TILE16_U (float32 at 2 only: 48 KB of
# static shared memory a CTA). 16x16 4/6 decided per tile on an H100, medians of three: 32768x4096 bf16 0.341
# (1) -> 0.334 (2) -> 0.322 ms (2 staged), 0.353 at 4; 8192x14336 0.299 -> 0.293 -> 0.288, 0.313 at 4
# (bench/RESULTS.md, forty-fifth session)
TILE16_U = 2
TILE16_SMEM = True
# 16x16 tiles with rule 4/6: decide46 per tile (quant.cu tile46_decide: lean46's cheap errors and bounds
# summed over the tile, the exact errors only where they cannot tell) from FAST46_MIN_BLOCKS blocks, with
# FAST46 3: on an H100, 32768x4096 bf16 0.395 -> 0.339 ms (mse; mae 0.382 -> 0.339), the same bytes
# (bench/RESULTS.md, forty-fifth session; its arithmetic tile by tile on the CPU in
# tests/test_quant_tile46.py, the kernel under a warp emulator in tests/test_quant_warp.py).
# FP4RL_QUANT_TILE_FAST46=0 turns it off.
TILE16_FAST46 = os.environ.get("FP4RL_QUANT_TILE_FAST46", "1") != "0"
# 16x16 rule 4/6 decided per tile (TILE16_FAST46) on the strip kernel for bfloat16 (quant.cu strip_decide46:
# each lane's cheap errors and codes over its 16 rows' halves in one pass and a Cauchy-Schwarz bound, the
# exact errors in the reference's order only for a warp with a tile the bound leaves, its rows read again).
# On an H100, bf16, medians of three against the tile kernel: 32768x4096 mse 0.328 -> 0.275 ms, mae 0.328 ->
# 0.257, imposed g 0.227 -> 0.173; 8192x14336 mse 0.289 -> 0.246 (bench/RESULTS.md, forty-sixth session).
# FP4RL_QUANT_STRIP46=0 turns it off (the tile kernel).
STRIP16_46 = os.environ.get("FP4RL_QUANT_STRIP46", "1") != "0"
# the strip kernel's grid: at most this many CTAs per SM (2 fit at once), each looping over strips past that.
# On an H100, 32768x4096 bf16 (a strip a warp: 31 CTAs an SM), medians of three: 16x16 4/6 mse 0.274 ms at 8
# (4 waves), 0.261 at 16, 0.258 at 32 or 64 (0.303 at 2: one wave, each CTA looping); with an imposed g
# 0.174 -> 0.160 (2.15 TB/s); rule 6 0.223 -> 0.218, imposed g 0.1276 -> 0.1234 (bench/RESULTS.md,
# forty-sixth session)
STRIP16_CTAS_PER_SM = 32
# the grid caps of the per-tensor amax pass (nvfp4_amax, 512 blocks a CTA at least) and of the flat 1x16
# kernel (nvfp4_quant_flat, a block a thread; rule 6, rule 4/6), CTAs an SM; both grid-stride past them. On
# an H100, 32768x4096 bf16, medians of three (bench/quant_grid.py, forty-sixth session): the amax pass 0.100
# ms at 4-256; rule 6 with an imposed g 0.1275 at 16 -> 0.121 at 64 (2.85 TB/s), with the tensor's amax 0.217
# -> 0.215; rule 4/6 best at 16-32 (imposed g 0.156; 0.179 at 256)
AMAX_CTAS_PER_SM = 8
FLAT_CTAS_PER_SM = 64
FLAT46_CTAS_PER_SM = 16


def usable(x: torch.Tensor) -> bool:
    """Whether the CUDA kernels can take x here: switched on, a CUDA tensor (compute capability >= 8) of
    bfloat16 or float32 whose data is 16-byte aligned, fewer than MAX_BLOCKS blocks (32-bit block indices),
    NVRTC through torch."""
    if not STATE["on"] or INTERPRET or not x.is_cuda or x.dtype not in _DTYPES:
        return False
    if x.data_ptr() % 16 or x.numel() // 16 >= MAX_BLOCKS or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 8


def rows_max_blocks(dtype) -> int:
    """Longest row (in blocks) the row kernel takes for this input dtype: float32 blocks hold twice the
    registers, and 8 blocks per thread spill (ptxas), so float32 rows stop at 4 (K <= 32768)."""
    return ROWS_MAX_BLOCKS if dtype == torch.bfloat16 else ROWS_MAX_BLOCKS // 2


def rows_plan(nb_row: int, bpt: int = 1) -> tuple[int, int, int]:
    """(BPT, TPR, CTA) for rows of nb_row blocks: at least `bpt` blocks per thread (more until a row takes at
    most MAX_TPR threads); CTAs of max(TPR, 256) threads (256 / TPR rows each when TPR < 256). More blocks per
    thread spread the per-row work (the row max, three IEEE divisions for the row's scales) over more
    elements, at the cost of registers."""
    if not 1 <= nb_row <= ROWS_MAX_BLOCKS:
        raise ValueError(f"rows of {nb_row} blocks: the CUDA row kernel takes 1..{ROWS_MAX_BLOCKS}")
    while -(-nb_row // bpt) > MAX_TPR:
        bpt *= 2
    tpr = 1
    while tpr < -(-nb_row // bpt):
        tpr *= 2
    return bpt, tpr, max(tpr, 256)


def rows_bpt(n_blk: int, device) -> int:
    """4 blocks per thread when that still leaves a thread per SM slot (2048 per SM) and some: fewer
    per-row overheads (measured on an H200: 32768 x 4096 bf16 rule 6 113 -> 96 us, 4/6 308 -> 280 us); 2 or
    1 for fewer blocks, where more threads in flight matter more (32 x 4096: 1.9 us at 1, 3.3 at 4)."""
    slots = torch.cuda.get_device_properties(device).multi_processor_count * 2048
    for bpt in (4, 2):
        if n_blk // bpt >= slots // 2:
            return bpt
    return 1


def reload_bpt(n_blk: int, device, nb_row: int) -> int:
    """Blocks a thread for the RELOAD row kernel (8 or 4), or 0 where it would leave fewer than
    RELOAD46_MIN_WAVES x the GPU's thread slots busy (then the blocks stay in registers, 2 a thread); rows of
    more than RELOAD46_LONG_ROW blocks take 4 from RELOAD46_MIN_WAVES_LONG x."""
    slots = torch.cuda.get_device_properties(device).multi_processor_count * 2048
    if n_blk / 8 >= RELOAD46_MIN_WAVES * slots:
        return 8
    long_row = nb_row > RELOAD46_LONG_ROW
    if n_blk / 4 >= (RELOAD46_MIN_WAVES_LONG if long_row else RELOAD46_MIN_WAVES) * slots:
        return 4
    return 0


def source(defs: dict) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in defs.items()) + _SOURCE.read_text()


class NotReady(RuntimeError):
    """The kernel for this call is not built yet and the stream is capturing a CUDA graph (building a module
    then is not safe): the caller takes the Triton kernels for this call, without switching these off."""


_KERNELS: dict[tuple, object] = {}


def _kernel(name: str, key: tuple, device_index: int):
    """The compiled kernel per (name, configuration, device): NVRTC builds for, and loads into, the current
    device's context, once."""
    ident = (name, key, device_index)
    if ident not in _KERNELS:
        if torch.cuda.is_current_stream_capturing():
            raise NotReady(f"{name} {dict(key)} not built before the graph capture")
        with torch.cuda.device(device_index):
            _KERNELS[ident] = torch.cuda._compile_kernel(source(dict(key)), name, nvcc_options=["-std=c++17"])
    return _KERNELS[ident]


def _defs(dtype, rule46=False, mae=False, allow_nf=False, src=0, given_rows=False, fast46=None,
          **extra) -> tuple:
    fast46 = FAST46 if fast46 is None else fast46
    d = dict(RULE46=int(rule46), MAE=int(mae), NONFINITE=int(allow_nf), SRC=src, GIVEN_ROWS=int(given_rows),
             IN_F32=_DTYPES[dtype], FAST46=int(fast46) if rule46 else 0, **extra)
    return tuple(sorted(d.items()))


def rows_config(dtype, rule46: bool, mae: bool, allow_nf: bool, nb_row: int, bpt: int,
                fast46=None, reload=False) -> tuple:
    """(TPR, CTA, compile key) of the row kernel for rows of nb_row blocks, at least bpt blocks per thread.
    The register caps (MINB) are bfloat16's; float32 blocks hold twice the data (ptxas spills under them).
    reload: each block read twice (RELOAD), registers for one block at a time (and 4 for the row max)."""
    bpt, tpr, cta = rows_plan(nb_row, bpt)
    fast46 = FAST46 if fast46 is None else fast46
    minb = 1
    if reload:
        minb = max(1, MIN_BLOCKS_RELOAD * 256 // cta) if dtype == torch.bfloat16 else 1
        key = _defs(dtype, rule46, mae, allow_nf, 1, fast46=fast46, BPT=bpt, TPR=tpr, CTA=cta, MINB=minb,
                    RELOAD=1)
        return tpr, cta, key
    if dtype == torch.bfloat16 and rule46 and fast46:  # 512-thread CTAs: half as many, same cap at bpt 1-2
        minb = max(1, _MIN_BLOCKS_FAST46.get(bpt, 1) * 256 // cta)
    elif dtype == torch.bfloat16 and cta == 256:
        minb = _MIN_BLOCKS.get((rule46, bpt), 1)
    key = _defs(dtype, rule46, mae, allow_nf, 1, fast46=fast46, BPT=bpt, TPR=tpr, CTA=cta, MINB=minb)
    return tpr, cta, key


def flat_config(dtype, rule46: bool, mae: bool, allow_nf: bool, src: int, given_rows: bool,
                fast46=None, **extra) -> tuple:
    """Compile key of the flat kernel (per-tensor or imposed scales), which the 16x16 kernels share (extra:
    their own defines, TILE_U, TILE_SMEM)."""
    minb = _MIN_BLOCKS[(rule46, 1)] if dtype == torch.bfloat16 else 1
    return _defs(dtype, rule46, mae, allow_nf, src, given_rows, fast46=fast46, MINB=minb, **extra)


_STRIP_COLS = {torch.bfloat16: 16, torch.float32: 8}  # block columns a warp, the strip kernel (quant.cu SPW)


def _dev(x):
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def _launch(name, key, x, grid, block, args):
    dev = _dev(x)
    kern = _kernel(name, key, dev)
    with torch.cuda.device(dev):
        pdl.launch(kern, grid, block, args, 0, torch.cuda.current_stream(dev), False)


def disable(exc: Exception) -> None:
    STATE["on"], STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"CUDA quantize kernels disabled ({STATE['error']}); using the Triton kernels",
                  stacklevel=3)


def amax_parts(x: torch.Tensor) -> torch.Tensor:
    """int32 [2, 1]: max |x| bit patterns over the finite values, and over all (>= 0x7F800000: NaN/Inf)."""
    n_blk = x.numel() // 16
    parts = torch.zeros(2, 1, dtype=torch.int32, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = max(1, min(-(-n_blk // 512), sms * AMAX_CTAS_PER_SM))
    _launch("nvfp4_amax", _defs(x.dtype), x, (grid, 1, 1), (256, 1, 1), [x, parts, n_blk])
    return parts


def quantize(x, data, scale, g, given, flag, parts, src, per_row_given, rule46, mae, allow_nf,
             tile16=False) -> None:
    """Fill data / scale / g (and flag, src 1) for x [R, K] as quantize_2d's Triton launch would. tile16:
    16x16 tiles (R a multiple of 16; src 0, 2 or 3 with one value: the caller checks)."""
    r, k = x.shape
    nb_row = k // 16
    n_blk = r * nb_row
    if n_blk == 0:
        return
    fast46 = FAST46 if n_blk >= FAST46_MIN_BLOCKS else 0
    if tile16:
        if r % 16 or src == 1 or per_row_given:
            raise ValueError(f"16x16 tiles need rows in multiples of 16 and one scale, got {r} rows, "
                             f"src {src}")
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        tile_fast = TILE16_FAST46 and rule46 and fast46 == 3
        strip46 = tile_fast and STRIP16_46 and x.dtype == torch.bfloat16
        if (not rule46 and STRIP16) or strip46:
            key = flat_config(x.dtype, rule46, rule46 and mae, allow_nf, src, False, 3 if rule46 else 0)
            n_warps = (r // 16) * -(-nb_row // _STRIP_COLS[x.dtype])
            grid = max(1, min(-(-n_warps // 8), sms * STRIP16_CTAS_PER_SM))
            _launch("nvfp4_quant_strip16", key, x, (grid, 1, 1), (256, 1, 1),
                    [x, data, scale, g, given, parts if parts is not None else g, r // 16, nb_row])
            return
        if TILE16_U not in (1, 2, 4):
            raise ValueError(f"cuda.TILE16_U = {TILE16_U!r}: use 1, 2 or 4 tile pairs a warp")
        n_warps = (r // 16) * -(-nb_row // 2)
        grid = max(1, min(-(-n_warps // (8 * TILE16_U)), sms * 16))
        extra = {}
        if TILE16_U != 1:
            extra["TILE_U"] = TILE16_U
            pairs_fit = -(-nb_row // 2) % TILE16_U == 0  # (a warp's pairs in one tile row)
            if TILE16_SMEM and pairs_fit and (x.dtype == torch.bfloat16 or TILE16_U == 2):
                extra["TILE_SMEM"] = 1
        key = flat_config(x.dtype, rule46, mae, allow_nf, src, False, 3 if tile_fast else 0, **extra)
        _launch("nvfp4_quant_tile16", key, x, (grid, 1, 1), (256, 1, 1),
                [x, data, scale, g, given, parts if parts is not None else g, r // 16, nb_row])
        return
    if src == 1:
        bpt = ROWS_BPT["4/6" if rule46 else "6"] or rows_bpt(n_blk, x.device)
        reload = rule46 and fast46 == 3 and RELOAD46 and x.dtype == torch.bfloat16
        if rule46 and fast46 and not ROWS_BPT["4/6"]:  # (forced blocks a thread keep RELOAD as set)
            rbpt = reload_bpt(n_blk, x.device, nb_row) if reload else 0
            reload, bpt = rbpt > 0, rbpt or min(bpt, FAST46_MAX_BPT)
        tpr, cta, key = rows_config(x.dtype, rule46, mae, allow_nf, nb_row, bpt, fast46, reload)
        rows_per_cta = cta // tpr
        _launch("nvfp4_quant_rows", key, x, (-(-r // rows_per_cta), 1, 1), (cta, 1, 1),
                [x, data, scale, g, flag, r, nb_row])
        return
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = max(1, min(-(-n_blk // 256), sms * (FLAT46_CTAS_PER_SM if rule46 else FLAT_CTAS_PER_SM)))
    key = flat_config(x.dtype, rule46, mae, allow_nf, src, per_row_given, fast46)
    _launch("nvfp4_quant_flat", key, x, (grid, 1, 1), (256, 1, 1),
            [x, data, scale, g, given, parts if parts is not None else g, n_blk, nb_row])
