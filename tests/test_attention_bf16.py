"""Decode attention over the BF16 KV cache (fp4rl.kvcache's "bf16" kind: decode_attention(q, lengths, k, v,
None, None, starts=...)) against float32 attention and the engine's SDPA, and its launch rules (splits, tiles,
shared memory). Runs in Triton's CPU interpreter when there is no CUDA; the NVFP4 and FP8 caches are in
tests/test_triton_attention.py."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import attention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2


def _rel(o, ref):
    return ((o.double() - ref).norm() / ref.norm()).item()


def _bf16_ref(q, k, v, lengths, starts=None):
    """float32 GQA attention of q [B, Hq, D] over the bfloat16 cache k, v [B, Hkv, T, D], tokens
    [starts[b], lengths[b]) of row b; an empty row gives 0."""
    b = q.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(b):
        lo, hi = (0 if starts is None else int(starts[i])), int(lengths[i])
        if hi <= lo:
            continue
        g = q.shape[1] // k.shape[1]
        kk = k[i, :, lo:hi].float().repeat_interleave(g, 0)  # [Hq, n, D]
        vv = v[i, :, lo:hi].float().repeat_interleave(g, 0)
        s = torch.einsum("hd,htd->ht", q[i].float(), kk) / math.sqrt(q.shape[2])
        out[i] = torch.einsum("ht,htd->hd", s.softmax(-1), vv)
    return out


def _engine_sdpa(q, k, v, lengths, starts):
    """The sampler's BF16 decode attention (fp4rl.gpu_decode): SDPA over all T_cap slots with the additive
    mask _context builds (0 on [starts, lengths), -inf elsewhere), GQA by enable_gqa."""
    import torch.nn.functional as F

    key = torch.arange(k.shape[2], device=k.device)
    visible = (key[None] >= starts[:, None]) & (key[None] < lengths[:, None])
    mask = torch.zeros(visible.shape, dtype=k.dtype, device=k.device).masked_fill_(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None],
                                          enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]


def _bf16_case(b, hq, hkv, t, d, lengths, starts=None, seed=0, b_cap=None):
    """q [B, Hq, D] and a bfloat16 cache; with b_cap the cache has b_cap rows and k, v are its views [:b]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).bfloat16().to(DEV)
    k_all = (torch.randn(b_cap or b, hkv, t, d, generator=g) * 2).bfloat16().to(DEV)
    v_all = torch.randn(b_cap or b, hkv, t, d, generator=g).bfloat16().to(DEV)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    st = None if starts is None else torch.tensor(starts, dtype=torch.int32, device=DEV)
    return q, k_all[:b], v_all[:b], lens, st


BF16_CASES = [  # b, hq, hkv, d, t_cap, lengths, starts, decode_attention keywords
    (3, 16, 2, 64, 48, [48, 21, 1], None, {}),  # GQA 8:1, a length-1 row
    (2, 8, 1, 32, 40, [40, 7], [5, 0], {}),  # one KV head, left padding
    (2, 4, 4, 32, 33, [33, 2], [30, 1], {}),  # MHA (1:1), T not a multiple of the tile
    (3, 8, 2, 32, 64, [1, 2, 64], [0, 1, 63], {}),  # every row attends to exactly one token
    (2, 8, 2, 32, 64, [64, 3], None, {"num_splits": 1}),  # one split: no workspace, no merge
    (2, 8, 2, 32, 80, [80, 50], [3, 0], {"num_splits": 5, "block_t": 16}),  # 5 splits: a partial merge batch
    (2, 8, 2, 32, 128, [128, 30], None, {"num_splits": 8, "block_t": 16, "min_chunk": 32}),  # >= 32 a split
    (3, 8, 2, 32, 48, [48, 5, 9], [0, 5, 10], {}),  # empty rows (start == length, start > length): zeros
]


@pytest.mark.parametrize("b,hq,hkv,d,t,lengths,starts,kw", BF16_CASES)
def test_bf16_cache(b, hq, hkv, d, t, lengths, starts, kw):
    q, k, v, lens, st = _bf16_case(b, hq, hkv, t, d, lengths, starts, seed=b * 7 + t)
    out = attention.decode_attention(q, lens, k, v, None, None, starts=st, **kw)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    ref = _bf16_ref(q, k, v, lens, st)
    assert (out.float() - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())
    assert _rel(out, ref.double()) < TOL
    for i in range(b):
        if lengths[i] <= (0 if starts is None else starts[i]):
            assert torch.equal(out[i], torch.zeros_like(out[i]))


def test_bf16_cache_matches_engine_sdpa():
    """Against the sampler's own SDPA call (additive mask over all T_cap slots), on views [:bb] of a cache
    made by fp4rl.kvcache.make_kv_cache("bf16", ...), i.e. its exact layout and strides."""
    from fp4rl.kvcache import make_kv_cache
    from fp4rl.model import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=80, hidden_size=128, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      qk_norm=True)
    cache = make_kv_cache("bf16", cfg, 5, 72, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator().manual_seed(11)
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn(buf.shape, generator=g))
    bb = 3
    lens = torch.tensor([70, 9, 40], dtype=torch.int32, device=DEV)
    st = torch.tensor([2, 0, 33], dtype=torch.int32, device=DEV)
    for layer in range(2):
        k, v = cache.k[layer][:bb], cache.v[layer][:bb]
        assert k.stride() == cache.k[layer].stride() and k.data_ptr() == cache.k[layer].data_ptr()
        q = torch.randn(bb, 8, 64, generator=g).bfloat16().to(DEV)
        out = attention.decode_attention(q, lens, k, v, None, None, starts=st)
        sdpa32 = _engine_sdpa(q.float(), k.float(), v.float(), lens, st)
        assert _rel(out, sdpa32.double()) < TOL
        sdpa16 = _engine_sdpa(q, k, v, lens, st)  # the engine's bfloat16 call itself
        assert (out.float() - sdpa16.float()).abs().max().item() < 3e-2


def test_bf16_cache_workspace_reuse():
    """Calls that merge different numbers of splits one after another leave the counters at zero (each call's
    last split resets them): same results as fresh calls, bit for bit."""
    q, k, v, lens, st = _bf16_case(2, 8, 2, 128, 32, [128, 100], [0, 10], seed=5)
    kw = dict(num_splits=4, block_t=16)
    first = attention.decode_attention(q, lens, k, v, None, None, starts=st, **kw)
    for lengths in ([20, 128], [128, 11], [17, 33]):  # 2 / 4 / 1 active splits
        attention.decode_attention(q, torch.tensor(lengths, dtype=torch.int32, device=DEV), k, v, None, None,
                                   starts=st, **kw)
    assert torch.equal(attention.decode_attention(q, lens, k, v, None, None, starts=st, **kw), first)
    assert _rel(first, _bf16_ref(q, k, v, lens, st).double()) < TOL


def test_bf16_cache_bad_inputs():
    q, k, v, lens, _ = _bf16_case(2, 8, 2, 16, 32, [16, 3])
    with pytest.raises(ValueError, match="no scales"):  # a BF16 cache with NVFP4 block scales
        attention.decode_attention(q, lens, k, v, None, None, k_scale=k, v_scale=v)
    kg = torch.ones(k.shape[:3], device=DEV)
    with pytest.raises(ValueError, match="no scales"):  # a BF16 cache with FP8 per-token scales
        attention.decode_attention(q, lens, k, v, kg, kg)
    with pytest.raises(ValueError, match="both k_global and v_global"):
        attention.decode_attention(q, lens, k, v, kg, None)
    with pytest.raises(TypeError, match="bfloat16 k and v"):
        attention.decode_attention(q, lens, k.float(), v.float(), None, None)
    with pytest.raises(TypeError, match="bfloat16 k and v"):
        attention.decode_attention(q, lens, k, v.half(), None, None)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        attention.decode_attention(q.float(), lens, k, v, None, None)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention.decode_attention(q[:, :7], lens, k, v, None, None)
    with pytest.raises(ValueError, match="head_dim"):
        attention.decode_attention(q[..., :16].contiguous(), lens, k, v, None, None)
    with pytest.raises(ValueError, match=r"\[B, Hkv, T, D\]"):
        attention.decode_attention(q, lens, k[:1], v[:1], None, None)
    with pytest.raises(ValueError, match="lengths"):
        attention.decode_attention(q, lens[:1], k, v, None, None)
    with pytest.raises(ValueError, match="starts"):
        attention.decode_attention(q, lens, k, v, None, None, starts=lens[:1])
    with pytest.raises(ValueError, match="contiguous"):
        kt = k.transpose(2, 3).contiguous().transpose(2, 3)  # [B, Hkv, T, D], D strided
        attention.decode_attention(q, lens, kt, v, None, None)
    with pytest.raises(ValueError, match="Gluon"):
        attention.decode_attention(q, lens, k, v, None, None, kernel="gluon")


def test_bf16_split_rule(monkeypatch):
    """Splits of the BF16 cache on a 132-multiprocessor H200, 4 KV heads: the counts measured best (or within
    5% of it) by bench/attention_bf16.py; one split (no merge) for short caches and at batch 32; powers of
    two, the grid within one wave, >= split_tokens of the capacity a split."""
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    dev = torch.device("cuda")
    got = {(b, t): attention._splits_bf16(b, 4, t, dev) for b in (1, 8, 32) for t in (64, 512, 4096, 32768)}
    assert got == {(1, 64): 1, (1, 512): 2, (1, 4096): 16, (1, 32768): 32,
                   (8, 64): 1, (8, 512): 2, (8, 4096): 4, (8, 32768): 4,
                   (32, 64): 1, (32, 512): 1, (32, 4096): 1, (32, 32768): 1}
    tune = attention.BF16_TUNE
    for (b, t), n in got.items():
        assert n & (n - 1) == 0 and b * 4 * n <= tune["programs_per_sm"] * 132
        assert n == 1 or t // n >= tune["split_tokens"]


def test_bf16_tile_rule(monkeypatch):
    """The BF16 path's context tile: 128 tokens (no larger than the cache) while the grid fits one wave of one
    CTA a multiprocessor; 32 past it, up to five programs a multiprocessor (139 KB of shared memory a CTA at
    128 x 3 stages, 38 KB at 32 x 3: one wave of either); 128 again past that, where 32-token tiles take waves
    of their own. On 132 multiprocessors: Qwen3-8B's 8 KV heads at batch 16 / 17 / 32 / 64 / 82 / 83 / 128;
    Qwen3-30B-A3B's 4 at batch 32 / 33 / 34 / 64 / 128 / 256; splits count as programs."""
    rule = attention._bf16_block
    tune = attention.BF16_TUNE
    assert tune["block_t"] == 128 and tune["wide_programs_per_sm"] == 5
    monkeypatch.setitem(tune, "wide_block_t", 32)  # the default (FP4RL_ATTN_WIDE_TILE may be set)
    eight = [rule(b, 8, 1, 192, 132) for b in (1, 8, 16, 17, 32, 64, 82, 83, 128)]
    assert eight == [128] * 3 + [32] * 4 + [128] * 2
    assert [rule(b, 4, 1, 4096, 132) for b in (1, 32, 33, 34, 64, 128, 256)] == [128] * 3 + [32] * 3 + [128]
    assert rule(1, 4, 16, 4096, 132) == 128  # _splits_bf16's 16 splits at batch 1: 64 programs
    assert rule(1, 4, 64, 32768, 132) == 32  # a caller's 64 splits: 256 programs
    assert rule(4, 8, 8, 4096, 132) == 32 and rule(4, 8, 4, 4096, 132) == 128
    assert rule(1, 4, 1, 40, 132) == 64 and rule(64, 8, 1, 16, 132) == 16  # never above the cache
    assert rule(17, 8, 1, 192, 144) == 128  # more multiprocessors, one wave again
    assert rule(83, 8, 1, 192, 144) == 32 and rule(91, 8, 1, 192, 144) == 128
    assert rule(165, 4, 1, 4096, 132) == 32 and rule(166, 4, 1, 4096, 132) == 128  # 660 = 5 x 132 programs
    assert rule(48, 4, 1, 4096, 132, wide_per_sm=1) == 128 and rule(48, 4, 1, 4096, 132, wide_per_sm=2) == 32
    assert rule(64, 8, 1, 192, None) == 128 and rule(1, 4, 1, 40, None) == 64  # no CUDA device: the base tile


def test_bf16_settings_take_the_tile_rule(monkeypatch):
    """The launch settings of a CUDA device take _bf16_block's tile, bounded by the wide tile's CTAs its
    shared memory holds: 5 on an H100 / H200 at head_dim 128 (228 KB a multiprocessor), 3 at head_dim 256,
    2 on a 100 KB multiprocessor (whose 99 KB a block also takes 2 stages of 128-token tiles:
    _fit_bf16_smem)."""
    from types import SimpleNamespace

    monkeypatch.setitem(attention.BF16_TUNE, "wide_block_t", 32)
    monkeypatch.setattr(attention, "INTERPRET", False)
    hopper = SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448,
                             shared_memory_per_multiprocessor=233472)
    ada = SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=101376,
                          shared_memory_per_multiprocessor=102400)
    props = {"p": hopper}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props["p"])
    dev = torch.device("cuda")

    def settings(b, hkv, t_cap, d=128, splits=None):
        return attention._bf16_settings(b, hkv, t_cap, d, dev, splits, None, None, None, None)

    assert attention._wide_per_sm(128, 3, dev) == 5 and attention._wide_per_sm(256, 3, dev) == 3
    assert settings(48, 4, 4096) == (1, 32, 4, 3, 256)  # 192 programs: one wave of 32-token tiles
    assert settings(32, 4, 4096) == (1, 128, 4, 3, 256)  # 128 programs: one wave of 128-token tiles
    assert settings(165, 4, 4096)[1] == 32 and settings(166, 4, 4096)[1] == 128
    assert settings(4, 8, 4096, splits=8)[1] == 32  # a caller's splits count as programs
    assert settings(1, 4, 40)[1] == 64  # never above the cache
    assert settings(48, 4, 4096, d=256)[1] == 32 and settings(100, 4, 4096, d=256)[1] == 128  # 3 a multiproc.
    props["p"] = ada
    assert attention._wide_per_sm(128, 3, dev) == 2
    assert settings(48, 4, 4096) == (1, 32, 4, 3, 256) and settings(67, 4, 4096)[1] == 128
    assert settings(32, 4, 4096) == (1, 128, 4, 2, 256)  # the 99 KB block: 2 stages


@pytest.mark.parametrize("value", ["0", "8", "48", "256", "-32", "32.0", "abc", ""])
def test_bf16_wide_tile_from_the_environment(value, monkeypatch):
    """FP4RL_ATTN_WIDE_TILE: 16-128 and a power of two, else an error naming the variable at import."""
    monkeypatch.setenv("FP4RL_ATTN_WIDE_TILE", value)
    with pytest.raises(ValueError, match="FP4RL_ATTN_WIDE_TILE"):
        attention._env_tile("FP4RL_ATTN_WIDE_TILE", 32)
    for ok in ("16", "32", " 64 ", "128"):
        monkeypatch.setenv("FP4RL_ATTN_WIDE_TILE", ok)
        assert attention._env_tile("FP4RL_ATTN_WIDE_TILE", 32) == int(ok)
    monkeypatch.delenv("FP4RL_ATTN_WIDE_TILE")
    assert attention._env_tile("FP4RL_ATTN_WIDE_TILE", 32) == 32


# ---- BF16 cache on the GPU, real shapes (Qwen3-30B-A3B: 32 query heads, 4 KV heads, head_dim 128)

def _gpu_bf16(b, t_cap, lengths, starts, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, 32, 128, device="cuda", generator=g).bfloat16()
    k = (torch.randn(b, 4, t_cap, 128, device="cuda", generator=g) * 2).bfloat16()
    v = torch.randn(b, 4, t_cap, 128, device="cuda", generator=g).bfloat16()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    st = torch.tensor(starts, dtype=torch.int32, device="cuda")
    return q, k, v, lens, st


def _gpu_lengths(b, t_cap, seed):
    """Per-row lengths in [1, t_cap] (the first row full, one row of length 1 when b > 2) and starts with
    left padding on every other row (up to a quarter of the row's tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t_cap + 1, (b,), generator=g).tolist()
    lengths[0] = t_cap
    if b > 2:
        lengths[2] = 1
    starts = [0 if i % 2 == 0 else int(torch.randint(0, max(1, n // 4), (1,), generator=g)) for i, n in
              enumerate(lengths)]
    return lengths, starts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,t_cap", [(1, 64), (8, 64), (32, 64), (1, 512), (8, 512), (32, 512), (1, 4096),
                                     (8, 4096), (32, 4096), (1, 32768), (8, 32768), (32, 32768),
                                     (48, 192), (48, 4096)])  # 48 x 4 programs: 32-token tiles
def test_gpu_bf16_cache(b, t_cap):
    lengths, starts = _gpu_lengths(b, t_cap, seed=b * 1000 + t_cap)
    q, k, v, lens, st = _gpu_bf16(b, t_cap, lengths, starts, seed=b + t_cap)
    out = attention.decode_attention(q, lens, k, v, None, None, starts=st)
    ref = _bf16_ref(q, k, v, lens, st)
    assert torch.isfinite(out).all()
    assert _rel(out, ref.double()) < TOL
    assert (out.float() - ref).abs().max().item() < 3e-2
    sdpa = _engine_sdpa(q, k, v, lens, st)  # the engine's call, bfloat16
    assert (out.float() - sdpa.float()).abs().max().item() < 3e-2
    assert torch.equal(out, attention.decode_attention(q, lens, k, v, None, None, starts=st))  # no race
    bb = max(1, b // 2)  # views [:bb] of the cache, as the engine passes them
    out_bb = attention.decode_attention(q[:bb], lens[:bb], k[:bb], v[:bb], None, None, starts=st[:bb])
    assert _rel(out_bb, ref[:bb].double()) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,t_cap", [(8, 256), (32, 4096), (1, 32768), (48, 256)])  # 48 x 4: 32-token tiles
@pytest.mark.parametrize("attn_pdl", [False, True])
def test_gpu_bf16_cache_graph_replay(b, t_cap, attn_pdl, monkeypatch):
    """Captured once in a CUDA graph, replayed with new lengths / starts / q written into the same buffers:
    short rows (one active split), long ones (merged), empty ones; each replay matches the reference. With
    attn_pdl the kernel is launched with programmatic dependent launch (pdl kind "attn"), q copied in by the
    kernel before it in the graph and its output read by the kernel after it."""
    from fp4rl.kernels import pdl

    monkeypatch.setattr(pdl, "_STATE", dict(pdl._STATE, off=pdl.DEFAULT_OFF - {"attn"} if attn_pdl else
                                            pdl.DEFAULT_OFF))
    lengths, starts = _gpu_lengths(b, t_cap, seed=b + 5 * t_cap)
    q, k, v, lens, st = _gpu_bf16(b, t_cap, lengths, starts, seed=b * 3 + t_cap)
    bb = max(1, b - 1)  # a view [:bb] of the cache, as the engine passes it
    qv, kv_, vv, lv, sv = q[:bb], k[:bb], v[:bb], lens[:bb], st[:bb]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile, allocate the workspace
        attention.decode_attention(qv, lv, kv_, vv, None, None, starts=sv)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    q_in = torch.empty_like(qv)
    with torch.cuda.graph(graph):
        qv.copy_(q_in)
        out = attention.decode_attention(qv, lv, kv_, vv, None, None, starts=sv)
        out_next = out * 1
    g = torch.Generator().manual_seed(t_cap)
    for step in range(6):
        if step == 0:
            new_len, new_st = lengths[:bb], starts[:bb]
        elif step == 1:  # every row short: one active split each
            new_len, new_st = [min(t_cap, 3 + i) for i in range(bb)], [i % 3 for i in range(bb)]
        elif step == 2:  # every row full
            new_len, new_st = [t_cap] * bb, [0] * bb
        elif step == 3:  # empty rows among full ones
            new_len, new_st = [t_cap if i % 2 else 0 for i in range(bb)], [0] * bb
        else:
            new_len = torch.randint(1, t_cap + 1, (bb,), generator=g).tolist()
            new_st = [int(torch.randint(0, n, (1,), generator=g)) for n in new_len]
        lv.copy_(torch.tensor(new_len, dtype=torch.int32))
        sv.copy_(torch.tensor(new_st, dtype=torch.int32))
        q_in.copy_(torch.randn(qv.shape, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_next, out), step
        ref = _bf16_ref(qv, kv_, vv, lv, sv)
        assert torch.isfinite(out).all(), step
        assert (out.float() - ref).abs().max().item() < 3e-2, step
        for i in range(bb):
            if new_len[i] <= new_st[i]:
                assert torch.equal(out[i], torch.zeros_like(out[i])), step
        eager = attention.decode_attention(qv, lv, kv_, vv, None, None, starts=sv)
        assert torch.equal(out, eager), step


def test_bf16_tiles_fit_the_device_shared_memory(monkeypatch):
    """Fewer pipeline stages, then smaller tiles, where a block's shared memory is short (a 99 KB sm_86/89/120
    device, or head_dim 256 on the H200): the kernel must launch wherever SDPA did."""
    from types import SimpleNamespace

    from fp4rl.kernels import attention

    def fit(limit, d, bt=128, stages=3):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev: SimpleNamespace(shared_memory_per_block_optin=limit))
        return attention._fit_bf16_smem(d, bt, stages, "cuda")

    assert attention.bf16_smem_bytes(128, 128, 3) == 139264
    assert attention.bf16_smem_bytes(128, 128, 2) == 73728
    assert fit(232448, 128) == (128, 3)  # the H200: the tuned setting
    assert fit(232448, 256) == (128, 2)
    assert fit(101376, 128) == (128, 2)
    assert fit(101376, 256) == (64, 2)
    for limit, d in ((232448, 64), (232448, 256), (101376, 128), (101376, 256), (49152, 128)):
        bt, st = fit(limit, d)
        assert attention.bf16_smem_bytes(d, bt, st) + 4096 <= limit, (limit, d, bt, st)
