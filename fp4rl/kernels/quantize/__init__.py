"""NVFP4 quantization in Triton, byte-identical to fp4rl.nvfp4.reference for deterministic modes.

The arithmetic is the reference's (TransformerEngine's), step for step in FP32, with IEEE
division (``div_rn``: never an approximate reciprocal) and without FMA contraction (the kernel
is compiled with ``enable_fp_fusion=False``, so a*b+c stays two roundings):

    amax  -> S_enc = min(M / amax, FLT_MAX) (1 if amax is 0 or S_enc is 0), S_dec = 1 / S_enc,
             g = amax / M                                 (M = 2688, or 1536 for 4/6)
    rule 6:   s = e4m3(block_amax * (S_enc * fp32(1/6)))
    rule 4/6: base = (block_amax / 6) * S_enc; s6 = e4m3(base), s4 = e4m3(base * 1.5)
    enc   = min(1 / (s * S_dec), FLT_MAX); code = e2m1_rne(x * enc)
    4/6 choice: per block, the summed squared (mse) or absolute (mae) error of
             ((e2m1 * s) * amax) / 1536 against x, added left to right over the 16 elements
             (and, for 16x16 tiles, the 16 row sums as a tree: rows i + i+8, i + i+4, ...);
             4 wins only when strictly lower.

Modules, one kernel family each (this package re-exports all their names):
    arith.py         shared @triton.jit arithmetic: E4M3/E2M1 rounding, x / 1536, the ordered sum16
    amax.py          the per-tensor amax pass (integer max over bit patterns, NaN/Inf flag)
    blocks.py        one block per thread, [N, 16] tiles: the default Triton kernels (16x16 tiles too)
    gluon_blocks.py  the same in Gluon (explicit layouts), rule 6 on CUDA
    tiles.py         [R, NB, 16] tiles: stochastic rounding (16x16 too), very long rows
    quant.cu, cuda.py  CUDA C++ (NVRTC): round to nearest on bf16 / fp32 (1x16, 16x16), the default on CUDA
    __init__.py      quantize_2d: picks the kernel, launches it, checks for NaN/Inf

Two launches for a per-tensor scale (the amax pass, then the quantize pass), one for per-row
scales (the kernel takes the row amax itself). On CUDA the CUDA C++ kernels take every 1x16
and 16x16 round-to-nearest mode of bfloat16 and float32 input (2-3x fewer instructions per element than
the Triton ones; if they fail to build they switch off and the Triton kernels take over).
The module-level switches ``BLOCKS``, ``GLUON_BLOCKS`` and ``ROWS_MAX_BLOCKS`` (benchmarks flip
them) live here, next to the code that reads them. Stochastic rounding is unbiased, not
byte-equal to torch's generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401  (kept importable from here)

from fp4rl.kernels._common import COMPILED, INTERPRET, e2m1_value  # noqa: F401
from fp4rl.kernels.quantize import cuda as _cuda
from fp4rl.kernels.quantize.amax import _amax_kernel, amax_partials  # noqa: F401
from fp4rl.kernels.quantize.arith import (  # noqa: F401
    FLT_MAX,
    ONE_SIXTH,
    _div1536,
    _e4m3_bits,
    _e4m3_round,
    _like,
    _round_e2m1,
    _round_e2m1_v,
    _sum16_2d,
)
from fp4rl.kernels.quantize.blocks import (  # noqa: F401
    _encode_2d,
    _encode_v_2d,
    _error_2d,
    _global_from_amax,
    _quantize_blocks,
    _quantize_flat_kernel,
    _quantize_rows_kernel,
    _quantize_tile16_kernel,
    _store_blocks,
)
from fp4rl.kernels.quantize.gluon_blocks import gl, gluon  # noqa: F401
from fp4rl.kernels.quantize.tiles import (  # noqa: F401
    _block_error,
    _encode,
    _halves,
    _quantize_kernel,
    _sum16,
    _tile_tree,
)
from fp4rl.nvfp4.format import NonFiniteError

if gluon is not None:
    from fp4rl.kernels.quantize.gluon_blocks import (  # noqa: F401
        _g_load,
        _g_store,
        _quantize_flat_gluon,
        _quantize_rows_gluon,
    )

PMAX = 1024  # most amax partials the quantize pass reduces


def _configs(k: int, tile16: bool, rule46: bool, row_pass: bool):
    """(BR, BC, num_warps) for the quantize pass: 16-32 elements per thread, no register spills
    when compiled for sm_90 (checked with ptxas; the 16x16 4/6 pass spilled at BC=256, 4 warps)."""
    if INTERPRET:  # few, large programs: the interpreter's cost is per program and per op
        return 16, min(64, triton.next_power_of_2(max(k, 16))), 4
    if tile16:
        return 16, min(128 if rule46 else 256, triton.next_power_of_2(max(k, 16))), 8
    bc = min(256 if rule46 else 512, triton.next_power_of_2(max(k, 16)))
    br = max(1, (1024 if rule46 else 4096) // bc)
    return br, bc, 4


# The one-block-per-thread kernels (the default); BLOCKS["on"] = False selects the older [R, NB, 16] tiles
# (still used for stochastic rounding and per-row scales of rows longer than
# ROWS_MAX_BLOCKS blocks).
BLOCKS = {"on": True}
# 16x16 tiles: tiles across a program and blocks per program (None: the defaults of _launch_tile16)
TILE16 = {"nbc": None, "blocks": None}
GLUON_BLOCKS = {"on": True, "error": None}  # Gluon versions of the rule-6 block kernels on CUDA
ROWS_MAX_BLOCKS = 512


def _launch_blocks(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, mae, allow_nf,
                   scale_rule, err):
    r, k = x.shape
    nb_row = k // 16
    name = f"quantize blocks src{src} {scale_rule} {err}"
    if GLUON_BLOCKS["on"] and gluon is not None and x.is_cuda and not INTERPRET and not rule46:
        try:
            if src == 1:
                nbp = max(32, triton.next_power_of_2(nb_row))
                COMPILED[name + " gluon"] = _quantize_rows_gluon[(r,)](
                    x, data, scale, g, flag, nb_row, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, NBP=nbp,
                    num_warps=min(8, nbp // 32), enable_fp_fusion=False)
            else:
                n_blocks = r * nb_row
                nblk = 128 if rule46 else 256
                COMPILED[name + " gluon"] = _quantize_flat_gluon[(triton.cdiv(n_blocks, nblk),)](
                    x, data, scale, g, given, parts if parts is not None else g, n_blocks, nb_row,
                    SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, N=nblk,
                    num_warps=nblk // 32, enable_fp_fusion=False)
            return
        except Exception as exc:  # noqa: BLE001  (Gluon failed to compile or launch here)
            import warnings

            GLUON_BLOCKS["on"], GLUON_BLOCKS["error"] = False, repr(exc)[:300]
            warnings.warn(f"Gluon quantize disabled ({GLUON_BLOCKS['error']}); using the Triton kernels",
                          stacklevel=3)
    if src == 1:
        nbp = triton.next_power_of_2(nb_row)
        br = max(1, (128 if rule46 else 256) // nbp)
        warps = max(1, min(8, br * nbp // (32 if rule46 else 64)))
        COMPILED[name] = _quantize_rows_kernel[(triton.cdiv(r, br),)](
            x, data, scale, g, flag, r, nb_row, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, BR=br, NBP=nbp,
            num_warps=warps, enable_fp_fusion=False)
    else:
        n_blocks = r * nb_row
        nblk = 128 if rule46 else 256
        COMPILED[name] = _quantize_flat_kernel[(triton.cdiv(n_blocks, nblk),)](
            x, data, scale, g, given, parts if parts is not None else g, n_part, n_blocks, nb_row,
            SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=mae, ALLOW_NF=allow_nf, N=nblk,
            PMAX=PMAX,
            num_warps=nblk // (32 if rule46 else 64), enable_fp_fusion=False)


def _launch_cuda(x, data, scale, g, given, flag, src, per_row_given, rule46, err, allow_nf, tile16=False):
    """The CUDA kernels (fp4rl.kernels.quantize.cuda): (True, the amax parts or None), or (False, None) if
    they failed here (they are then switched off and the caller takes the Triton kernels)."""
    try:
        parts = _cuda.amax_parts(x) if src == 0 else None
        _cuda.quantize(x, data, scale, g, given, flag, parts, src, per_row_given, rule46, err == "mae",
                       allow_nf, tile16)
    except _cuda.NotReady:  # first use inside a graph capture: Triton for this call only
        return False, None
    except Exception as exc:  # noqa: BLE001  (NVRTC or the launch failed: the Triton kernels take over)
        _cuda.disable(exc)
        return False, None
    return True, parts


def _launch_tile16(x, data, scale, g, given, parts, n_part, src, rule46, err, allow_nf, scale_rule):
    """16x16 tiles on the one-block-per-thread kernel: 128 blocks a program (4/6: one per thread), 256 for
    rule 6 (two per thread), 8 tiles wide (fewer on narrower rows)."""
    r, k = x.shape
    nb_row = k // 16
    nbc = min(TILE16["nbc"] or (32 if INTERPRET else 8), triton.next_power_of_2(nb_row))
    n = TILE16["blocks"] or (512 if INTERPRET else 128 if rule46 else 256)
    if n & (n - 1) or nbc & (nbc - 1):
        raise ValueError(f"TILE16: blocks ({n}) and tiles across (nbc, {nbc}) must be powers of two")
    bt = max(1, n // (16 * nbc))
    grid = (triton.cdiv(r, 16 * bt), triton.cdiv(nb_row, nbc))
    COMPILED[f"quantize tile16 src{src} {scale_rule} {err}"] = _quantize_tile16_kernel[grid](
        x, data, scale, g, given, parts if parts is not None else g, n_part, r, nb_row,
        SCALE_SRC=src, RULE46=rule46, MAE=err == "mae", ALLOW_NF=allow_nf, BT=bt, NBC=nbc, PMAX=PMAX,
        num_warps=4, enable_fp_fusion=False)


def _launch_tiles(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, err, allow_nf,
                  tile16, stochastic, seed, scale_rule):
    r, k = x.shape
    br, bc, warps = _configs(k, tile16, rule46, src == 1)
    grid = (triton.cdiv(r, br), 1 if src == 1 else triton.cdiv(k, bc))
    name = f"quantize src{src} {scale_rule} {err}{' 16x16' if tile16 else ''}{' sr' if stochastic else ''}"
    COMPILED[name] = _quantize_kernel[grid](
        x, data, scale, g, given, flag if flag is not None else g, parts if parts is not None else g,
        n_part, r, k, x.stride(0), data.stride(0), scale.stride(0), seed,
        SCALE_SRC=src, PER_ROW=per_row_given, RULE46=rule46, MAE=err == "mae",
        STOCH=stochastic, TILE16=tile16, ALLOW_NF=allow_nf, BR=br, BC=bc, PMAX=PMAX,
        num_warps=warps, enable_fp_fusion=False,
    )


def quantize_2d(
    x: torch.Tensor,
    *,
    tile16: bool = False,
    scale_rule: str = "6",
    err: str = "mse",
    stochastic: bool = False,
    per_row: bool = False,
    amax: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    allow_nonfinite: bool = False,
    check_finite: bool = True,
    seed: int = 0,
):
    """Quantize a 2-D tensor x [R, K] (K a multiple of 16; float32/bfloat16/float16) to NVFP4.

    Returns (data uint8 [R, K/2], block_scale float8_e4m3fn [R, K/16], global_scale float32:
    [] per tensor or [R] per row). per_row: one global scale per row (the activation recipe).
    amax / global_scale: imposed ([] or [R] float32 on x's device), as in the reference.
    check_finite: raise on NaN/Inf (a device sync; pass False inside CUDA graphs), unless
    allow_nonfinite, which quantizes them as the reference does (amaxes over the finite values,
    NaN -> code 0, Inf -> +-6).
    """
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"quantize_2d needs x [R, K] with K a multiple of 16, got {tuple(x.shape)}")
    imposed_rows = any(t is not None and t.numel() > 1 for t in (amax, global_scale))
    if tile16 and (per_row or imposed_rows or x.shape[0] % 16):
        raise ValueError("16x16 tiles need a per-tensor scale (one imposed amax / global_scale value at "
                         "most) and a row count that is a multiple of 16")
    x = x.contiguous()
    r, k = x.shape
    dev = x.device
    data = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(r, k // 16, dtype=torch.uint8, device=dev)
    rows_scaled = per_row and global_scale is None and amax is None
    imposed = global_scale if global_scale is not None else amax
    if imposed is not None and imposed.device != x.device:
        raise ValueError(f"the imposed {'global_scale' if global_scale is not None else 'amax'} is on "
                         f"{imposed.device}, x on {x.device}: move it to x's device")
    if per_row and imposed is not None and imposed.numel() == 1:
        imposed = imposed.reshape(1).expand(r)  # one imposed value, written for every row
    per_row_given = imposed is not None and imposed.numel() > 1
    g = torch.empty(r if (rows_scaled or per_row_given or per_row) else 1, dtype=torch.float32, device=dev)
    flag = parts = None
    n_part = 0
    if global_scale is not None:
        src = 3
    elif amax is not None:
        src = 2
    elif rows_scaled:
        src = 1
        flag = torch.empty(r, dtype=torch.int32, device=dev)
    else:
        src = 0
    given = imposed.float().reshape(-1).contiguous() if imposed is not None else g
    rule46 = scale_rule == "4/6"
    done = False
    rows_fit = src != 1 or k // 16 <= _cuda.rows_max_blocks(x.dtype)
    tile_fits = not tile16 or rule46 or _cuda.TILE16_RULE6  # (16x16 tiles: src 0, 2 or 3, checked above)
    if _cuda.usable(x) and not stochastic and rows_fit and tile_fits:
        done, parts = _launch_cuda(x, data, scale, g, given, flag, src, per_row_given, rule46, err,
                                   allow_nonfinite, tile16)
    if not done:
        if src == 0:
            parts, n_part = amax_partials(x)
        if BLOCKS["on"] and tile16 and not stochastic:
            _launch_tile16(x, data, scale, g, given, parts, n_part, src, rule46, err, allow_nonfinite,
                           scale_rule)
        elif BLOCKS["on"] and not tile16 and not stochastic and (src != 1 or k // 16 <= ROWS_MAX_BLOCKS):
            _launch_blocks(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46,
                           err == "mae", allow_nonfinite, scale_rule, err)
        else:
            _launch_tiles(x, data, scale, g, given, flag, parts, n_part, src, per_row_given, rule46, err,
                          allow_nonfinite, tile16, stochastic, seed, scale_rule)
    if check_finite and not allow_nonfinite:
        if src in (0, 1):
            raw = (parts[1] if src == 0 else flag).max()
        else:
            raw = (x.float().abs().view(torch.int32)).max()
        if int(raw) >= 0x7F800000:
            raise NonFiniteError(
                "x contains NaN or Inf; fix the producer, or pass allow_nonfinite=True "
                "(NaN -> code 0 and ignored by amax, +-Inf -> +-6)"
            )
    out_g = g if g.numel() > 1 or per_row else g.reshape(())
    return data, scale.view(torch.float8_e4m3fn), out_g

