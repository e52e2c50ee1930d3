"""The CUDA mma16 W4A16 kernel (fp4rl/kernels/gemv_mma16.cu): its weight copy on any device, the kernel on
a Hopper GPU.

On CPU: the copy round-trips to the standard bytes, and `emulate_weight` (the kernel's bit unpack and
fragment placement, in torch) reproduces the reference dequantized weight exactly, so a layout, bit
or fragment-mapping error is caught without a GPU. On the GPU (-m gpu): the kernel against the
float64 reference product over odd shapes, 1-64 rows, per-tensor and per-row global scales, every
split-K and depth it may choose, determinism and batch invariance."""

import pytest
import torch

from fp4rl.kernels import gemv_cuda, gemv_cuda_grouped
from fp4rl.nvfp4 import reference

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _exact(w):
    """e2m1 * block_scale in float64 from the standard bytes (no global scale)."""
    d = w.data.cpu().to(torch.int64)
    codes = torch.stack((d & 15, d >> 4), dim=-1).reshape(d.shape[0], -1)
    v = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    s = w.block_scale.cpu().view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
    return v * s


def _weight(n, k, seed=0, device="cpu", **kw):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: n // 4, :16] *= 1e-4  # tiny blocks: subnormal E4M3 scales
    w[1, 32:48] = 0.0  # an all-zero block: scale 0
    return reference.quantize(w.to(device), **kw)


@pytest.mark.parametrize("n,k,kw", [(16, 128, {}), (48, 384, {"scale_rule": "4/6"}),
                                    (144, 256, {"scale_scope": "row"})])
def test_relayout_round_trip_and_emulation(n, k, kw):
    w = _weight(n, k, **kw)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    assert wc.wt.shape == (n // 16, k // 128, 2, 32, 4) and wc.wt.dtype == torch.int32
    assert wc.st.shape == (n // 16, k // 128, 8, 8, 2) and wc.st.dtype == torch.bfloat16
    assert wc.wt.numel() * 4 == w.data.numel()  # same bytes per code
    data, scale = gemv_cuda.unrelayout(wc)
    assert torch.equal(data, w.data)
    assert torch.equal(scale, w.block_scale.view(torch.uint8))
    exact = _exact(w)
    ref = reference.dequantize(w, torch.float64)  # the reference rounds (e2m1 s) g in float32
    assert torch.allclose(exact * w.global_scale.double().reshape(-1, 1), ref, rtol=1e-6, atol=0)
    assert torch.equal(gemv_cuda.emulate_weight(wc) * 256.0, exact)


def test_emulation_catches_a_wrong_layout():
    w = _weight(16, 256)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    exact = _exact(w)
    assert torch.equal(gemv_cuda.emulate_weight(wc) * 256.0, exact)
    swapped = gemv_cuda.Mma16Weight(wt=wc.wt.roll(1, dims=3), st=wc.st, n=wc.n, k=wc.k)  # lanes shifted
    assert not torch.equal(gemv_cuda.emulate_weight(swapped) * 256.0, exact)


def test_relayout_rejects_bad_shapes():
    w = _weight(24, 128)
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        gemv_cuda.relayout(w.data, w.block_scale)
    w = _weight(16, 96)
    with pytest.raises(ValueError, match="K % 128"):
        gemv_cuda.relayout(w.data, w.block_scale)
    w = _weight(16, 128)
    with pytest.raises(ValueError, match="block_scale must be"):
        gemv_cuda.relayout(w.data, w.block_scale[:, :4])


@pytest.mark.parametrize("fill", [2, 3])
def test_choose_is_row_invariant_up_to_16_and_fits_shared_memory(fill, monkeypatch):
    monkeypatch.setattr(gemv_cuda, "DENSE_FILL", fill)
    for n, k in ((4096, 14336), (14336, 4096), (6144, 4096), (24576, 4096), (2048, 768), (16, 128),
                 (5120, 2048)):
        cfgs = [gemv_cuda.choose(n, k, m, 132) for m in range(1, 17)]
        # the split of K decides the sums: SPLIT CTAs of a cluster from 2 rows, KW warps of a CTA at one row
        assert all(gemv_cuda.ksplit(c) == gemv_cuda.ksplit(cfgs[0]) for c in cfgs)
        assert all(c.get("KW", 1) == 1 for c in cfgs[1:])
        assert cfgs[0]["SPLIT"] == 1 and cfgs[0].get("KW", 1) == cfgs[1]["SPLIT"]
        for m in (1, 17, 33, 64):
            if not gemv_cuda.fits(n, k, m, 132):
                assert m > 16 and k > 4096  # 64 rows of a long K slice: the dispatcher takes another kernel
                continue
            c = gemv_cuda.choose(n, k, m, 132)
            assert gemv_cuda.smem_bytes(c, k, m) <= gemv_cuda.SMEM_LIMIT or gemv_cuda.ksplit(c) == 8
            assert (k // 128) >= gemv_cuda.ksplit(c)
    # x streamed with the weights where 9+ rows of a long slice would be staged whole (measured: RESULTS.md)
    assert gemv_cuda.choose(24576, 4096, 16, 132).get("XSTREAM") == 1
    assert "XSTREAM" not in gemv_cuda.choose(24576, 4096, 8, 132)
    assert "XSTREAM" not in gemv_cuda.choose(4096, 12288, 16, 132)  # split 8: short slices, staged
    with pytest.raises(ValueError, match="1-64 rows"):
        gemv_cuda.choose(4096, 4096, 65, 132)


def test_dense_fill_lets_the_split_take_more_ctas_per_sm(monkeypatch):
    """DENSE_FILL (FP4RL_MMA16_FILL): the CTAs per SM choose's split may fill. The q/k/v of Qwen3-30B-A3B
    (5120x2048) and Qwen3-8B (6144x4096) split K in 4 (160 / 192 CTAs on 132 SMs) at the default
    2 and in 8 (320 / 384) at 3, at 1 row (KW) and at 8 (a cluster) alike; shapes already past a wave do not
    change."""
    def plan(n, k, m):
        cfg = gemv_cuda.choose(n, k, m, 132)
        return gemv_cuda.ksplit(cfg), -(-n // gemv_cuda.block_rows(cfg)) * cfg["SPLIT"]

    for fill, want in ((2, [(4, 160), (4, 192)]), (3, [(8, 320), (8, 384)])):
        monkeypatch.setattr(gemv_cuda, "DENSE_FILL", fill)
        for m in (1, 8):
            assert [plan(5120, 2048, m), plan(6144, 4096, m)] == want, (fill, m)
        assert plan(14336, 4096, 1) == (2, 224) and plan(2048, 4096, 1) == (8, 128)


def test_in_cta_split_moves_the_cluster_split_where_x_fits(monkeypatch):
    """At one row (and for the routed experts' chunks) the split of K goes from a cluster of SPLIT CTAs to
    KW = SPLIT warps of one CTA with 128 / KW weight rows, where x's whole K then fits two CTAs per SM; never
    for x streamed in chunks, the wgmma build, or with FP4RL_MMA16_KW=0 (IN_CTA_SPLIT False)."""
    c = gemv_cuda.choose(2048, 4096, 1, 132)  # Qwen3-30B-A3B's o projection at one token
    assert c["SPLIT"] == 1 and c["KW"] == gemv_cuda.choose(2048, 4096, 2, 132)["SPLIT"] == 8
    assert gemv_cuda.block_rows(c) == 16 and gemv_cuda.block_rows(gemv_cuda.choose(2048, 4096, 2, 132)) == 128
    # one set of partials per k range, x's whole K (2 rows: the row and the zero row)
    assert gemv_cuda.smem_bytes(c, 4096) >= 8 * 8 * (16 + 4) * 4
    assert gemv_cuda.smem_bytes(c, 4096, 1) == -(-2 * (4096 + 8) * 2 // 128) * 128 + 8 * 2 * 1280
    for cfg in (dict(NT=1, MG=2, SPLIT=2, DEPTH=2, XSTREAM=1), dict(NT=1, MG=1, SPLIT=1, DEPTH=2),
                dict(NT=1, MG=4, SPLIT=2, DEPTH=2, XSTREAM=1, WGMMA=1)):
        assert gemv_cuda.in_cta_split(cfg, 4096, 8) == cfg
    # a K whose whole slice of 9 rows does not fit two CTAs per SM keeps the cluster
    long = dict(NT=1, MG=1, SPLIT=4, DEPTH=2)
    assert gemv_cuda.in_cta_split(long, 8192, 8) == long
    assert gemv_cuda.in_cta_split(long, 4096, 8) == dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=4)
    assert gemv_cuda_grouped.choose_grouped(2048, 768, 8, 132) == dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2)
    monkeypatch.setattr(gemv_cuda, "IN_CTA_SPLIT", False)
    assert gemv_cuda.in_cta_split(long, 4096, 8) == long
    assert gemv_cuda.choose(2048, 4096, 1, 132) == gemv_cuda.choose(2048, 4096, 2, 132)


def test_kernel_source_unpacks_like_the_emulation():
    """emulate_weight mirrors the kernel's unpack: the .cu must use the same masks and shifts (a change on
    one side only is caught here, without a GPU)."""
    src = gemv_cuda._SOURCE.read_text()
    body = src[src.index("void unpack("):src.index("}", src.index("void unpack("))]
    for line in ("p0 = w & M;", "p1 = (w << 3) & M;", "p2 = (w << 6) & M;",
                 "p3 = ((w >> 4) & 0x00C000C0u) | ((w << 1) & 0x80008000u) | ((w >> 5) & 0x01000100u);",
                 "const u32 M = 0x81C081C0u;"):
        assert line in body, line
    w = torch.tensor([0x12345678, 0xFFFFFFFF, 0x80000001], dtype=torch.int64)
    pairs = gemv_cuda._unpack_pairs(w)
    m = 0x81C081C0
    expect = [w & m, (w << 3) & m, (w << 6) & m,
              ((w >> 4) & 0x00C000C0) | ((w << 1) & 0x80008000) | ((w >> 5) & 0x01000100)]
    for p, e in zip(pairs, expect):
        assert torch.equal(p, e & 0xFFFFFFFF)


def test_available_is_false_without_hopper():
    if not torch.cuda.is_available():
        assert not gemv_cuda.available()


# ----------------------------------------------------------------------------- GPU
def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def _gpu_case(n, k, kw, rows, seed):
    """A quantized N x K weight on the GPU, its mma16 copy, its float64 dequantization, its global scale(s)
    and `rows` rows of bf16 x."""
    w = _weight(n, k, device="cuda", **kw)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    wd = reference.dequantize(w, torch.float64)
    g = w.global_scale.float().reshape(-1)
    base = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()
    return w, wc, wd, g, base


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,kw", [(16, 128, {}), (144, 384, {"scale_scope": "row"}), (1008, 1280, {}),
                                    (4096, 4096, {"scale_rule": "4/6"}), (768, 14336, {})])
def test_gpu_kernel_matches_reference(n, k, kw):
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, kw, 64, seed=3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ys = {}
    for m in (1, 2, 5, 8, 9, 16, 17, 32, 40, 64):
        if not gemv_cuda.fits(n, k, m, sms):
            continue
        x = base[:m]
        ref = x.double() @ wd.T
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(x, wc, g, y)
        assert _rel(y, ref) < 4e-3, (m, _rel(y, ref))
        y2 = torch.empty_like(y)
        gemv_cuda.launch(x, wc, g, y2)
        assert torch.equal(y, y2)  # deterministic
        ys[m] = y
        for depth in (2, 3, 6):  # other pipeline depths and splits give the same products
            cfg = dict(gemv_cuda.choose(n, k, m, sms), DEPTH=depth)
            if gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_MAX:
                gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                assert _rel(y2, ref) < 4e-3
        plain = {key: v for key, v in gemv_cuda.choose(n, k, m, sms).items() if key != "KW"}  # cluster splits
        for split in (1, 2, 4, 8):
            if (k // 128) >= split:
                cfg = dict(plain, SPLIT=split)
                if gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_MAX:
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split)
                for depth in (2, 3, 4):  # x streamed in 128-k chunks with the weights (XSTREAM)
                    cfg = dict(plain, SPLIT=split, DEPTH=depth, XSTREAM=1)
                    y2.fill_(float("nan"))
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split, depth, "xstream")
                    if m <= 32:  # ... and multiplied by wgmma (weights: register A; x: B in shared memory)
                        for nt in (1, 2):  # one or two m64 tiles per warpgroup
                            y2.fill_(float("nan"))
                            gemv_cuda.launch(x, wc, g, y2, cfg=dict(cfg, WGMMA=1, NT=nt))
                            assert _rel(y2, ref) < 4e-3, (m, split, depth, "wgmma", nt)
    # rows up to 16 share a split of K: row 0 is bit-identical at every row count of 1-16 on the same build
    # (mma.sync, one row included; the wgmma build where gemv_cuda.choose_narrow takes it: within rounding)
    first = {}
    for m in (1, 2, 5, 8, 9, 16):
        if m in ys:
            build = bool(gemv_cuda._plan(n, k, m, 0).get("WGMMA"))
            assert torch.equal(ys[m][0], ys[first.setdefault(build, m)][0]), m
            assert _rel(ys[m][:1], ys[1][:1].double()) < 1e-3, m
    # a strided x (a view with a padded row stride) is read through its stride
    xs = torch.zeros(3, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]
    xs.copy_(base[:3])
    y = torch.empty(3, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch(xs, wc, g, y)
    assert torch.equal(y, ys[5][:3]) or _rel(y, base[:3].double() @ wd.T) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(144, 640), (1008, 1280), (2048, 4096)])
def test_gpu_in_cta_split_gives_the_cluster_splits_bits(n, k):
    """KW warps of a CTA splitting K give the bits of SPLIT = KW CTAs of a cluster (the same step ranges, the
    same summation tree), for 1-16 rows, every split K's steps allow (uneven ranges at K = 640: 5 steps),
    per-row global scales and W4A4's per-row x scales; N not a multiple of the CTA's rows."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 16, seed=5)
    gr = (g * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
    xs = torch.rand(16, device="cuda") + 0.5
    for m in (1, 3, 8, 16):
        x, ref = base[:m], base[:m].double() @ wd.T
        for split in (2, 4, 8):
            if (k // 128) < split:
                continue
            mg = 1 if m <= 8 else 2
            cluster = dict(NT=1, MG=mg, SPLIT=split, DEPTH=2)
            inside = dict(NT=1, MG=mg, SPLIT=1, DEPTH=2, KW=split)
            for gs, x_scale in ((g, None), (gr, None), (g, xs[:m])):
                a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                b = torch.full_like(a, float("nan"))
                gemv_cuda.launch(x, wc, gs, a, cfg=cluster, x_scale=x_scale)
                gemv_cuda.launch(x, wc, gs, b, cfg=inside, x_scale=x_scale)
                assert not a.isnan().any() and torch.equal(a, b), (m, split, gs.numel(), x_scale is None)
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            gemv_cuda.launch(x, wc, g, y, cfg=inside)
            assert _rel(y, ref) < 4e-3, (m, split)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(144, 640), (1008, 1280), (4096, 4096)])
def test_gpu_four_warps_a_cta_give_the_same_bits(n, k):
    """WARPS 4 in the mma.sync builds (an A/B key, not in choose's rule: 64 weight rows a CTA) against the
    8-warp build: each warp's n-tiles and the split's reduction unchanged, so the same bits, at 1-16 rows,
    every split K's steps allow, the staged x slice and the streamed one (XSTREAM), per-row global scales and
    W4A4's per-row x scales; N not a multiple of 64 rows."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 16, seed=7)
    gr = (g * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
    xs = torch.rand(16, device="cuda") + 0.5
    for m in (1, 3, 8, 16):
        x = base[:m]
        for split in (1, 2, 4, 8):
            if (k // 128) < split:
                continue
            for xstream in (0, 1):
                eight = dict(NT=1, MG=1 if m <= 8 else 2, SPLIT=split, DEPTH=2, XSTREAM=xstream)
                for gs, x_scale in ((g, None), (gr, None), (g, xs[:m])):
                    a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    b = torch.full_like(a, float("nan"))
                    gemv_cuda.launch(x, wc, gs, a, cfg=eight, x_scale=x_scale)
                    gemv_cuda.launch(x, wc, gs, b, cfg=dict(eight, WARPS=4), x_scale=x_scale)
                    assert not b.isnan().any() and torch.equal(a, b), (m, split, xstream, gs.numel())
                    if gs is g and x_scale is None:
                        assert _rel(b, x.double() @ wd.T) < 4e-3, (m, split, xstream)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(144, 640), (2048, 4096)])
def test_gpu_global_scale_read_early_gives_the_same_bits(n, k):
    """The weight's global scale read before the PDL wait (GSE, the KW builds' default) or in the epilogue:
    the same bits, in the cluster and the in-CTA split, at 1-16 rows, with W4A4's per-row x scales."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 16, seed=7)
    xs = torch.rand(16, device="cuda") + 0.5
    cfgs = {1: [dict(NT=1, MG=1, SPLIT=2, DEPTH=2), dict(NT=1, MG=1, SPLIT=1, DEPTH=2, KW=2)],
            16: [dict(NT=1, MG=2, SPLIT=4, DEPTH=2), dict(NT=1, MG=2, SPLIT=1, DEPTH=3, KW=4)]}
    for m in (1, 3, 16):
        for base_cfg in cfgs[1 if m <= 8 else 16]:
            for x_scale in (None, xs[:m]):
                a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv_cuda.launch(base[:m], wc, g, a, cfg=dict(base_cfg, GSE=0), x_scale=x_scale)
                assert not a.isnan().any()
                if x_scale is None:
                    assert _rel(a, base[:m].double() @ wd.T) < 4e-3
                b = torch.full_like(a, float("nan"))
                gemv_cuda.launch(base[:m], wc, g, b, cfg=dict(base_cfg, GSE=1), x_scale=x_scale)
                assert torch.equal(a, b), (m, base_cfg, x_scale is None)


@pytest.mark.gpu
def test_gpu_w4a4_through_mma16():
    """W4A4 emulation at 1-16 rows on the mma16 copy: x = e2m1 * block_scale (exact bf16), x's per-row global
    scale applied to the FP32 sum with the weight's; the same products as the Triton W4A4 kernel."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.kernels import gemm

    w = _weight(512, 1024, device="cuda")
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=wc)
    for m in (1, 5, 16):
        rows_scale = torch.logspace(-2, 2, m, device="cuda")[:, None]  # per-row global scales that differ
        x = (torch.randn(m, 1024, device="cuda") * rows_scale).bfloat16()
        xq = gemm.quantize_activations(x)
        xr = gemm.dequantize(*xq, torch.float32).double()  # the quantized activation, exactly
        ref = xr @ reference.dequantize(w, torch.float64).T
        y = gemm.gemm(None, wm, xq=xq)
        assert _rel(y, ref) < 4e-3
        assert _rel(y, gemm.gemm(None, w, xq=xq).double()) < 4e-3  # the Triton W4A4 kernel


@pytest.mark.gpu
def test_gpu_refusals_fall_back_without_disabling():
    """A shape whose x slice does not fit shared memory, and a misaligned x, go elsewhere (or are copied)
    without switching the kernel off for the process."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.kernels import gemm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # the shortest K whose slice of 16 rows does not fit even at split 8 (one row does)
    k = next(k for k in range(1024, 1 << 17, 1024) if not gemv_cuda.fits(256, k, 16, sms))
    assert gemv_cuda.fits(256, k, 1, sms)
    w = _weight(256, k, device="cuda")
    wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale,
                         mma16=gemv_cuda.relayout(w.data, w.block_scale))
    x = torch.randn(16, k, device="cuda").bfloat16()
    ref = x.double() @ reference.dequantize(w, torch.float64).T
    assert _rel(gemm.gemm(x, wm), ref) < 4e-3  # the Triton kernels
    assert gemv_cuda.available()
    buf = torch.randn(2 * k + 8, device="cuda").bfloat16()
    xm = buf[4:4 + k].view(1, k)  # contiguous, 8 bytes off a 16-byte boundary
    assert xm.is_contiguous() and xm.data_ptr() % 16
    y = gemm.gemm(xm, wm)
    assert _rel(y, xm.double() @ reference.dequantize(w, torch.float64).T) < 4e-3
    assert gemv_cuda.available()


@pytest.mark.gpu
def test_gpu_gemm_dispatch_and_decode_copy():
    """gemm.gemm takes the mma16 copy for 1-16 rows; the sampler's decode copy (gpu_linear._DecodeCopy) is
    rebuilt in the same storage after an in-place weight update, so captured graphs read the new weight."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.gpu_linear import _DecodeCopy
    from fp4rl.kernels import gemm

    w = _weight(256, 512, device="cuda")
    cache = _DecodeCopy()
    wc = cache.get(w.data, w.block_scale)
    assert isinstance(wc, gemv_cuda.Mma16Weight)
    assert wc is cache.get(w.data, w.block_scale)  # unchanged bytes: the same copy, not rebuilt
    ptr = wc.wt.data_ptr()
    for m in (1, 7, 16, 24, 48):  # mma.sync up to 16 rows, wgmma (on sm_90) above
        x = torch.randn(m, 512, device="cuda").bfloat16()
        ref = x.double() @ reference.dequantize(w, torch.float64).T
        wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=wc)
        assert _rel(gemm.gemm(x, wm), ref) < 4e-3
    # the sampler's linears pass the copy up to 16 rows, and (sm_90) up to 512 for the wgmma configuration
    from fp4rl.gpu_linear import _decode_copy

    for rows in (16, 48, 100, 512, 513):
        x = torch.empty(rows, 512, device="cuda", dtype=torch.bfloat16)
        copy = _decode_copy(cache, w.data, w.block_scale, "w4a16", x)
        want = rows <= 16 or (rows <= gemm.WIDE_TUNE_MAX_ROWS and gemv_cuda.wide_available())
        assert (copy is wc) == want, rows
    w2 = _weight(256, 512, seed=5, device="cuda")
    w.data.copy_(w2.data)  # a weight sync writes new bytes in place
    w.block_scale.copy_(w2.block_scale)
    wc2 = cache.get(w.data, w.block_scale)
    assert wc2 is wc and wc2.wt.data_ptr() == ptr  # same storage: captured graphs stay valid
    data, scale = gemv_cuda.unrelayout(wc2)
    assert torch.equal(data, w2.data) and torch.equal(scale, w2.block_scale.view(torch.uint8))


def test_in_cta_split_switch_and_benchmark_setting(monkeypatch):
    """set_in_cta_split drops the cached plans (a plan made before would keep the old split); the sampler
    benchmark's --k-split items."""
    from fp4rl.benchmarks.sampler_gpu import split_setting

    monkeypatch.setattr(gemv_cuda, "IN_CTA_SPLIT", True)
    calls = []
    monkeypatch.setattr(gemv_cuda, "choose",
                        lambda *a: calls.append(a) or {"KW": 2 if gemv_cuda.IN_CTA_SPLIT else 1})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"multi_processor_count": 1}))
    gemv_cuda._plan.cache_clear()
    assert gemv_cuda._plan(64, 256, 1, 0)["KW"] == 2 and gemv_cuda._plan(64, 256, 1, 0)["KW"] == 2
    assert len(calls) == 1  # cached
    gemv_cuda.set_in_cta_split(False)
    assert gemv_cuda._plan(64, 256, 1, 0)["KW"] == 1 and len(calls) == 2
    assert split_setting("default") is False and split_setting("cta") is True
    assert split_setting("cluster") is False
    gemv_cuda.set_in_cta_split(True)
    assert split_setting("default") is True
    with pytest.raises(ValueError, match="--k-split item 'warp'"):
        split_setting("warp")
    gemv_cuda._plan.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (1008, 1280)])
def test_gpu_one_row_deeper_rings_give_the_same_bits(n, k):
    """gemv_cuda.deeper (FP4RL_MMA16_DEPTH1): one row through rings of 3-6 steps gives the bits of choose's
    depth-2 ring, eagerly and in a CUDA graph with PDL (where the deeper ring is issued before the wait)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    _, wc, _, g, base = _gpu_case(n, k, {}, 1, seed=8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = gemv_cuda.choose(n, k, 1, sms)
    want = gemv_cuda.launch(base, wc, g, torch.empty(1, n, dtype=torch.bfloat16, device="cuda"), cfg=cfg)
    for depth in (3, 4, 6):
        deep = gemv_cuda.deeper(cfg, depth, k, 1)
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(base, wc, g, y, cfg=deep)
        assert torch.equal(y, want), (depth, deep)
        graph = torch.cuda.CUDAGraph()
        y.fill_(float("nan"))
        with torch.cuda.graph(graph):
            gemv_cuda.launch(base, wc, g, y, cfg=deep)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want), (depth, deep, "graph")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (1008, 1280)])
def test_gpu_row_scales_read_early_keep_the_bits(n, k, monkeypatch):
    """ROW_SCALE_EARLY (FP4RL_MMA16_GSR): one row with per-row global scales (a fused q/k/v's) and the in-CTA
    split gives the bits of the epilogue's own read of the scales, eagerly and in a CUDA graph."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    _, wc, _, g, base = _gpu_case(n, k, {}, 1, seed=21)
    gr = (g * torch.linspace(0.25, 4.0, n, device="cuda")).contiguous()  # [N]: per-row scales
    outs = []
    for early in (False, True):
        monkeypatch.setattr(gemv_cuda, "ROW_SCALE_EARLY", early)
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(base, wc, gr, y)
        outs.append(y)
        y2 = torch.full_like(y, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv_cuda.launch(base, wc, gr, y2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y2, y), early
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])
