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

Modules (this package re-exports all their names):
    cache_formats.py  the NVFP4 and FP8 cache formats (bytes per token) and their quantizers
    triton_decode.py  the Triton flash-decoding kernel: BF16 and FP8, and NVFP4's fallback and CPU path
    gluon_decode.py   the Gluon NVFP4 kernel: tensor cores fed from registers (CUDA default)
    gluon_ptx.py      the inline PTX of the Gluon kernel's 16-token step
    __init__.py       decode_attention: checks, picks a kernel and its splits, the shared workspace

Both kernels split the context (flash-decoding) and merge the splits in the last program of each
(b, kv head) (in the Triton kernel, unless a single split holds every token: that one writes the
output; in the Gluon kernel, a single split merges its warps' partials after a CTA barrier, without the
counter): ``_WORKSPACE`` holds their partial results and the per-(b, kv head) counters, one
object for the process (CUDA graphs capture its buffers). ``GLUON`` switches the Gluon kernel off
(after a failed compile, or by hand).
"""

from __future__ import annotations

import math
import os

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


def _splits(b: int, hkv: int, t: int, device) -> int:
    """Splits of the context so that ~4 programs per multiprocessor stream the cache (the NVFP4 cache's Triton
    kernel, where the Gluon one does not run)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n = 1
    while n < 64 and b * hkv * n < 4 * sms and t // (2 * n) >= 128:
        n *= 2
    return n


def _env_fp8_knob(name: str, default: int, what: str = "split-cost factor",
                    zero: str = "the capacity cap") -> int:
    """An FP8 split knob from the environment (an int >= 0, tokens; 0 turns `zero` off; `what` names it in
    the error), else a ValueError that names the variable."""
    raw = os.environ.get(name, "").strip() or str(default)  # set but empty: the default, as unset
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{name}={raw!r}: the FP8 attention's {what} is an int >= 0 (0 turns {zero} off; "
                         f"unset it for the default, {default})")
    return int(raw)


# The FP8 cache's launch: its 128-token tiles x 3 stages take 255 registers a thread at 4 warps (and 75776 B
# of shared memory), two CTAs a multiprocessor (bench/attention_bf16.py --kernel-info on an H100).
# split_cost: c of the capacity cap sqrt(t / c) on the splits (FP4RL_FP8_SPLIT_COST, for A/B; 0: no cap);
# long_split: the tokens a split needs to be worth a second resident CTA a multiprocessor
# (FP4RL_FP8_LONG_SPLIT, for A/B; 0: the two-CTA grid rule alone).
FP8_TUNE = {"programs_per_sm": 2, "split_cost": _env_fp8_knob("FP4RL_FP8_SPLIT_COST", 16),
            "long_split": _env_fp8_knob("FP4RL_FP8_LONG_SPLIT", 512, "long-split length",
                                          "the one-CTA rule")}


def _splits_fp8(b: int, hkv: int, t: int, device) -> int:
    """Context splits for the FP8 cache. They double while the doubled grid stays within the resident CTAs
    (FP8_TUNE's programs_per_sm a multiprocessor) and each split keeps >= 128 tokens a half; where that leaves
    splits shorter than long_split (512 tokens), only while it stays within one CTA a multiprocessor; and the
    count stays <= sqrt(t / c) (c = split_cost, 16), which balances the stream (t / n tokens a split) against
    the merge of n partials. Over 26 shapes timed on an H100 (batch 1-64, 1K-16K, Qwen3-8B's and the 30B's
    heads; bench/RESULTS.md, "sampler on H200", forty-ninth and fiftieth sessions) its count is the fastest,
    or within 0.4% of it, at 25 (the miss: batch 1 x 8 KV heads at 16K, 32 splits 29.0 us, 16 splits 28.4).
    E.g. batch 1, 8 KV heads at 4K: 16 splits 15.1 us where the grid rule alone took 32 (19.2); batch 4 at
    2K: 4 splits 16.3 against 8's 17.7; batch 32 at 4K: 1 split 103.2 against `_splits`' 4 (117.7)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n = _splits_in_wave(b * hkv, t, FP8_TUNE["programs_per_sm"] * sms, 128)
    if t // n < FP8_TUNE["long_split"]:
        n = min(n, _splits_in_wave(b * hkv, t, sms, 128))
    c = FP8_TUNE["split_cost"]
    while c and n > 1 and n * n * c > t:
        n //= 2
    return n


def _splits_in_wave(bh: int, t: int, grid: int, half_tokens: int) -> int:
    """The splits of `_splits_fp8` and `_splits_bf16`: doubled (up to 64) while bh x the doubled count stays
    within `grid` resident CTAs and each half of a split keeps >= half_tokens of the capacity t."""
    n = 1
    while n < 64 and bh * 2 * n <= grid and t // (2 * n) >= half_tokens:
        n *= 2
    return n


def _splits_bf16(b: int, hkv: int, t: int, device) -> int:
    """Context splits for the BF16 cache, from its capacity t and the shapes alone (no host sync: a graph
    captured once serves every step). The splits double while the grid stays within one wave (one CTA per
    multiprocessor: a 128-token tile pipelined 2 deep takes 139 KB of shared memory) and each split keeps
    >= split_tokens of the capacity. On the H200 (132 SMs), 4 KV heads: batch 1 takes 2 splits at 512
    tokens, 16 at 4K, 32 at 32K; batch 8 takes 2 at 512 and 4 from 1K up; batch 32 one
    (bench/attention_bf16.py, where these were the best or within 5% of it). A short sequence in a long
    cache keeps fewer active splits (min_chunk), the others return at once."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _splits_in_wave(b * hkv, t, BF16_TUNE["programs_per_sm"] * sms, BF16_TUNE["split_tokens"])


def bf16_smem_bytes(d: int, block_t: int, num_stages: int) -> int:
    """Shared memory of the BF16 path's kernel: the K and V tiles of (num_stages - 1) pipelined loads plus
    ~8 KB (Triton 3.9 for sm_90: 139264 B at D 128, 128-token tiles, 3 stages; 73728 at 2 stages)."""
    return max(1, num_stages - 1) * 2 * block_t * d * 2 + 8192


def _fit_bf16_smem(d: int, block_t: int, num_stages: int, device) -> tuple[int, int]:
    """(block_t, num_stages) whose shared memory fits one block of the device (with a 4 KB margin): fewer
    stages first, then smaller tiles. The H200 (227 KB) keeps the tuned 128 x 3 at D 128 and takes 2 stages
    at D 256; a 99 KB device (sm_86 / sm_89 / sm_120) takes 2 stages at D 128."""
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    while bf16_smem_bytes(d, block_t, num_stages) + 4096 > limit:
        if num_stages > 2:
            num_stages -= 1
        elif block_t > 16:
            block_t //= 2
        else:
            break
    return block_t, num_stages


def _env_tile(name: str, default: int) -> int:
    """A context tile from the environment: 16, 32, 64 or 128 tokens (the kernel's tile is a power of two, its
    dots need >= 16), else a ValueError that names the variable."""
    raw = os.environ.get(name, str(default)).strip()
    tile = int(raw) if raw.isascii() and raw.isdigit() else 0
    if not 16 <= tile <= 128 or tile & (tile - 1):
        raise ValueError(f"{name}={raw!r}: the BF16 attention's context tile must be 16, 32, 64 or 128 "
                         f"tokens (unset it for the default, {default})")
    return tile


# The BF16 path's launch settings, measured on the H200 (bench/attention_bf16.py): 128-token tiles (64 when
# the cache holds <= 64 slots), 4 warps, 3 stages; splits by _splits_bf16; >= min_chunk tokens a split.
# wide_block_t: the tile when the grid has more programs than multiprocessors but fits one wave of that tile's
# CTAs, at most wide_programs_per_sm a multiprocessor and as many as its shared memory holds (_bf16_block,
# _wide_per_sm; FP4RL_ATTN_WIDE_TILE=128 for the 128-token tile there, as before the forty-eighth session).
BF16_TUNE = {"block_t": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 1, "split_tokens": 256,
             "min_chunk": 256, "wide_block_t": _env_tile("FP4RL_ATTN_WIDE_TILE", 32),
             "wide_programs_per_sm": 5}


def _wide_per_sm(d: int, num_stages: int, device) -> int:
    """CTAs of the wide tile (BF16_TUNE's wide_block_t) resident a multiprocessor by shared memory, at most
    wide_programs_per_sm (measured on the H100 at head_dim 128: 5, 38 KB each of 228 KB); fewer at head_dim
    256 or on a ~100 KB multiprocessor (sm_86 / 89 / 120)."""
    props = torch.cuda.get_device_properties(device)
    smem = (getattr(props, "shared_memory_per_multiprocessor", 0)
            or getattr(props, "shared_memory_per_block_optin", 0) or 101376)
    per_cta = bf16_smem_bytes(d, BF16_TUNE["wide_block_t"], num_stages) + 1024  # + the reserved 1 KB a CTA
    return max(1, min(BF16_TUNE["wide_programs_per_sm"], smem // per_cta))


def _bf16_block(b: int, hkv: int, num_splits: int, t_cap: int, sms: int | None,
                wide_per_sm: int | None = None) -> int:
    """The BF16 path's context tile: BF16_TUNE's block_t (no larger than the cache), or wide_block_t when the
    grid (b x hkv x num_splits programs) has more programs than the device has multiprocessors and at most
    wide_programs_per_sm times as many. The 128-token tile pipelined 3 deep takes 139 KB of shared memory, one
    CTA a multiprocessor, so such a grid runs in two or more waves; 32-token tiles take 38 KB, five resident,
    so it runs in one. Measured on an H100 (forty-eighth session, bench/data/s48/attn151_*.json and
    attn153_*.json, graph replay, us, 128-token -> 32-token tiles): Qwen3-8B heads (32 / 8) at batch 32,
    contexts 192 / 512 / 1K / 4K: 15.8 / 28.2 / 48.4 / 174.9 -> 12.2 / 27.1 / 48.7 / 174.8; batch 64: 29.1 /
    51.3 / 93.4 / 342.7 -> 22.1 / 48.7 / 90.9 / 345.4; Qwen3-30B-A3B heads (32 / 4) at batch 64: 15.5 / 50.1 /
    175.5 -> 12.2 / 49.2 / 175.5, batch 128 at 512 / 2K: 52.8 / 177.6 -> 48.3 / 176.1; rows of 256 tokens in
    a 2048-slot cache, the 8B's heads at batch 32 / 64: 12.8 / 30.9 -> 10.7 / 27.4. Past five programs a
    multiprocessor 32-token tiles take two or more waves of their own and lose at long rows (1024 programs at
    2K: the 30B's heads at batch 256 344-346 -> 386-398, the 8B's at batch 128 341-345 -> 355-359); within one
    wave of 128-token tiles they lose up to 1.34x (batch 1 x 4 KV heads at 1K: 8.5 -> 11.4; 1.23x at 4K, 13.4
    -> 16.5). wide_per_sm: the wide tile's CTAs resident a multiprocessor (_wide_per_sm; default BF16_TUNE's
    wide_programs_per_sm). sms None (no CUDA device): the base tile only."""
    block_t = min(BF16_TUNE["block_t"], max(16, triton.next_power_of_2(t_cap)))
    per_sm = BF16_TUNE["wide_programs_per_sm"] if wide_per_sm is None else wide_per_sm
    if sms is not None and sms < b * hkv * num_splits <= per_sm * sms:
        block_t = min(block_t, BF16_TUNE["wide_block_t"])
    return block_t


GLUON = {"on": gluon is not None and not INTERPRET, "error": None}


def _env_gluon(name: str, takes: tuple = ("2", "4", "8"), what: str = "warps a CTA",
               unset: str = "the dispatcher's rule, _warps_gluon", default: int = 0) -> int:
    """A Gluon attention knob from the environment: unset or empty for `default`, else one of `takes`;
    anything else a ValueError that names the variable."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", *takes):
        raise ValueError(f"{name}={raw!r}: the Gluon NVFP4 attention takes {', '.join(takes)} ({what}; unset "
                         f"it for {unset})")
    return int(raw or default)


GLUON_WARPS = _env_gluon("FP4RL_GLUON_WARPS")
GLUON_SPLIT_RULE = _env_gluon("FP4RL_GLUON_SPLIT_RULE", ("2", "1"), "the split rule: the fifty-second "
                              "session's, the eighteenth's for A/B", "2", 2)
GLUON_SPLIT_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _splits_gluon(b: int, hkv: int, t: int, num_warps: int, device, maxnreg: int | None, g: int = 4) -> int:
    """Context splits per (batch, KV head), g query heads per KV head, t the cache's capacity (not the
    lengths, which live on the device: one captured graph serves every step). With the warps merged in the
    CTA, one CTA a multiprocessor pays until a warp streams 256 tokens: n = the largest of GLUON_SPLIT_LADDER
    with b x hkv x n <= SMs, n <= sqrt(t / 2g), >= 32 tokens a warp; doubled where that keeps >= 256 tokens a
    warp and fits the resident CTAs. H100, fifty-second session (bench/attn_splits.py, bench/data/s52):
    the best count or within 2% in all 18 cases (batch 1-8, 4 / 8 KV heads, 1K-32K), where the eighteenth
    session's rule (FP4RL_GLUON_SPLIT_RULE=1, for A/B) was up to 16% off (batch 1, 4 KV heads at 2K 9.9
    against 8.5 us)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 65536 // (32 * (maxnreg or 168)) // num_warps  # resident CTAs per multiprocessor
    bh = max(1, b * hkv)
    n = max(1, min(64, per_sm * sms // bh))
    if GLUON_SPLIT_RULE == 1 and t // (n * num_warps) >= 512:  # rule 1: long contexts fill every resident CTA
        return n
    if GLUON_SPLIT_RULE == 1:
        fit = min(math.sqrt(t / (6 * max(1, g))), min(2, per_sm) * sms // bh, t // (64 * num_warps))
        return max([s for s in GLUON_SPLIT_LADDER if s <= fit] or [1])
    fit = min(sms // bh, math.sqrt(t / (2 * max(1, g))), t // (32 * num_warps))
    n = max([s for s in GLUON_SPLIT_LADDER if s <= fit] or [1])
    if 2 * n <= 64 and 2 * n * bh <= per_sm * sms and t // (2 * n * num_warps) >= 256:
        n *= 2
    return n


def _warps_gluon(b: int, hkv: int, device, maxnreg: int | None) -> int:
    """Warps a CTA of the Gluon kernel: 2 where one split per (batch, KV head) is more CTAs than one wave of
    4-warp CTAs holds (3 a multiprocessor at 168 registers) but no more than one wave of 2-warp CTAs (6), else
    4. Measured on an H100 (forty-ninth session, bench/attn_splits.py WARPS, bench/data/s49/
    attn156_nvfp4.json, us, 4 warps -> 2): Qwen3-8B heads (8 KV) at batch 64, 1K / 4K 49.7 / 153.2 -> 39.0 /
    124.5; the 30B's (4 KV) at batch 128, 2K 82.5 -> 67.1; within one wave of 4-warp CTAs (batch 32 x 8 KV
    heads) and past one of 2-warp CTAs (batch 128 x 8) even or slower. FP4RL_GLUON_WARPS=2 / 4 / 8: that
    many always (A/B; checked at import)."""
    if GLUON_WARPS:
        return GLUON_WARPS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_warp = 65536 // (32 * (maxnreg or 168))  # resident warps a multiprocessor, by registers
    bh = b * hkv
    return 2 if (per_warp // 4) * sms < bh <= (per_warp // 2) * sms else 4


def _decode_attention_gluon(q, lengths, starts, k, v, kg, vg, ks, vs, sm_scale, num_splits, num_warps,
                            mode: int = 0, pf: int = 3, maxnreg: int | None = None, dbg: int = 0):
    b, hq, d = q.shape
    hkv, t_cap = k.shape[1], k.shape[2]
    g = hq // hkv
    kw, vw = k.view(torch.int32), v.view(torch.int32)  # [B, Hkv, T, 16] words
    ks16 = ks.view(torch.int16)  # [B, Hkv, T, 4]: scale byte pairs (2c, 2c+1)
    vs8 = vs.view(torch.uint8)
    num_splits = num_splits or _splits_gluon(b, hkv, t_cap, num_warps, q.device, maxnreg, g)
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
