"""The decode attention's launch rules, per cache format: context splits (flash-decoding), the Gluon kernel's
warps a CTA, the BF16 path's tile and pipeline depth, and their environment knobs (checked at import). Each
rule reads the shapes and the cache's capacity only (no host sync: a graph captured once serves every step);
the figures they were fitted on are in bench/RESULTS.md, "sampler on H200"."""

from __future__ import annotations

import math
import os

import torch
import triton


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


def _env_gluon(name: str, takes: tuple = ("2", "4", "8"), what: str = "warps a CTA",
               unset: str = "the dispatcher's rule, _warps_gluon", default: int = 0) -> int:
    """A Gluon attention knob from the environment: unset or empty for `default`, else one of `takes`;
    anything else a ValueError that names the variable."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", *takes):
        raise ValueError(f"{name}={raw!r}: the Gluon NVFP4 attention takes {', '.join(takes[:-1])} or "
                         f"{takes[-1]} ({what}); unset it for {unset}")
    return int(raw or default)


def _split_rule_from_env() -> int:
    """FP4RL_GLUON_SPLIT_RULE: 2 (the default) or 1 (for A/B), the rule of `_splits_gluon`."""
    return _env_gluon("FP4RL_GLUON_SPLIT_RULE", ("2", "1"), "the split rule: the fifty-second session's, or "
                      "the eighteenth's for A/B", "rule 2", 2)


GLUON_WARPS = _env_gluon("FP4RL_GLUON_WARPS")
GLUON_SPLIT_RULE = _split_rule_from_env()
GLUON_SPLIT_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
GLUON_RULE2_MIN_SLOTS = 512  # rule 2 from this capacity up (below: rule 1's one split, 2% faster summed)


def _splits_gluon(b: int, hkv: int, t: int, num_warps: int, device, maxnreg: int | None, g: int = 4,
                  cta_merge: bool = True) -> int:
    """Context splits per (batch, KV head), g query heads per KV head, t the cache's capacity (not the
    lengths, which live on the device: one captured graph serves every step).

    Rule 2 (the default), for a CTA's warps merged in the CTA (cta_merge: the last CTA merges one partial a
    split): one CTA a multiprocessor pays until a warp streams 256 tokens. n = the largest of
    GLUON_SPLIT_LADDER with b x hkv x n <= SMs, n <= sqrt(t / 2g), >= 32 tokens a warp; doubled where that
    keeps >= 256 tokens a warp and fits the resident CTAs. H100, fifty-second session (bench/attn_splits.py,
    bench/data/s52, every sequence at the capacity): the best count or within 2% in all 18 cases (batch 1-8,
    4 / 8 KV heads, 1K-32K), where rule 1 was up to 16.5% off (batch 1, 4 KV heads at 2K: 9.9 against 8.5
    us). The kernel cuts a sequence into splits of whole 128-token blocks (at 4 warps) from its length, so
    past a power of two two counts can run the same work (16 and 12 splits of 4097-4224 tokens: 11 CTAs).

    Rule 1 (FP4RL_GLUON_SPLIT_RULE=1, and whenever the warps publish their own partials, cta_merge False:
    what it was fitted for, on the H200 in the eighteenth session; and below GLUON_RULE2_MIN_SLOTS, where
    rule 2 measured slower): long contexts fill every resident CTA; shorter ones n = sqrt(t / 6g) down
    the ladder, at most two CTAs a multiprocessor, >= 64 tokens a warp (one split under 512 slots).

    Rule 2 from 512 slots (fifty-fourth session; it started at 1024), out of sample on an H100
    (bench/data/s54): at 512-1023 slots 13 cases (batch 1-32, 4 / 8 KV heads) summed 112.0 us under rule 2
    against 117.9 under rule 1 (110.3 the best counts): batch 1 at 512 slots 4 splits 6.4 / 6.2 us (8 / 4 KV
    heads) where rule 1's 2 took 7.2 / 6.8, and one split where batch x KV heads pass 66 (batch 16 x 8 at 512:
    9.0 against rule 1's 2, 10.8). Below 512 rule 2 lost (256 slots: 2 splits 5.6 / 5.9 against one, 4.9 /
    5.6; six cases 40.5 against 39.6), so rule 1's one split stays there. Over the 27 cases at 512-64K slots
    (7 at lengths past the capacity's power of two) rule 2 at the old 1024 bound took 1190.7 us, rule 1
    1210.9."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = 65536 // (32 * (maxnreg or 168)) // num_warps  # resident CTAs per multiprocessor
    bh = max(1, b * hkv)
    if GLUON_SPLIT_RULE == 1 or not cta_merge or t < GLUON_RULE2_MIN_SLOTS:
        n = max(1, min(64, per_sm * sms // bh))
        if t // (n * num_warps) >= 512:
            return n
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
