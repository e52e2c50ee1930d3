"""Decode attention (one query token per sequence) over an NVFP4, FP8 or BF16 KV cache, in Triton and Gluon.

Layouts (the kernels take strides; the last dim must be contiguous):
    q        [B, Hq, D] bfloat16              lengths int32 [B] (valid tokens per sequence)
    starts   optional int32 [B]: sequence b's valid tokens are [starts[b], lengths[b]) (left padding)
    NVFP4:   k_data, v_data uint8 [B, Hkv, T, D/2]; k_scale, v_scale float8_e4m3fn
             [B, Hkv, T, D/16]; k_global, v_global float32 [B, Hkv, T]
    FP8:     k_data, v_data float8_e4m3fn [B, Hkv, T, D]; k_global, v_global float32 [B, Hkv, T]
    BF16:    k, v bfloat16 [B, Hkv, T, D] (fp4rl.kvcache's "bf16" cache, or a view [:bb] of it); no scales:
             k_global = v_global = None
    out      [B, Hq, D] bfloat16

Modules (this package re-exports their functions and tables; the module-level switches a rule reads, e.g.
launch_rules.GLUON_WARPS, are patched on launch_rules itself):
    cache_formats.py  the NVFP4 and FP8 cache formats (bytes per token) and their quantizers
    triton_decode.py  the Triton flash-decoding kernel: BF16 and FP8, and NVFP4's fallback and CPU path
    gluon_decode.py   the Gluon NVFP4 kernel: tensor cores fed from registers (CUDA default)
    gluon_ptx.py      the inline PTX of the Gluon kernel's 16-token step
    launch_rules.py   the context splits, warps and tiles each kernel launches with, and their knobs
    __init__.py       decode_attention: checks, picks a kernel and its launch, the shared workspace

Both kernels split the context (flash-decoding) and merge the splits in the last program of each
(b, kv head) (in the Triton kernel, unless a single split holds every token: that one writes the
output; in the Gluon kernel, a single split merges its warps' partials after a CTA barrier, without the
counter): ``_WORKSPACE`` holds their partial results and the per-(b, kv head) counters, one
object for the process (CUDA graphs capture its buffers). ``GLUON`` switches the Gluon kernel off
(after a failed compile, or by hand).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl  # noqa: F401  (kept importable from here)

from fp4rl.kernels import pdl
from fp4rl.kernels._common import (  # noqa: F401
    ASM,
    COMPILED,
    INTERPRET,
    dot_acc,
    load_unpacked,
    with_asm_fallback,
)
from fp4rl.kernels.attention import gluon_decode
from fp4rl.kernels.attention.cache_formats import quantize_kv_fp8, quantize_kv_nvfp4  # noqa: F401
from fp4rl.kernels.attention.gluon_decode import gl, gluon  # noqa: F401
from fp4rl.kernels.attention.gluon_ptx import _ATTN_ASM, _ATTN_CON, _ATTN_MSK, _attn_asm, _attn_unpack  # noqa: F401
from fp4rl.kernels.attention.launch_rules import (  # noqa: F401
    BF16_TUNE,
    FP8_TUNE,
    GLUON_SPLIT_LADDER,
    _bf16_block,
    _env_fp8_knob,
    _env_gluon,
    _env_tile,
    _fit_bf16_smem,
    _splits,
    _splits_bf16,
    _splits_fp8,
    _splits_gluon,
    _splits_in_wave,
    _warps_gluon,
    _wide_per_sm,
    bf16_smem_bytes,
)
from fp4rl.kernels.attention.triton_decode import _decode_attn_kernel

if gluon is not None:
    from fp4rl.kernels.attention.gluon_decode import _ax, _decode_attn_fp4_gluon, _merge  # noqa: F401


class _Workspace:
    def __init__(self):
        self.bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device, n_slots: int, gp: int, d: int, n_lock: int, ml_cols: int | None = None):
        ml_cols = ml_cols or 2 * gp
        key = (device, gp, d, ml_cols)
        cur = self.bufs.get(key)
        if cur is None or cur[0].shape[0] < n_slots or cur[2].numel() < n_lock:
            n_slots, n_lock = max(n_slots, 1024), max(n_lock, 1024)
            cur = self.bufs[key] = (
                torch.empty(n_slots, gp * d, dtype=torch.float32, device=device),
                torch.empty(n_slots, ml_cols, dtype=torch.float32, device=device),
                torch.zeros(n_lock, dtype=torch.int32, device=device),
            )
        return cur


_WORKSPACE = _Workspace()


def _check_cache(q, lengths, k, v, kg, vg, ks=None, vs=None):
    """The operands of decode_attention; kg = vg = None: a BF16 cache (bf16 k, v; D a power of 2 >= 16);
    ks / vs given: an NVFP4 cache (packed uint8 codes [B, Hkv, T, D/2], E4M3 block scales [B, Hkv, T, D/16]);
    else FP8 (float8_e4m3fn codes [B, Hkv, T, D]). FP8 and NVFP4 take D a power of 2 >= 32 and float32
    per-token scales [B, Hkv, T]."""
    b, hq, d = q.shape
    bf16, fp4 = kg is None, ks is not None
    kind = "a BF16" if bf16 else "an NVFP4" if fp4 else "an FP8"
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16 [B, Hq, D], got {q.dtype}")
    if bf16 and (k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16):
        raise TypeError(f"a BF16 cache needs bfloat16 k and v, got {k.dtype} and {v.dtype}")
    want = torch.uint8 if fp4 else torch.float8_e4m3fn
    if not bf16 and (k.dtype != want or v.dtype != want):
        raise TypeError(f"{kind} cache needs {want} k and v (the codes{', two E2M1 a byte' if fp4 else ''}), "
                        f"got {k.dtype} and {v.dtype}")
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b:
        raise ValueError(f"k/v cache must be [B, Hkv, T, {'D/2' if fp4 else 'D'}] and equal; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)} for q {tuple(q.shape)}")
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    pow2 = d >= (16 if bf16 else 32) and not d & (d - 1)
    if bf16 and (k.shape[3] != d or not pow2):
        raise ValueError(f"head_dim mismatch: q has D={d}, the cache last dim is {k.shape[3]} (D must be a "
                         "power of two >= 16; other head dims: attend a BF16 cache with SDPA, as the decode "
                         "engine does)")
    if not bf16 and (k.shape[3] * (2 if fp4 else 1) != d or not pow2):
        last = f"D/2 = {d // 2}" if fp4 else f"D = {d}"
        raise ValueError(f"{kind} cache's last dim must be {last} for q's head_dim D={d}, got {k.shape[3]}; "
                         "the kernel takes D a power of two >= 32 (other head dims: a BF16 cache with SDPA)")
    if not bf16:
        for name, t in (("k_global", kg), ("v_global", vg)):
            if t.shape != k.shape[:3] or t.dtype != torch.float32:
                raise ValueError(f"per-token scales must be float32 [B, Hkv, T] = {tuple(k.shape[:3])}, got "
                                 f"{name} {t.dtype} {tuple(t.shape)}")
    if fp4:
        for name, t in (("k_scale", ks), ("v_scale", vs)):
            if t.shape != (*k.shape[:3], d // 16) or t.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"NVFP4 block scales must be float8_e4m3fn [B, Hkv, T, D/16] = "
                                 f"{(*k.shape[:3], d // 16)}, got {name} {t.dtype} {tuple(t.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be int32 [B={b}], got {tuple(lengths.shape)}")
    named = (("k", k), ("v", v), ("q", q)) + (() if bf16 else (("k_global", kg), ("v_global", vg)))
    named += (("k_scale", ks), ("v_scale", vs)) if fp4 else ()
    for name, t in named:
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: the cache and q must share a device")


def _check_launch(num_splits, block_t, num_warps, num_stages, min_chunk, kernel=None):
    """decode_attention's launch overrides: None (the dispatcher's choice) or values the kernels can take."""
    if kernel not in (None, "gluon", "triton"):
        raise ValueError(f"kernel={kernel!r}: use None (the dispatcher's choice), 'gluon' or 'triton'")
    for name, val, lo in (("num_splits", num_splits, 1), ("num_warps", num_warps, 1),
                          ("num_stages", num_stages, 1), ("min_chunk", min_chunk, 0)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < lo):
            raise ValueError(f"{name}={val!r}: must be an int >= {lo}, or None for the dispatcher's choice")
    if num_warps is not None and num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps}: must be a power of two")
    if block_t is not None and (not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t={block_t!r}: the context tile must be a power of two >= 16 (its dots need "
                         "16), or None for the dispatcher's choice")


GLUON = {"on": gluon is not None and not INTERPRET, "error": None}


def _decode_attention_gluon(q, lengths, starts, k, v, kg, vg, ks, vs, sm_scale, num_splits, num_warps,
                            mode: int = 0, pf: int = 3, maxnreg: int | None = None, dbg: int = 0):
    b, hq, d = q.shape
    hkv, t_cap = k.shape[1], k.shape[2]
    g = hq // hkv
    kw, vw = k.view(torch.int32), v.view(torch.int32)  # [B, Hkv, T, 16] words
    ks16 = ks.view(torch.int16)  # [B, Hkv, T, 4]: scale byte pairs (2c, 2c+1)
    vs8 = vs.view(torch.uint8)
    num_splits = num_splits or _splits_gluon(b, hkv, t_cap, num_warps, q.device, maxnreg, g,
                                             gluon_decode.cta_merge_every_split(dbg))
    n_slots = b * hkv * num_splits * num_warps
    part, ml, lock = _WORKSPACE.get(q.device, n_slots, 8, 128, b * hkv, ml_cols=80)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
    use_pdl = pdl.triton_flag(q.device, "gluon")
    COMPILED["decode_attn nvfp4 gluon"] = _decode_attn_fp4_gluon[(b * hkv, num_splits)](
        q, kw, ks16, kg, vw, vs8, vg, lengths, starts if starts is not None else lengths, out,
        part, ml, lock,
        hkv, sm_scale * math.log2(math.e) * 16384.0,
        q.stride(0), q.stride(1), kw.stride(0), kw.stride(1), kw.stride(2),
        ks16.stride(0), ks16.stride(1), ks16.stride(2), kg.stride(0), kg.stride(1),
        vw.stride(0), vw.stride(1), vw.stride(2), vs8.stride(0), vs8.stride(1), vs8.stride(2),
        vg.stride(0), vg.stride(1), out.stride(0), out.stride(1),
        G=g, NUM_SPLITS=num_splits, HAS_START=starts is not None, ASM=_ATTN_ASM[mode], CON=_ATTN_CON, PF=pf,
        DBG=dbg | gluon_decode.MERGE_DBG, PDL=use_pdl, num_warps=num_warps,
        **({"maxnreg": maxnreg} if maxnreg else {}), **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def _bf16_settings(b, hkv, t_cap, d, device, num_splits, block_t, num_warps, num_stages, min_chunk):
    """The BF16 path's (num_splits, block_t, num_warps, num_stages, min_chunk): BF16_TUNE's where not
    given."""
    num_warps = num_warps or BF16_TUNE["num_warps"]
    num_stages = num_stages or BF16_TUNE["num_stages"]
    if INTERPRET:
        num_splits, block_t = num_splits or 2, block_t or 16
    num_splits = num_splits or _splits_bf16(b, hkv, t_cap, device)
    if block_t is None:
        cuda = not INTERPRET and device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
        per_sm = _wide_per_sm(d, num_stages, device) if cuda else None
        block_t = _bf16_block(b, hkv, num_splits, t_cap, sms, per_sm)
        if cuda:  # fewer stages, then smaller tiles, where smem is short
            block_t, num_stages = _fit_bf16_smem(d, block_t, num_stages, device)
    if min_chunk is None:
        min_chunk = 0 if INTERPRET else BF16_TUNE["min_chunk"]
    return num_splits, block_t, num_warps, num_stages, min_chunk


def _launch_triton(q, q_strides, lengths, starts, k, v, ks, vs, kg, vg, kg_strides, out, *, g, sm_scale,
                   num_splits, block_t, num_warps, num_stages, min_chunk, fp4, bf16, rope=None):
    """Launch _decode_attn_kernel over grid (B Hkv, num_splits) into out [B, Hq, D]; q_strides: (row, head) of
    q, or of the q|k|v rows with rope = (cos, sin, q_weight | None, k_weight | None, slot, eps)."""
    b, hkv, d = out.shape[0], k.shape[1], out.shape[2]
    gp = max(16, triton.next_power_of_2(g))
    part, ml, lock = _WORKSPACE.get(q.device, b * hkv * num_splits, gp, d, b * hkv)
    if rope is None:
        rope_args, has_norm = (q, q, q, q, lengths, 0, 1.0, 0.0), False
    else:
        cos, sin, qw, kw, slot, eps = rope
        has_norm = qw is not None
        rope_args = (cos, sin, qw if has_norm else cos, kw if has_norm else cos, slot, cos.stride(0), 1.0 / d,
                     eps)
    nsp = triton.next_power_of_2(num_splits)
    # (the ROPE variant waits before its first access, as the qk_norm_rope launch it replaces: its kind)
    use_pdl = pdl.triton_flag(q.device, "attn" if rope is None else "triton")  # (False off CUDA)
    name = "bf16 rope" if rope is not None else "nvfp4" if fp4 else "bf16" if bf16 else "fp8"
    COMPILED["decode_attn " + name] = _decode_attn_kernel[(b * hkv, num_splits)](
        q, k, ks, kg, v, vs, vg, lengths, starts if starts is not None else lengths, out,
        part, ml, lock,
        hkv, sm_scale * math.log2(math.e),
        q_strides[0], q_strides[1], k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        kg_strides[0], kg_strides[1], v.stride(0), v.stride(1), v.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2), kg_strides[2], kg_strides[3],
        out.stride(0), out.stride(1), *rope_args,
        G=g, GP=gp, D=d, FP4=fp4, NUM_SPLITS=num_splits, BT=block_t,
        USE_ASM=ASM["on"], INTERP=INTERPRET, HAS_START=starts is not None,
        BF16=bf16, MIN_CHUNK=min_chunk, NSP=nsp, PDL=use_pdl, ROPE=rope is not None, HAS_NORM=has_norm,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )


def _uses_asm(*args, k_scale=None, **kwargs) -> bool:
    """Only an NVFP4 cache (k_scale given) unpacks E2M1 codes with the PTX routine."""
    return k_scale is not None


@with_asm_fallback(when=_uses_asm)
def decode_attention(q, lengths, k, v, k_global=None, v_global=None, *, k_scale=None, v_scale=None,
                     sm_scale=None, num_splits=None, block_t=None, num_warps=None, num_stages=None,
                     starts=None, kernel=None, min_chunk=None, _mode: int = 20, _pf: int = 3,
                     _maxnreg: int | None = 168, _dbg: int = 0):
    """One decode step of attention: out [B, Hq, D] bfloat16.

    The cache kind follows the arguments: NVFP4 when k_scale/v_scale (E4M3 block scales) are given, FP8
    (e4m3) with per-token scales k_global/v_global, BF16 (k, v bfloat16, k_global = v_global = None).
    See the module docstring for the layouts. lengths: valid tokens per sequence (<= T).
    starts: optional int32 [B], the first valid token of each sequence (left padding); tokens
    before it are skipped. No host sync: safe inside CUDA graphs (the splits depend on the shapes
    and the cache's capacity T only). min_chunk: fewest tokens per split (a multiple of block_t).
    """
    fp4 = k_scale is not None
    if fp4 != (v_scale is not None):
        raise ValueError("pass both k_scale and v_scale (NVFP4 cache) or neither (FP8 or BF16 cache)")
    if (k_global is None) != (v_global is None):
        raise ValueError("pass both k_global and v_global (FP8 / NVFP4 cache) or neither (BF16 cache)")
    bf16 = k_global is None
    if bf16 and fp4:
        raise ValueError("a BF16 cache has no scales: k_scale/v_scale (NVFP4) need k_global/v_global too")
    if not bf16 and (k.dtype == torch.bfloat16 or v.dtype == torch.bfloat16):
        raise ValueError("a BF16 cache takes no scales: decode_attention(q, lengths, k, v, None, None)")
    _check_cache(q, lengths, k, v, k_global, v_global, k_scale, v_scale)
    _check_launch(num_splits, block_t, num_warps, num_stages, min_chunk, kernel)
    b, hq, d = q.shape
    hkv, t_cap = k.shape[1], k.shape[2]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    use_gluon = (kernel in (None, "gluon") and fp4 and GLUON["on"] and q.is_cuda and d == 128 and g <= 8
                 and block_t is None)
    if kernel == "gluon" and not use_gluon:
        raise ValueError("the Gluon kernel needs CUDA, an NVFP4 cache, head_dim 128 and <= 8 query heads "
                         "per KV head")
    if starts is not None and starts.shape != (b,):
        raise ValueError(f"starts must be int32 [B={b}], got {tuple(starts.shape)}")
    if use_gluon:
        lengths_i = lengths.to(device=q.device, dtype=torch.int32)
        starts_i = None if starts is None else starts.to(device=q.device, dtype=torch.int32)
        try:
            warps = num_warps or _warps_gluon(b, hkv, q.device, _maxnreg)
            return _decode_attention_gluon(q, lengths_i, starts_i, k, v, k_global, v_global, k_scale, v_scale,
                                           sm_scale, num_splits, warps, _mode, _pf, _maxnreg, _dbg)
        except Exception as exc:  # noqa: BLE001  (Gluon failed to compile or launch here)
            if kernel == "gluon":
                raise
            import warnings

            GLUON["on"], GLUON["error"] = False, repr(exc)[:300]
            warnings.warn(f"Gluon NVFP4 attention disabled ({GLUON['error']}); using the Triton kernel",
                          stacklevel=2)
    if bf16:
        num_splits, block_t, num_warps, num_stages, min_chunk = _bf16_settings(
            b, hkv, t_cap, d, q.device, num_splits, block_t, num_warps, num_stages, min_chunk)
    else:
        num_warps, num_stages = num_warps or 4, num_stages or 3
        if INTERPRET:
            num_splits, block_t = num_splits or 2, block_t or 16
        num_splits = num_splits or (_splits(b, hkv, t_cap, q.device) if fp4
                                    else _splits_fp8(b, hkv, t_cap, q.device))
        block_t = block_t or 128  # measured best at 4K and 32K context on the H200 (bench/gpu_kernels.md)
    min_chunk = -(-(min_chunk or 0) // block_t) * block_t
    if fp4:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        ks, vs = k_scale.view(torch.uint8), v_scale.view(torch.uint8)
    else:
        ks, vs = k, v  # unused
    if bf16:
        k_global = v_global = k  # unused
        kg_strides = (0, 0, 0, 0)
    else:
        kg_strides = (k_global.stride(0), k_global.stride(1), v_global.stride(0), v_global.stride(1))
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
    lengths = lengths.to(device=q.device, dtype=torch.int32)
    if starts is not None:
        starts = starts.to(device=q.device, dtype=torch.int32)
    _launch_triton(q, (q.stride(0), q.stride(1)), lengths, starts, k, v, ks, vs, k_global, v_global,
                   kg_strides, out, g=g, sm_scale=sm_scale, num_splits=num_splits, block_t=block_t,
                   num_warps=num_warps, num_stages=num_stages, min_chunk=min_chunk, fp4=fp4, bf16=bf16)
    return out


def decode_attention_rope(qkv, cos, sin, n_heads: int, n_kv_heads: int, head_dim: int, q_weight, k_weight,
                          eps: float, k_cache, v_cache, slot, *, starts=None, sm_scale=None, num_splits=None,
                          block_t=None, num_warps=None, num_stages=None, min_chunk=None):
    """The decode step's q/k-norm + RoPE, KV write and attention over a BF16 cache in one launch: what
    fused.qk_norm_rope(qkv, ..., k_cache=, v_cache=, slot=) and then decode_attention(q, slot + 1, k, v)
    compute, out [R, Hq, D] bfloat16.

    qkv [R, (H + 2 H_kv) D] bfloat16: the fused q|k|v projection of one new token per row; cos / sin [R, D]
    bfloat16 (the step's RoPE rows); q_weight / k_weight: the q_norm / k_norm weights [D] (both or neither)
    with their epsilon; k_cache / v_cache [B >= R, H_kv, T, D] bfloat16 (one layer of the engine's cache);
    slot [1] long on the device: the new token's slot, where its k and v are written. Row b attends to the
    cache's tokens [starts[b], slot) and the new token (the decode engine's lengths are slot + 1 for every
    row); no host sync, so a graph captured once serves every step. q and the cache it writes are bit-equal
    to the two kernels' without the norm; with it within qk_norm_rope's one-ulp claim (the norm's fp32 sum in
    another order, and on CUDA its FMA contraction); the output differs from theirs by the new token's score,
    an fp32 sum rather than the MMA's (fp4rl.kernels.attention.triton_decode). PDL kind "triton" (that of the
    qk_norm_rope launch it replaces): it waits before its first read."""
    d = head_dim
    if qkv.dtype != torch.bfloat16 or qkv.ndim != 2 or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * d \
            or qkv.stride(1) != 1:
        raise ValueError(f"decode_attention_rope: qkv must be bfloat16 [R, (H + 2 H_kv) D] = [R, "
                         f"{(n_heads + 2 * n_kv_heads) * d}] with contiguous rows (the fused q|k|v "
                         f"projection), got {qkv.dtype} {tuple(qkv.shape)}")
    r = qkv.shape[0]
    if d < 16 or d & (d - 1) or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"decode_attention_rope: head_dim must be a power of two >= 16 and the {n_heads} "
                         f"query heads a multiple of the {n_kv_heads} KV heads, got head_dim {d}; use "
                         "qk_norm_rope and decode_attention (or SDPA)")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (r, d) or t.dtype != torch.bfloat16 or t.stride(1) != 1 \
                or t.device != qkv.device:
            raise ValueError(f"decode_attention_rope: {name} must be bfloat16 [{r}, {d}] with contiguous "
                             f"rows on {qkv.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if cos.stride() != sin.stride():
        raise ValueError(f"decode_attention_rope: cos and sin need one layout, got strides {cos.stride()} "
                         f"and {sin.stride()}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("decode_attention_rope: pass both q_weight and k_weight (q/k-norm) or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.numel() != d or not w.is_contiguous() or w.device != qkv.device):
            raise ValueError(f"decode_attention_rope: {name} must be a contiguous [{d}] weight on "
                             f"{qkv.device}, got {tuple(w.shape)} on {w.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.bfloat16 or t.ndim != 4 or t.shape[0] < r or t.shape[1] != n_kv_heads \
                or t.shape[3] != d or t.stride(3) != 1 or t.device != qkv.device:
            raise ValueError(f"decode_attention_rope: {name} must be bfloat16 [B >= {r}, {n_kv_heads}, T, "
                             f"{d}] on {qkv.device} (one layer of a BF16 cache), got {t.dtype} "
                             f"{tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention_rope: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if not isinstance(slot, torch.Tensor) or slot.dtype != torch.long or slot.numel() != 1 \
            or slot.device != qkv.device:
        raise ValueError(f"decode_attention_rope: slot must be a [1] torch.long tensor on {qkv.device} (the "
                         "new token's cache slot)")
    if starts is not None and tuple(starts.shape) != (r,):
        raise ValueError(f"decode_attention_rope: starts must be [R={r}] (int32 on the device), got "
                         f"{tuple(starts.shape)}")
    _check_launch(num_splits, block_t, num_warps, num_stages, min_chunk)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k, v = k_cache[:r], v_cache[:r]
    hkv, t_cap = n_kv_heads, k.shape[2]
    num_splits, block_t, num_warps, num_stages, min_chunk = _bf16_settings(
        r, hkv, t_cap, d, qkv.device, num_splits, block_t, num_warps, num_stages, min_chunk)
    min_chunk = -(-(min_chunk or 0) // block_t) * block_t
    out = torch.empty(r, n_heads, d, dtype=torch.bfloat16, device=qkv.device)
    if starts is not None:
        starts = starts.to(device=qkv.device, dtype=torch.int32)
    if r:
        # (lengths: unused, every row's length is slot + 1; the scales' pointers: unused by a BF16 cache)
        _launch_triton(qkv, (qkv.stride(0), d), slot, starts, k, v, k, v, k, v, (0, 0, 0, 0), out,
                       g=n_heads // hkv, sm_scale=scale, num_splits=num_splits,
                       block_t=block_t, num_warps=num_warps, num_stages=num_stages, min_chunk=min_chunk,
                       fp4=False, bf16=True,
                       rope=(cos, sin, q_weight, k_weight, slot, float(eps)))
    return out
