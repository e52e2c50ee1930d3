"""fp4rl.kernels.fused against the unfused torch path of fp4rl/model.py and against the shared quantizer.

Claims checked (fused.py's docstring): the residual add, RoPE, the weight product and the KV write are
bit-equal; RMSNorm and q/k-norm are bit-equal except where the fp32 sum of squares, added in another
order, moves y by one bfloat16 ulp; SiLU * up is bit-equal on the GPU and within one ulp on the CPU
(numpy's exp); a fused Q(y) is byte-identical to fp4rl.kernels.quantize.quantize_2d (and so to the
reference) for the y the kernel produced. The launches (split rows, PDL): tests/test_fused_launches.py. On a
machine without CUDA the kernels run in Triton's interpreter (conftest.py)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import fused  # noqa: E402
from fp4rl.kernels.quantize import quantize_2d  # noqa: E402
from fp4rl.model import RMSNorm, rope_tables, rotate_half  # noqa: E402
from fp4rl.nvfp4 import quantize as reference_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = [dict(scale_rule="6", err="mse"), dict(scale_rule="4/6", err="mse"),
          dict(scale_rule="4/6", err="mae")]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # the interpreter's numpy warns on the quantizer's 1/0 (then masked)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bf16(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).bfloat16().to(DEV)


def _norm(k, seed):
    n = RMSNorm(k, 1e-6).bfloat16().to(DEV)
    with torch.no_grad():
        n.weight.copy_(torch.rand(k, generator=_gen(seed)) + 0.5)
    return n


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 ulps (same-sign finite values; NaN must match NaN)."""
    assert torch.equal(a.isnan(), b.isnan())
    fin = ~a.isnan()
    ia, ib = a[fin].view(torch.int16).int(), b[fin].view(torch.int16).int()
    return int((ia - ib).abs().max()) if ia.numel() else 0


def assert_norm_close(y, ref):
    """The RMSNorm claim: at most one ulp apart, and nearly always equal."""
    assert ulps(y, ref) <= 1
    assert (y != ref).float().mean().item() <= 0.02


def assert_bytes(xq, y, quant):
    """Fused Q(y) == quantize_2d(y) == the reference's per-token quantize of the same y."""
    d, s, g = quantize_2d(y, per_row=True, check_finite=False, **quant)
    assert torch.equal(xq[0], d)
    assert torch.equal(xq[1].view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(xq[2], g)
    if not y.isnan().any():
        ref = reference_quantize(y.cpu(), tile=16, scale_scope="row", **quant)
        assert torch.equal(xq[0].cpu(), ref.data)
        assert torch.equal(xq[1].view(torch.uint8).cpu(), ref.block_scale.view(torch.uint8))
        assert torch.equal(xq[2].cpu(), ref.global_scale.reshape(-1))


# the comparisons of split rows and PDL chains (tests/test_fused_launches.py, tests/test_fused_moe_fold.py)
def _bits_eq(a, b):
    """The same bfloat16 bit patterns (NaNs included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _nan_eq(a, b):
    """Equal values, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _q_eq(a, b):
    """Two (data, block_scale, global_scale) triples are the same bytes."""
    return (torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
            and torch.equal(a[2], b[2]))


def _check_pdl_graph(step, load, want: dict) -> None:
    """step() under PDL, eagerly on a side stream (the PDL variants compile outside the capture), then
    captured once and replayed after load(seed) for each seed in turn: every output equal, bit for bit, to
    want[seed] (the outputs of the launches without PDL)."""
    def same(a, b):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert torch.equal(u, v)

    seeds = list(want)
    load(seeds[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        same([t.clone() for t in step()], want[seeds[0]])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for seed in seeds[1:] + [seeds[0], seeds[-1]]:
        load(seed)
        graph.replay()
        torch.cuda.synchronize()
        same(got, want[seed])


# ----------------------------------------------------------------------------------------------
# residual add + RMSNorm


@pytest.mark.parametrize("r,k,block", [(3, 80, None), (2, 48, 16), (5, 208, 64), (1, 4096, None)])
def test_add_rmsnorm_is_the_residual_add_and_rmsnorm(r, k, block):
    x, h, norm = _bf16((r, k), 0, 3.0), _bf16((r, k), 1), _norm(k, 2)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, block=block)
    assert xq is None
    assert torch.equal(xo, x + h)  # bit-equal: one fp32 add, one rounding
    with torch.no_grad():
        assert_norm_close(y, norm(x + h))
    xo2, y2, _ = fused.add_rmsnorm(x, None, norm.weight, norm.eps, block=block)  # first layer: no add
    assert xo2 is x
    with torch.no_grad():
        assert_norm_close(y2, norm(x))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4rl.kernels.fused_rope import _e4m3_bits  # noqa: E402


@triton.jit
def _pn_sumsq_probe(x_ptr, h_ptr, out_ptr, K, stride_x, stride_h):
    row = tl.program_id(0).to(tl.int64)
    tot = fused._pn_sumsq(x_ptr, h_ptr, row, K, stride_x, stride_h, True, x_ptr, x_ptr, x_ptr, 0, 0, 0,
                          False, 1)
    tl.store(out_ptr + row, tot)


@pytest.mark.parametrize("k", [64, 296, 2048, 2176, 4096])
def test_prenorm_order_sum_is_prenorm_sumsq_in_fp32(k):
    """fused._pn_sumsq (add_rmsnorm's prenorm_order statistics) returns prenorm.sumsq's fp32 sum bit for bit
    on rows whose magnitudes span 2^-3 .. 2^3, where the fp32 sum depends on the order (it is not the exactly
    rounded sum: the check that the lane, element, butterfly and warp orders are the builds')."""
    from fp4rl.kernels import prenorm

    g = _gen(11)
    rows = 16
    mag = torch.exp2(torch.randint(-3, 4, (rows, k), generator=g).float())
    x = (torch.randn(rows, k, generator=g) * mag).bfloat16().to(DEV)
    h = (torch.randn(rows, k, generator=g) * mag).bfloat16().to(DEV)
    out = torch.empty(rows, dtype=torch.float32, device=DEV)
    _pn_sumsq_probe[(rows,)](x, h, out, k, x.stride(0), h.stride(0))
    want = prenorm.sumsq((x.float() + h.float()).bfloat16())
    assert torch.equal(out, want), (out - want)
    exact = (x.float() + h.float()).bfloat16().double().pow(2).sum(1).float()  # the sum rounded once
    assert not torch.equal(exact, want) or k <= 64


@pytest.mark.parametrize("r,k", [(1, 64), (3, 296), (2, 2048), (1, 2176), (2, 4096)])
def test_add_rmsnorm_in_prenorm_order_is_the_prenorm_builds_bit_for_bit(r, k):
    """prenorm_order=True: x' and y are fp4rl.kernels.prenorm.reference's bits (the CUDA PRENORM builds' sum
    order, IEEE sqrt and division), with h, with the MoE combine (h None), with both (a shared expert's term:
    x' as without the order, y from it), across K that fill 2048-column blocks partly (64, 296, 2176) or
    wholly; its Q(y) is the quantizer's bytes for that y; and the order moves y by at most one bf16 ulp from
    the default's."""
    from fp4rl.kernels import moe_route, prenorm

    x, h, norm = _bf16((r, k), 6, 3.0), _bf16((r, k), 7), _norm(k, 8)
    xo, y, _ = fused.add_rmsnorm(x, h, norm.weight, norm.eps, prenorm_order=True)
    xs, yr = prenorm.reference(x, h, norm.weight, norm.eps)
    assert torch.equal(xo, xs) and torch.equal(y, yr)
    _, y_default, _ = fused.add_rmsnorm(x, h, norm.weight, norm.eps)
    assert int((y.view(torch.int16).int() - y_default.view(torch.int16).int()).abs().max()) <= 1
    top = 4
    lg = torch.randn(r, 16, generator=_gen(9)).to(DEV)
    _, w, _, pos, _ = moe_route.route(lg, top, True)
    d = _bf16((r * top, k), 10)
    xo, y, _ = fused.add_rmsnorm(x, None, norm.weight, norm.eps, moe=(d, pos, w), prenorm_order=True)
    xs, yr = prenorm.reference(x, None, norm.weight, norm.eps, moe=(d, pos, w))
    assert torch.equal(xo, xs) and torch.equal(y, yr)
    xo, y, _ = fused.add_rmsnorm(x, h, norm.weight, norm.eps, moe=(d, pos, w), prenorm_order=True)
    assert torch.equal(xo, fused.add_rmsnorm(x, h, norm.weight, norm.eps, moe=(d, pos, w))[0])
    assert torch.equal(y, prenorm.reference(xo, torch.zeros_like(xo), norm.weight, norm.eps)[1])
    if k % 16 == 0:  # (the quantizer's blocks)
        quant = QUANTS[1]
        _, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, prenorm_order=True)
        assert torch.equal(y, prenorm.reference(x, h, norm.weight, norm.eps)[1])
        assert_bytes(xq, y, quant)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,k,block", [(3, 80, None), (2, 96, 32)])
def test_add_rmsnorm_quantizes_its_output_byte_for_byte(r, k, block, quant):
    x, h, norm = _bf16((r, k), 3, 2.0), _bf16((r, k), 4), _norm(k, 5)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, block=block)
    assert_bytes(xq, y, quant)
    xo2, y2, xq2 = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, write_y=False, block=block)
    assert y2 is None and torch.equal(xo2, xo)
    for a, b in zip(xq, xq2):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_add_rmsnorm_nan_rows_follow_the_unfused_path():
    """A NaN in a row makes that row's norm NaN (torch's too) and leaves the other rows alone; the fused
    Q(y) is the separate quantizer's on the same values (engine setting: no finiteness check)."""
    r, k = 3, 64
    x, h, norm = _bf16((r, k), 6), _bf16((r, k), 7), _norm(k, 8)
    x[1, 5] = float("nan")
    quant = QUANTS[0]
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant)
    with torch.no_grad():
        ref = norm(x + h)
    assert y[1].isnan().all() and ref[1].isnan().all()
    assert_norm_close(y[[0, 2]], ref[[0, 2]])
    assert_bytes(xq, y, quant)


def test_add_rmsnorm_zero_row():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    norm = _norm(32, 9)
    _, y, xq = fused.add_rmsnorm(x, None, norm.weight, norm.eps, quant=QUANTS[1])
    with torch.no_grad():
        assert torch.equal(y, norm(x))
    assert_bytes(xq, y, QUANTS[1])


# ----------------------------------------------------------------------------------------------
# q/k-norm + RoPE + KV write


def _rope_tables(positions, d, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return rope_tables(inv_freq.to(positions.device), positions, torch.bfloat16)  # [R, D]: the engine's


def _unfused_qk(qkv, cos, sin, h, hkv, d, qn, kn):
    """DecodeEngine._attention's arithmetic: q/k-norm, transpose, q * cos + rotate_half(q) * sin."""
    r = qkv.shape[0]
    q = qkv[:, :h * d].view(r, 1, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(r, 1, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(r, 1, hkv, d).transpose(1, 2)
    if qn is not None:
        q, k = qn(q), kn(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    c, s = cos[:, None, None], sin[:, None, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


@pytest.mark.parametrize("h,hkv,d,norm", [(4, 2, 32, True), (4, 2, 32, False), (3, 1, 24, True),
                                         (2, 2, 20, False)])
def test_qk_norm_rope_is_the_unfused_rope(h, hkv, d, norm):
    r = 3
    qkv = _bf16((r, (h + 2 * hkv) * d), 10, 2.0)
    cos, sin = _rope_tables(torch.tensor([0, 7, 1000], device=DEV), d)
    qn, kn = (_norm(d, 11), _norm(d, 12)) if norm else (None, None)
    with torch.no_grad():
        q_ref, k_ref, _ = _unfused_qk(qkv, cos, sin, h, hkv, d, qn, kn)
    q, k = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn and qn.weight, kn and kn.weight, 1e-6)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape
    if norm:  # one ulp from the norm can grow through the rotation to a few ulps of the output
        assert ((q.float() - q_ref.float()).abs() <= 2 ** -6 * q_ref.float().abs().clamp(min=1)).all()
        assert (q != q_ref).float().mean().item() <= 0.05 and (k != k_ref).float().mean().item() <= 0.05
    else:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_qk_norm_rope_writes_the_bf16_cache_slot():
    r, h, hkv, d, t, slot = 2, 4, 2, 32, 9, 6
    qkv = _bf16((r, (h + 2 * hkv) * d), 13)
    cos, sin = _rope_tables(torch.tensor([5, 3], device=DEV), d)
    k_cache = _bf16((4, hkv, t, d), 14)  # more rows than the step's: rows >= r stay
    v_cache = _bf16((4, hkv, t, d), 15)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q, k_none = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache,
                                   v_cache=v_cache, slot=torch.tensor([slot], device=DEV))
    assert k_none is None
    q_ref, k_ref, v_ref = _unfused_qk(qkv, cos, sin, h, hkv, d, None, None)
    assert torch.equal(q, q_ref)
    k0[:r].index_copy_(2, torch.tensor([slot], device=DEV), k_ref)
    v0[:r].index_copy_(2, torch.tensor([slot], device=DEV), v_ref)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def _random_fp4_cache(hkv, t, d, quant, seed):
    """One layer of an NVFP4 KV cache (4 rows, random bytes: a write must change exactly its slot)."""
    from types import SimpleNamespace

    g = _gen(seed)
    ns = SimpleNamespace(quantize_kwargs=dict(tile=16, scale_scope="row", **quant))
    for x in "kv":
        setattr(ns, f"{x}_data", [torch.randint(0, 256, (4, hkv, t, d // 2), generator=g,
                                                dtype=torch.uint8).to(DEV)])
        setattr(ns, f"{x}_block_scale", [torch.randint(0, 120, (4, hkv, t, d // 16), generator=g,
                                                       dtype=torch.uint8).view(torch.float8_e4m3fn).to(DEV)])
        setattr(ns, f"{x}_global_scale", [torch.rand(4, hkv, t, 1, generator=g).to(DEV)])
    return ns


FP4_NAMES = ("k_data", "k_block_scale", "k_global_scale", "v_data", "v_block_scale", "v_global_scale")


def _assert_same_bytes(want, got, names):
    """Layer 0 of each named cache buffer: the same bytes in both caches (float8 compared as its bytes)."""
    for n in names:
        a, b = getattr(want, n)[0], getattr(got, n)[0]
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), n


@pytest.mark.parametrize("d,quant", [(32, QUANTS[0]), (64, QUANTS[1]), (128, QUANTS[2])])
def test_qk_norm_rope_writes_the_nvfp4_cache_slot(d, quant):
    """The NVFP4 cache written by qk_norm_rope itself (k after q/k-norm + RoPE, v as projected) holds the
    bytes decode_kv.store_kv writes (quantize_2d per (row, head): the cache's own quantizer), at the slot
    only; a zero head and heads 1000x apart in scale included."""
    from fp4rl.decode_kv import store_kv

    r, h, hkv, t, slot = 3, 4, 2, 7, 5
    qkv = _bf16((r, (h + 2 * hkv) * d), 21, 3.0)
    qkv[1, (h + hkv) * d:(h + hkv + 1) * d] = 0  # row 1's first v head: all zeros
    qkv[2, h * d:(h + 1) * d] *= 1e-3  # row 2's first k head: small
    cos, sin = _rope_tables(torch.tensor([4, 9, 2], device=DEV), d)
    qn, kn = _norm(d, 22), _norm(d, 23)
    s = torch.tensor([slot], device=DEV)
    want, got = _random_fp4_cache(hkv, t, d, quant, 24), _random_fp4_cache(hkv, t, d, quant, 24)
    q_ref, k_ref = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight, 1e-6)
    store_kv(want, 0, k_ref, qkv[:, (h + hkv) * d:].reshape(r, hkv, 1, d), s, r)
    q, none = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight, 1e-6, slot=s,
                                 fp4_cache=tuple(getattr(got, n)[0] for n in FP4_NAMES), fp4_quant=quant)
    assert none is None and torch.equal(q, q_ref)
    _assert_same_bytes(want, got, FP4_NAMES)


@triton.jit
def _e4m3_probe(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, _e4m3_bits(tl.load(x_ptr + i)).to(tl.uint8))


def test_e4m3_bits_are_torch_float8_conversion():
    """_e4m3_bits (the FP8 cache write's rounding) against torch's float32 -> float8_e4m3fn on every code's
    value, every midpoint between neighbours and one float32 ulp either side of it (ties to even), signed
    zeros, subnormals and random values: the same bytes."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([codes, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                      torch.tensor([0.0, -0.0, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -12, 448.0, -448.0]),
                      torch.randn(20000, generator=g) * 40, torch.randn(4000, generator=g) * 3e-3])
    vals = vals.clamp(-448, 448)
    n = triton.next_power_of_2(vals.numel())
    x = torch.zeros(n)
    x[:vals.numel()] = vals
    x = x.to(DEV)
    y = torch.empty(n, dtype=torch.uint8, device=DEV)
    _e4m3_probe[(1,)](x, y, N=n)
    assert torch.equal(y, x.to(torch.float8_e4m3fn).view(torch.uint8))


def _random_fp8_cache(hkv, t, d, seed):
    """An FP8KVCache's buffers of one layer, 4 rows (random codes and scales: a write must change only its
    slot), with the cache's own quantize (what decode_kv.store_kv calls)."""
    from types import SimpleNamespace

    from fp4rl.kvcache import FP8KVCache

    g = _gen(seed)
    ns = SimpleNamespace(quantize=FP8KVCache.quantize)
    for x in "kv":
        setattr(ns, x, [torch.randint(0, 120, (4, hkv, t, d), generator=g, dtype=torch.uint8)
                        .view(torch.float8_e4m3fn).to(DEV)])
        setattr(ns, f"{x}_scale", [torch.rand(4, hkv, t, 1, generator=g).to(DEV)])
    return ns


FP8_NAMES = ("k", "k_scale", "v", "v_scale")


@pytest.mark.parametrize("d", [32, 64, 128])
def test_qk_norm_rope_writes_the_fp8_cache_slot(d):
    """The FP8 cache written by qk_norm_rope itself (k after q/k-norm + RoPE, v as projected) holds the bytes
    and scales decode_kv.store_kv writes (FP8KVCache.quantize per (row, head)), at the slot only; a zero head,
    a tiny one (subnormal codes) and heads 1000x apart in scale included."""
    from fp4rl.decode_kv import store_kv

    r, h, hkv, t, slot = 3, 4, 2, 7, 5
    qkv = _bf16((r, (h + 2 * hkv) * d), 31, 3.0)
    qkv[1, (h + hkv) * d:(h + hkv + 1) * d] = 0  # row 1's first v head: all zeros
    qkv[2, h * d:(h + 1) * d] *= 1e-3  # row 2's first k head: small
    # row 0's second v head: its scale at the 2^-126 floor (normal bfloat16 values: Triton's interpreter
    # converts bfloat16 subnormals inexactly, the GPU exactly)
    tiny = (torch.rand(d, generator=_gen(35)) + 0.5) * torch.sign(torch.randn(d, generator=_gen(36))) * 1e-36
    qkv[0, (h + hkv + 1) * d:(h + hkv + 2) * d] = tiny.bfloat16().to(DEV)
    cos, sin = _rope_tables(torch.tensor([4, 9, 2], device=DEV), d)
    qn, kn = _norm(d, 32), _norm(d, 33)
    s = torch.tensor([slot], device=DEV)
    want, got = _random_fp8_cache(hkv, t, d, 34), _random_fp8_cache(hkv, t, d, 34)
    q_ref, k_ref = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight, 1e-6)
    store_kv(want, 0, k_ref, qkv[:, (h + hkv) * d:].reshape(r, hkv, 1, d), s, r)
    q, none = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight, 1e-6, slot=s,
                                 fp8_cache=tuple(getattr(got, n)[0] for n in FP8_NAMES))
    assert none is None and torch.equal(q, q_ref)
    _assert_same_bytes(want, got, FP8_NAMES)
    with pytest.raises(ValueError, match="fp8_cache must be"):  # scales of another capacity
        bufs = [getattr(got, n)[0] for n in FP8_NAMES]
        bufs[1] = bufs[1][:, :, :3]
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, slot=s, fp8_cache=tuple(bufs))
    with pytest.raises(ValueError, match="fp8_cache and slot"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, fp8_cache=tuple(bufs))


def test_qk_norm_rope_fp8_cache_nan_and_inf_as_the_cache_quantizer():
    """Non-finite k / v reach the FP8 cache as FP8KVCache.quantize stores them (a NaN: scale 1 and NaN codes,
    not hidden behind the finite values' scale; an inf: scale inf, inf / inf a NaN code): they stay
    visible."""
    from fp4rl.decode_kv import store_kv

    r, h, hkv, d, t, slot = 3, 4, 2, 32, 6, 2
    qkv = _bf16((r, (h + 2 * hkv) * d), 41, 2.0)
    qkv[0, (h + hkv) * d + 3] = float("nan")  # row 0, v head 0
    qkv[1, (h + hkv + 1) * d + 7] = float("inf")  # row 1, v head 1
    qkv[2, (h + hkv) * d + 1] = -float("nan")  # row 2, v head 0: a negative NaN
    qkv[2, h * d + 5] = float("nan")  # row 2, k head 0 (through RoPE)
    cos, sin = _rope_tables(torch.tensor([1, 5, 3], device=DEV), d)
    s = torch.tensor([slot], device=DEV)
    want, got = _random_fp8_cache(hkv, t, d, 42), _random_fp8_cache(hkv, t, d, 42)
    _, k_ref = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6)
    store_kv(want, 0, k_ref, qkv[:, (h + hkv) * d:].reshape(r, hkv, 1, d), s, r)
    fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, slot=s,
                       fp8_cache=tuple(getattr(got, n)[0] for n in FP8_NAMES))
    assert got.v_scale[0][0, 0, slot, 0].item() == 1.0
    assert got.v_scale[0][1, 1, slot, 0].item() == float("inf")
    assert got.v[0][0, 0, slot].float().isnan().sum().item() == 1  # the NaN itself, the rest finite
    _assert_same_bytes(want, got, FP8_NAMES)


def test_qk_norm_rope_nvfp4_cache_refusals():
    h, hkv, d, t = 4, 2, 32, 7
    qkv = _bf16((2, (h + 2 * hkv) * d), 25)
    cos, sin = _rope_tables(torch.tensor([1, 2], device=DEV), d)
    c = _random_fp4_cache(hkv, t, d, QUANTS[0], 26)
    bufs = tuple(getattr(c, n)[0] for n in FP4_NAMES)
    s = torch.tensor([3], device=DEV)
    assert fused.fp4_cache_fits(128) and fused.fp4_cache_fits(32) and not fused.fp4_cache_fits(48)
    assert not fused.fp4_cache_fits(16)
    with pytest.raises(ValueError, match="fp4_cache and slot"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, fp4_cache=bufs)
    with pytest.raises(ValueError, match="contiguous"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, slot=s,
                           fp4_cache=(bufs[0].float(), *bufs[1:]))
    with pytest.raises(ValueError, match="contiguous"):  # a cache of fewer rows than the step's
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, slot=s,
                           fp4_cache=tuple(b[:1] for b in bufs))
    with pytest.raises(ValueError, match="scale_rule"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, slot=s, fp4_cache=bufs,
                           fp4_quant=dict(scale_rule="5"))
    q2 = _bf16((2, (h + 2 * hkv) * 48), 27)
    cos2, sin2 = _rope_tables(torch.tensor([1, 2], device=DEV), 48)
    with pytest.raises(ValueError, match="head_dim / 2 a power of two"):
        fused.qk_norm_rope(q2, cos2, sin2, h, hkv, 48, None, None, 1e-6, slot=s, fp4_cache=bufs)


def test_fused_kernels_refuse_misfit_arguments():
    """Wrong shapes, dtypes or devices are a ValueError naming the argument, never a silent misread."""
    r, h, hkv, d = 2, 4, 2, 32
    x = _bf16((r, 64), 30)
    with pytest.raises(ValueError, match="weight must be the norm's contiguous \\[64\\]"):
        fused.add_rmsnorm(x, None, _norm(48, 32).weight, 1e-6)
    qkv = _bf16((r, (h + 2 * hkv) * d), 33)
    cos, sin = _rope_tables(torch.tensor([1, 2], device=DEV), d)
    qn, kn = _norm(d, 34), _norm(d, 35)
    with pytest.raises(TypeError):  # eps is the model's (Qwen3 1e-6, Llama 1e-5): no default
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight)
    with pytest.raises(ValueError, match="sin must be"):
        fused.qk_norm_rope(qkv, cos, sin[:, :16].contiguous(), h, hkv, d, None, None, 1e-6)
    with pytest.raises(ValueError, match="cos must be"):
        fused.qk_norm_rope(qkv, cos.float(), sin, h, hkv, d, None, None, 1e-6)
    with pytest.raises(ValueError, match="k_weight must be"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, _norm(16, 36).weight, 1e-6)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, None, 1e-6)
    k_cache, v_cache = _bf16((r, hkv, 8, d), 37), _bf16((r, hkv, 8, d), 38)
    for bad in (torch.tensor([3], dtype=torch.int32, device=DEV), torch.tensor([3, 4], device=DEV)):
        with pytest.raises(ValueError, match="slot must be a \\[1\\] torch.long tensor"):
            fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache, v_cache=v_cache,
                               slot=bad)
    with pytest.raises(ValueError, match="k_cache/v_cache must be"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache[:, :1].contiguous(),
                           v_cache=v_cache[:, :1].contiguous(), slot=torch.tensor([3], device=DEV))


# ----------------------------------------------------------------------------------------------
# SiLU(gate) * up


@pytest.mark.parametrize("r,i,block", [(3, 40, None), (2, 100, 32), (1, 1536, None)])
def test_silu_mul_is_silu_times_up(r, i, block):
    gu = _bf16((r, 2 * i), 16, 4.0)
    y, xq = fused.silu_mul(gu, block=block)
    assert xq is None
    ref = F.silu(gu[:, :i]) * gu[:, i:]
    if DEV == "cuda":
        assert torch.equal(y, ref)  # libdevice expf + IEEE division: torch's CUDA SiLU
    else:
        assert ulps(y, ref) <= 1 and (y != ref).float().mean().item() <= 0.02


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,i,block", [(3, 48, None), (2, 160, 32)])
def test_silu_mul_quantizes_its_output_byte_for_byte(r, i, block, quant):
    gu = _bf16((r, 2 * i), 17, 3.0)
    y, xq = fused.silu_mul(gu, quant=quant, block=block)
    y_plain, _ = fused.silu_mul(gu, block=block)
    assert torch.equal(y, y_plain)
    assert_bytes(xq, y, quant)
    none, xq2 = fused.silu_mul(gu, quant=quant, write_y=False, block=block)
    assert none is None and torch.equal(xq2[0], xq[0]) and torch.equal(xq2[2], xq[2])


def test_silu_mul_nonfinite_follows_torch():
    gu = _bf16((2, 64), 18)
    gu[0, 3] = float("nan")
    gu[0, 4] = float("inf")  # silu(inf) = inf
    gu[1, 5] = float("-inf")  # -inf / (1 + inf) = NaN, as torch's x / (1 + exp(-x))
    y, xq = fused.silu_mul(gu, quant=QUANTS[0])
    ref = F.silu(gu[:, :32]) * gu[:, 32:]
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert_bytes(xq, y, QUANTS[0])


def test_silu_without_libdevice_on_cuda_warns_once(monkeypatch):
    """A compiled CUDA launch without libdevice falls back to tl.exp (approximate): say so, once."""
    monkeypatch.setattr(fused, "USE_LIBDEVICE", False)
    monkeypatch.setattr(fused, "INTERPRET", False)
    monkeypatch.setattr(fused, "_WARNED_NO_LIBDEVICE", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fused._libdevice_for(torch.device("cuda")) is False
        assert fused._libdevice_for(torch.device("cuda")) is False
        assert fused._libdevice_for(torch.device("cpu")) is False  # the CPU never has it: no warning
    assert sum("libdevice" in str(w.message) for w in seen) == 1
    monkeypatch.setattr(fused, "INTERPRET", True)  # the interpreter has no libdevice by design: quiet
    monkeypatch.setattr(fused, "_WARNED_NO_LIBDEVICE", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused._libdevice_for(torch.device("cuda"))
    assert not seen


def test_fused_quantize_rejects_bad_settings():
    gu = _bf16((1, 64), 19)
    with pytest.raises(ValueError, match="scale_rule"):
        fused.silu_mul(gu, quant=dict(scale_rule="5", err="mse"))
    with pytest.raises(ValueError, match="multiple of 16"):
        fused.silu_mul(_bf16((1, 40), 20), quant=QUANTS[0])


# ----------------------------------------------------------------------------------------------
# GPU: the real Qwen3-8B widths, bit for bit where claimed


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_qwen3_8b_widths(quant):
    x, h, norm = _bf16((8, 4096), 21), _bf16((8, 4096), 22), _norm(4096, 23)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant)
    assert torch.equal(xo, x + h)
    with torch.no_grad():
        assert_norm_close(y, norm(x + h))
    assert_bytes(xq, y, quant)
    gu = _bf16((8, 2 * 12288), 24, 2.0)
    y, xq = fused.silu_mul(gu, quant=quant)
    assert torch.equal(y, F.silu(gu[:, :12288]) * gu[:, 12288:])
    assert_bytes(xq, y, quant)
