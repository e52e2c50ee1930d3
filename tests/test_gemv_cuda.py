"""The CUDA mma16 W4A16 kernel (fp4rl/kernels/gemv_mma16.cu): its weight copy on any device, the kernel on
a Hopper GPU.

On CPU: the copy round-trips to the standard bytes, and `emulate_weight` (the kernel's bit unpack and
fragment placement, in torch) reproduces the reference dequantized weight exactly, so a layout, bit
or fragment-mapping error is caught without a GPU. On the GPU (-m gpu): the kernel against the
float64 reference product over odd shapes, 1-64 rows, per-tensor and per-row global scales, every
split-K and depth it may choose, determinism and batch invariance."""

import pytest
import torch

from fp4rl.kernels import gemv_cuda
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


def test_choose_is_row_invariant_up_to_16_and_fits_shared_memory():
    for n, k in ((4096, 14336), (14336, 4096), (6144, 4096), (24576, 4096), (2048, 768), (16, 128)):
        cfgs = [gemv_cuda.choose(n, k, m, 132) for m in range(1, 17)]
        assert all(c["SPLIT"] == cfgs[0]["SPLIT"] for c in cfgs)  # the split-K order decides the sums
        for m in (1, 17, 33, 64):
            if not gemv_cuda.fits(n, k, m, 132):
                assert m > 16 and k > 4096  # 64 rows of a long K slice: the dispatcher takes another kernel
                continue
            c = gemv_cuda.choose(n, k, m, 132)
            assert gemv_cuda.smem_bytes(c, k, m) <= gemv_cuda.SMEM_LIMIT or c["SPLIT"] == 8
            assert (k // 128) >= c["SPLIT"]
    # x streamed with the weights where 9+ rows of a long slice would be staged whole (measured: RESULTS.md)
    assert gemv_cuda.choose(24576, 4096, 16, 132).get("XSTREAM") == 1
    assert "XSTREAM" not in gemv_cuda.choose(24576, 4096, 8, 132)
    assert "XSTREAM" not in gemv_cuda.choose(4096, 12288, 16, 132)  # split 8: short slices, staged
    with pytest.raises(ValueError, match="1-64 rows"):
        gemv_cuda.choose(4096, 4096, 65, 132)


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
        for split in (1, 2, 4, 8):
            if (k // 128) >= split:
                cfg = dict(gemv_cuda.choose(n, k, m, sms), SPLIT=split)
                if gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_MAX:
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split)
                for depth in (2, 3, 4):  # x streamed in 128-k chunks with the weights (XSTREAM)
                    cfg = dict(gemv_cuda.choose(n, k, m, sms), SPLIT=split, DEPTH=depth, XSTREAM=1)
                    y2.fill_(float("nan"))
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split, depth, "xstream")
                    if m <= 32:  # ... and multiplied by wgmma (weights: register A; x: B in shared memory)
                        for nt in (1, 2):  # one or two m64 tiles per warpgroup
                            y2.fill_(float("nan"))
                            gemv_cuda.launch(x, wc, g, y2, cfg=dict(cfg, WGMMA=1, NT=nt))
                            assert _rel(y2, ref) < 4e-3, (m, split, depth, "wgmma", nt)
    for m in (2, 5, 8, 9, 16):  # rows up to 16 share a configuration: row 0 is bit-identical
        assert torch.equal(ys[m][0], ys[1][0])
    # a strided x (a view with a padded row stride) is read through its stride
    xs = torch.zeros(3, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]
    xs.copy_(base[:3])
    y = torch.empty(3, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch(xs, wc, g, y)
    assert torch.equal(y, ys[5][:3]) or _rel(y, base[:3].double() @ wd.T) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,kw", [(144, 384, {"scale_scope": "row"}), (1008, 1280, {}),
                                    (4096, 4096, {"scale_rule": "4/6"}), (768, 14336, {})])
def test_gpu_wide_matches_reference(n, k, kw):
    """The wgmma configuration (17+ rows, row blocks of <= 128 in grid z) against the float64 product: odd
    row counts, N not a multiple of the CTA's 256 rows (tiles past N read zeros), every split, W4A4's per-row
    x scales, the dispatch in gemm.gemm, and a strided x."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.kernels import gemm

    w, wc, wd, g, base = _gpu_case(n, k, kw, 300, seed=4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=wc)
    for m in (17, 33, 100, 128, 129, 300):
        x = base[:m]
        ref = x.double() @ wd.T
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch_wide(x, wc, g, y)
        assert _rel(y, ref) < 4e-3, (m, _rel(y, ref))
        y2 = torch.empty_like(y)
        gemv_cuda.launch_wide(x, wc, g, y2)
        assert torch.equal(y, y2)  # deterministic
        if gemm.wide_rows(m, n):
            assert torch.equal(gemm.gemm(x, wm), y)  # gemm.gemm dispatches these rows here
        for split in (1, 2, 4, 8) if m in (33, 129) else ():
            for nt, swz in ((1, 0), (2, 0), (1, 1), (2, 1)):  # x stages without / with the 128 B swizzle
                if (k // 128) >= split:
                    cfg = dict(gemv_cuda.choose_wide(n, k, m, sms), SPLIT=split, NT=nt, SWZ=swz)
                    y2.fill_(float("nan"))
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split, nt, swz)
    # within a band of rows (17-32, 33-64) a row's result does not depend on the other rows
    for band in ((17, 24, 32), (33, 50, 64)):
        ys = []
        for m in band:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ys.append(gemv_cuda.launch_wide(base[:m], wc, g, y)[:band[0]])
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), band
    # W4A4: x = e2m1 * block_scale with per-row global scales over 4 decades (through gemm.gemm at 48 rows,
    # directly at 150: two row blocks)
    for m in (48, 150):
        x = (base[:m].float() * torch.logspace(-2, 2, m, device="cuda")[:, None]).bfloat16()
        xq = gemm.quantize_activations(x)
        ref = gemm.dequantize(*xq, torch.float32).double() @ wd.T
        if gemm.wide_rows(m, n):
            assert _rel(gemm.gemm(None, wm, xq=xq), ref) < 4e-3
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        xin = gemm.dequantize(xq[0], xq[1], xq[2], torch.bfloat16, apply_global=False)
        gemv_cuda.launch_wide(xin, wc, g, y, x_scale=xq[2])
        assert _rel(y, ref) < 4e-3, m
    # a strided x (padded rows) is read through its stride
    xs = torch.zeros(40, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]
    xs.copy_(base[:40])
    y = torch.empty(40, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch_wide(xs, wc, g, y)
    assert _rel(y, base[:40].double() @ wd.T) < 4e-3


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
    w2 = _weight(256, 512, seed=5, device="cuda")
    w.data.copy_(w2.data)  # a weight sync writes new bytes in place
    w.block_scale.copy_(w2.block_scale)
    wc2 = cache.get(w.data, w.block_scale)
    assert wc2 is wc and wc2.wt.data_ptr() == ptr  # same storage: captured graphs stay valid
    data, scale = gemv_cuda.unrelayout(wc2)
    assert torch.equal(data, w2.data) and torch.equal(scale, w2.block_scale.view(torch.uint8))


def test_relayout_stack_is_the_experts_copies_one_after_another():
    e, n, k = 3, 32, 256
    ws = [_weight(n, k, seed=i) for i in range(e)]
    data = torch.stack([w.data for w in ws])
    scale = torch.stack([w.block_scale for w in ws])
    st = gemv_cuda.relayout_stack(data, scale)
    assert (st.n, st.k) == (n, k) and st.wt.shape[0] == e * n // 16
    one = [gemv_cuda.relayout(w.data, w.block_scale) for w in ws]
    assert torch.equal(st.wt, torch.cat([c.wt for c in one]))
    assert torch.equal(st.st, torch.cat([c.st for c in one]))
    with pytest.raises(ValueError, match=r"\[E, N, K/2\]"):
        gemv_cuda.relayout_stack(ws[0].data, ws[0].block_scale)


def test_wgmma_source_has_one_operand_per_accumulator():
    for mg in (1, 2, 3, 4, 13, 16):
        src = gemv_cuda._wgmma_source(mg)
        assert f"m64n{8 * mg}k16.f32.bf16.bf16" in src
        assert src.count('"+f"(d[') == 4 * mg  # n / 2 fp32 accumulators per thread
        assert f"%{4 * mg + 4}, p, 1, 1, 0" in src  # the descriptor follows the 4 A registers
    cfg = dict(NT=1, MG=4, SPLIT=2, DEPTH=2)
    assert "void wgmma_m64k16(" in gemv_cuda.source(dict(cfg, XSTREAM=1, WGMMA=1), False)
    assert "void wgmma_m64k16(" not in gemv_cuda.source(cfg, False)


def test_choose_wide_covers_every_row_in_blocks_of_at_most_128():
    for n, k in ((4096, 14336), (14336, 4096), (6144, 4096), (144, 384), (2048, 768)):
        for m in (1, 17, 24, 33, 64, 100, 128, 129, 300, 512, 1000, 4096):
            cfg = gemv_cuda.choose_wide(n, k, m, 132)
            zb = -(-m // (8 * cfg["MG"]))
            assert cfg["WGMMA"] == 1 and cfg["XSTREAM"] == 1 and cfg["SWZ"] == 1 and cfg["MG"] <= 16
            assert zb == -(-m // 128)  # as few row blocks as 128-row blocks allow ...
            assert 8 * cfg["MG"] * zb - m < 8 * zb  # ... with the rows spread evenly (< 8 padding rows each)
            assert cfg["NT"] == (1 if zb == 1 else 2)  # several row blocks: 256 weight rows share x chunks
            assert gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_MAX
            assert cfg["SPLIT"] in (1, 2, 4, 8) and (cfg["SPLIT"] == 1 or (k // 128) // cfg["SPLIT"] >= 2)
    # the splits the H200 sweep found best (bench/RESULTS.md, sixth session)
    for n, k, m, split in ((4096, 14336, 32, 8), (14336, 4096, 64, 2), (24576, 4096, 32, 2),
                           (6144, 4096, 64, 4), (4096, 6144, 128, 4), (14336, 4096, 512, 1)):
        assert gemv_cuda.choose_wide(n, k, m, 132)["SPLIT"] == split, (n, k, m)
    with pytest.raises(ValueError, match="at least one row"):
        gemv_cuda.choose_wide(4096, 4096, 0, 132)


def test_wide_rows_dispatch_ranges():
    from fp4rl.kernels import gemm

    assert not gemm.wide_rows(16, 14336)  # mma.sync up to 16 rows
    assert gemm.wide_rows(17, 4096) and gemm.wide_rows(32, 4096)  # wgmma at 17-32 rows on any weight
    assert not gemm.wide_rows(48, 4096) and gemm.wide_rows(48, 14336)  # 33-64 rows on wide weights only
    assert not gemm.wide_rows(65, 14336) and not gemm.wide_rows(512, 14336)  # Triton / dequantize+cuBLAS


def test_choose_wide_split_depends_on_the_band_of_rows_only():
    for n, k in ((14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)):
        for band in (range(1, 33), range(33, 65), range(65, 129)):
            assert len({gemv_cuda.choose_wide(n, k, m, 132)["SPLIT"] for m in band}) == 1, (n, k, band)


def test_choose_grouped_splits_to_fill_the_gpu():
    cfg = gemv_cuda.choose_grouped(1536, 2048, 8, 132)
    assert cfg["MG"] == 1 and cfg["SPLIT"] >= 2  # 8 experts x 12 n-blocks: split to fill the GPU
    assert gemv_cuda.choose_grouped(1536, 2048, 128, 132)["SPLIT"] == 1  # many experts: a wave already
    assert gemv_cuda.choose_grouped(2048, 768, 8, 132)["SPLIT"] <= 768 // 128 // 2


@pytest.mark.gpu
def test_gpu_grouped_experts_match_reference_and_replay_new_routing():
    """Routed experts on the grouped mma16 kernel: each expert's rows against the float64 reference, with
    empty experts, one expert taking every row, 9-41 rows per expert (several 8-row chunks), per-row and
    per-expert global scales, W4A4 (x_scale), and a CUDA graph captured once and replayed with new routing
    (the kernel finds its experts and chunks from the offsets on the device)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from fp4rl.kernels import gemm, pdl

    e, n, k = 6, 256, 384
    ws = [_weight(n, k, seed=10 + i, device="cuda") for i in range(e)]
    data = torch.stack([w.data for w in ws])
    scale = torch.stack([w.block_scale for w in ws])
    wd = torch.stack([reference.dequantize(w, torch.float64) for w in ws])  # [E, N, K] with global scales
    gexp = torch.stack([w.global_scale.float().reshape(()) for w in ws])  # [E]
    wc = gemv_cuda.relayout_stack(data, scale)

    def check(counts, per_row: bool, w4a4: bool = False):
        offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device="cuda")
        m = int(offs[-1])
        x = torch.randn(m, k, device="cuda").bfloat16()
        g = gexp[:, None].expand(e, n).contiguous() if per_row else gexp
        xs = None
        if w4a4:
            xq = gemm.quantize_activations(x)
            x = gemm.dequantize(xq[0], xq[1], xq[2], torch.bfloat16, apply_global=False)
            xs = xq[2]
        y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        with pdl.step():
            gemv_cuda.launch_grouped(x, wc, g, offs, y, x_scale=xs)
        xr = x.double() * (xs.double().reshape(-1, 1) if xs is not None else 1.0)
        for i in range(e):
            a, b = int(offs[i]), int(offs[i + 1])
            if b > a:
                assert _rel(y[a:b], xr[a:b] @ wd[i].T) < 4e-3, (counts, i)
        return offs, x, y

    check([1, 0, 2, 0, 0, 1], per_row=True)
    check([0, 0, 0, 16, 0, 0], per_row=False)  # one expert, two 8-row chunks
    check([16, 3, 16, 0, 9, 1], per_row=True)
    check([2, 2, 0, 1, 0, 3], per_row=False, w4a4=True)
    check([0, 41, 0, 7, 0, 0], per_row=True)  # 6 chunks of one expert (replayed routing can do this)
    check([9, 9, 9, 9, 9, 9], per_row=False, w4a4=True)
    # one graph, new routing each replay (same M, same most-rows bound)
    offs = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    m = 8
    x = torch.randn(m, k, device="cuda").bfloat16()
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    offs.copy_(torch.tensor([0, 8, 8, 8, 8, 8, 8], dtype=torch.int32))
    gemv_cuda.launch_grouped(x, wc, gexp, offs, y)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda.launch_grouped(x, wc, gexp, offs, y)
    for counts in ([8, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 3], [0, 0, 4, 0, 4, 0]):
        offs.copy_(torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32))
        y.fill_(float("nan"))
        graph.replay()
        for i in range(e):
            a, b = int(offs[i]), int(offs[i + 1])
            if b > a:
                assert _rel(y[a:b], x[a:b].double() @ wd[i].T) < 4e-3, (counts, i)


@pytest.mark.gpu
def test_gpu_grouped_gather_equals_gathered_rows_and_replays():
    """x_rows: the kernel reads sorted row r from token x_rows[r] of the un-gathered x; the result is bit for
    bit the launch on x.index_select(0, x_rows), for routings with repeated tokens and empty experts, and in a
    CUDA graph replayed with new rows and offsets. W4A4 (x_scale) refuses x_rows."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from fp4rl.kernels import pdl

    e, n, k, t, top = 6, 256, 384, 5, 3
    ws = [_weight(n, k, seed=30 + i, device="cuda") for i in range(e)]
    wc = gemv_cuda.relayout_stack(torch.stack([w.data for w in ws]), torch.stack([w.block_scale for w in ws]))
    g = torch.stack([w.global_scale.float().reshape(()) for w in ws])
    x = torch.randn(t, k, device="cuda").bfloat16()
    gen = torch.Generator().manual_seed(0)

    def routing():
        idx = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)]).reshape(-1)
        order = torch.argsort(idx, stable=True)
        counts = torch.bincount(idx, minlength=e)
        offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
        return (order // top).to(torch.int32).cuda(), offs.cuda()

    m = t * top
    for _ in range(3):
        rows, offs = routing()
        want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        got = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        with pdl.step():
            gemv_cuda.launch_grouped(x.index_select(0, rows), wc, g, offs, want)
            gemv_cuda.launch_grouped(x, wc, g, offs, got, x_rows=rows)
        assert torch.equal(got, want)
    rows_buf, offs_buf = routing()
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch_grouped(x, wc, g, offs_buf, y, x_rows=rows_buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda.launch_grouped(x, wc, g, offs_buf, y, x_rows=rows_buf)
    for _ in range(3):
        rows, offs = routing()
        rows_buf.copy_(rows)
        offs_buf.copy_(offs)
        y.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(y)
        gemv_cuda.launch_grouped(x.index_select(0, rows), wc, g, offs, want)
        assert torch.equal(y, want)
    with pytest.raises(ValueError, match="W4A16"):
        gemv_cuda.launch_grouped(x, wc, g, offs, y, x_scale=torch.ones(t, device="cuda"), x_rows=rows)
    with pytest.raises(TypeError, match="int32"):
        gemv_cuda.launch_grouped(x, wc, g, offs, y, x_rows=rows.long())


def test_launch_grouped_silu_refusals():
    """x_silu (SiLU(gate) * up in the x staging): W4A16 only, not with x_rows, x must be gate | up [M, 2K].
    Checked before anything runs (no GPU needed)."""
    e, n, k = 2, 16, 128
    ws = [_weight(n, k, seed=40 + i) for i in range(e)]
    wc = gemv_cuda.relayout_stack(torch.stack([w.data for w in ws]), torch.stack([w.block_scale for w in ws]))
    g = torch.ones(e)
    offs = torch.tensor([0, 1, 2], dtype=torch.int32)
    gu = torch.zeros(2, 2 * k, dtype=torch.bfloat16)
    y = torch.empty(2, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="W4A16"):
        gemv_cuda.launch_grouped(gu, wc, g, offs, y, x_scale=torch.ones(2), x_silu=True)
    with pytest.raises(ValueError, match="x_rows"):
        gemv_cuda.launch_grouped(gu, wc, g, offs, y, x_rows=offs[:2].clone(), x_silu=True)
    with pytest.raises(ValueError, match=r"gate \| up \[M, 2K\] with K=128"):
        gemv_cuda.launch_grouped(gu[:, :k], wc, g, offs, y, x_silu=True)
    with pytest.raises(ValueError, match=r"gate \| up \[M, 2K\] with K=128"):
        gemv_cuda.launch_grouped(torch.zeros(2, 3 * k, dtype=torch.bfloat16), wc, g, offs, y, x_silu=True)


def _random_experts(e, n, k, seed):
    """Random stacked NVFP4 weights [E, N, K/2] on the GPU (random codes, E4M3 block scales in 1/16..4) and
    per-expert global scales: (data, block scales, global scales [E], the mma16 copy). The SILU tests compare
    kernel against kernel, so any codes do."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8).cuda()
    scale = (torch.rand(e, n, k // 16, generator=gen) * 4 + 0.0625).to(torch.float8_e4m3fn).cuda()
    g = (torch.rand(e, generator=gen) * 1e-2 + 1e-3).cuda()
    return data, scale, g, gemv_cuda.relayout_stack(data, scale)


def _gate_up(m, i, gen, pad=0, small_up=True):
    """gate | up [m, 2I] bf16 on the GPU (row stride 2I + pad): gate over ~4 decades either sign (silu's exp
    overflows below -88.7), set values in columns 0-9 (+-0, the exp overflow edges, +-1e4); up over 4 decades
    (small_up=False: |up| in [1, 100), so that no product silu(gate) * up is subnormal)."""
    def wide(shape):
        return torch.randn(shape, generator=gen) * 10.0 ** (torch.rand(shape, generator=gen) * 4 - 2)

    gate = wide((m, i))
    if small_up:
        up = wide((m, i))
    else:
        up = torch.randn(m, i, generator=gen).sign() * 10.0 ** (torch.rand(m, i, generator=gen) * 2)
        up[up == 0] = 1.0
    gate[:, :10] = torch.tensor([0.0, -0.0, 88.0, -88.0, 88.75, -88.75, 89.0, -89.0, 1e4, -1e4])
    buf = torch.zeros(m, 2 * i + pad, dtype=torch.bfloat16)
    buf[:, :i], buf[:, i:2 * i] = gate, up
    return buf.cuda()[:, :2 * i]


def _routing(e, t, top, gen, hot=None):
    """Offsets int32 [E + 1] of t tokens' top distinct experts (expert `hot` in every token's set)."""
    idx = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)])
    if hot is not None:
        for r in range(t):
            if hot not in idx[r]:
                idx[r, 0] = hot
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda()


def _identity_experts(e, k):
    """E identity weights [K, K] (e2m1 1.0 x block scale 256, global scale 1/256: every product a * 1 exact)
    as an mma16 stack, and their global scales [E]: the grouped kernel's y is its staged activation."""
    codes = torch.zeros(e, k, k, dtype=torch.uint8)
    codes[:, torch.arange(k), torch.arange(k)] = 2  # e2m1 code 2 = 1.0
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).cuda()
    scale = torch.full((e, k, k // 16), 0x78, dtype=torch.uint8).view(torch.float8_e4m3fn).cuda()  # 256
    return gemv_cuda.relayout_stack(data, scale), torch.full((e,), 1 / 256, device="cuda")


@pytest.mark.gpu
def test_gpu_silu_staging_on_every_bf16_gate_value():
    """The SILU staging's division (silu_div: div.rn's fast path made branch-free) is __fdiv_rn's result bit
    for bit on g / (1 + expf(-g)) for every bf16 g (the only inputs it gets: +-0, subnormals, +-inf, NaN
    too); and through the kernel (identity weights, up = 1) a = bf16(silu(g)) is fused.silu_mul's and
    torch's on every finite bf16 g whose silu is not subnormal."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    import torch.nn.functional as F

    from fp4rl.kernels import fused, pdl

    src = gemv_cuda._SOURCE.read_text()
    i0 = src.index("__device__ __forceinline__ float silu_div(")
    check = src[i0:src.index("\n}\n", i0) + 3] + r"""
extern "C" __global__ void silu_div_check(const unsigned short* gb, float* qf, float* qr, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = __uint_as_float((unsigned)gb[i] << 16);
    const float d = __fadd_rn(1.f, expf(-g));
    qf[i] = silu_div(g, d);
    qr[i] = __fdiv_rn(g, d);
}
"""
    kern = torch.cuda._compile_kernel(check, "silu_div_check", nvcc_options=["-std=c++17"])
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).cuda()  # every bf16 pattern
    qf = torch.empty(65536, dtype=torch.float32, device="cuda")
    qr = torch.empty_like(qf)
    pdl.launch(kern, (256, 1, 1), (256, 1, 1), [bits, qf, qr, 65536], 0, torch.cuda.current_stream(), False)
    nan = qr.isnan()
    assert torch.equal(qf.isnan(), nan)
    bad = (qf.view(torch.int32) != qr.view(torch.int32)) & ~nan
    g_all = bits.view(torch.bfloat16)
    first = bad.nonzero()[:8, 0].tolist()
    assert not bad.any(), [(g_all[i].item(), qf[i].item(), qr[i].item()) for i in first]

    # through the kernel: finite g with |g| >= 2^-124 (silu(g) ~ g / 2 not subnormal) or 0, up = 1
    g = g_all[g_all.float().isfinite() & ((g_all.float().abs() >= 2.0 ** -124) | (g_all == 0))]
    k = 768
    m = -(-g.numel() // k)
    gate = torch.zeros(m * k, dtype=torch.bfloat16, device="cuda")
    gate[:g.numel()] = g
    gu = torch.cat([gate.view(m, k), torch.ones(m, k, dtype=torch.bfloat16, device="cuda")], 1)
    wci, gi = _identity_experts(2, k)
    offs = torch.tensor([0, 0, m], dtype=torch.int32, device="cuda")  # expert 1: m rows, 11 chunks
    got = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch_grouped(gu, wci, gi, offs, got, x_silu=True)
    a = fused.silu_mul(gu)[0]
    plain = torch.empty_like(got)
    gemv_cuda.launch_grouped(a, wci, gi, offs, plain)
    assert torch.equal(plain, a)  # the identity weights return their input exactly
    bad = (got != a).reshape(-1)
    assert not bad.any(), [(gate[i].item(), got.reshape(-1)[i].item(), a.reshape(-1)[i].item())
                           for i in bad.nonzero()[:8, 0].tolist()]
    ref = F.silu(gate.view(m, k))  # torch's bf16(silu(g)); * up = 1 is exact
    bad = (got != ref).reshape(-1)
    assert not bad.any(), [(gate[i].item(), got.reshape(-1)[i].item(), ref.reshape(-1)[i].item())
                           for i in bad.nonzero()[:8, 0].tolist()]


@pytest.mark.gpu
def test_gpu_grouped_silu_equals_silu_mul_then_kernel(monkeypatch):
    """x_silu: the MoE down projection on gate | up, SiLU(gate) * up computed by the kernel's x staging, is
    bit for bit fused.silu_mul then the plain kernel: 128 experts of 2048x768 (Qwen3-30B-A3B's down_proj),
    top-8, 1 / 8 / 32 tokens (splits 2 and 1; most experts empty; one expert in every token: 4 chunks), a
    padded row stride, per-row global scales, gemm.gemm(silu=True) with FUSED_SILU on and off; a split-K case
    whose last split has a shorter K range (zero-filled past it); and identity weights, whose y is the staged
    activation itself: exactly silu_mul's (and torch's, F.silu(gate) * up)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    import torch.nn.functional as F

    from fp4rl.kernels import fused, gemm, pdl

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    e, top, i, h = 128, 8, 768, 2048
    data, scale, g, wc = _random_experts(e, h, i, seed=1)
    wm = SimpleNamespace(data=data, block_scale=scale, global_scale=g, mma16=wc)

    def both(gu, offs, gs, w=wc):
        n = w.n
        a = fused.silu_mul(gu)[0]
        want = torch.full((gu.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = torch.full_like(want, float("nan"))
        with pdl.step():
            gemv_cuda.launch_grouped(a, w, gs, offs, want)
            gemv_cuda.launch_grouped(gu, w, gs, offs, got, x_silu=True)
        return a, want, got

    calls = []  # fused.silu_mul launches (gemm.gemm calls it as gemm._fused.silu_mul)
    silu_mul = fused.silu_mul
    monkeypatch.setattr(gemm._fused, "silu_mul", lambda *a, **kw: calls.append(1) or silu_mul(*a, **kw))
    cases = [(1, None, 0), (8, None, 0), (32, None, 0), (32, 7, 0), (8, None, 40), (1, 3, 24), (2, None, 0)]
    for t, hot, pad in cases:
        offs = _routing(e, t, top, gen, hot)
        gu = _gate_up(t * top, i, gen, pad)
        assert gu.stride(0) == 2 * i + pad
        cfg = gemv_cuda.choose_grouped(h, i, min(e, t * top), sms)
        a, want, got = both(gu, offs, g)
        assert not want.isnan().any()
        assert torch.equal(got, want), (t, hot, pad, cfg, (got != want).sum().item())
        if t == 8 and pad == 0:  # per-row global scales [E, N]
            gr = (g[:, None] * torch.linspace(0.5, 2.0, h, device="cuda")).contiguous()
            _, want_r, got_r = both(gu, offs, gr)
            assert torch.equal(got_r, want_r), (t, "per-row")
        # through gemm.gemm: the fused kernel (FUSED_SILU, up to MMA16_SILU_MAX_TOKENS tokens; silu_mul not
        # called), and silu_mul + the plain kernel above that or without FUSED_SILU
        calls.clear()
        assert torch.equal(gemm.gemm(gu, wm, offsets=offs, tokens=t, silu=True), want), (t, hot, pad)
        assert (not calls) == (t <= gemm.MMA16_SILU_MAX_TOKENS), (t, calls)
        monkeypatch.setattr(gemm, "FUSED_SILU", False)
        assert torch.equal(gemm.gemm(gu, wm, offsets=offs, tokens=t, silu=True), want), (t, hot, pad, "off")
        assert calls, t
        monkeypatch.setattr(gemm, "FUSED_SILU", True)

    # split 2 over 5 steps of 128 k: the second split's 2 steps leave the rest of its x slice zero-filled
    e2, n2, k2 = 4, 256, 640
    assert gemv_cuda.choose_grouped(n2, k2, 4, sms)["SPLIT"] == 2
    _, _, g2, wc2 = _random_experts(e2, n2, k2, seed=2)
    for counts in ([1, 0, 2, 1], [0, 9, 0, 0], [3, 3, 3, 3]):
        offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device="cuda")
        gu = _gate_up(sum(counts), k2, gen)
        _, want, got = both(gu, offs, g2, wc2)
        assert torch.equal(got, want), counts

    # identity weights: y = the activation the kernel staged
    e3, k3 = 4, 768
    wci, gi = _identity_experts(e3, k3)
    for counts in ([1, 0, 0, 0], [2, 0, 5, 1], [8, 9, 0, 16]):
        offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device="cuda")
        gu = _gate_up(sum(counts), k3, gen, pad=8, small_up=False)  # no subnormal activation (MMA: exact)
        a, want, got = both(gu, offs, gi, wci)
        assert torch.equal(want, a)  # the identity reproduces its input ...
        assert torch.equal(got, a), (counts, (got != a).sum().item())  # ... and the fused staging silu_mul's
        if fused.USE_LIBDEVICE:  # silu_mul is torch's result on the GPU (test_fused_kernels.py), so is this
            ref = F.silu(gu[:, :k3]) * gu[:, k3:]
            assert torch.equal(got, ref), (counts, "torch", (got != ref).sum().item())


@pytest.mark.gpu
def test_gpu_grouped_silu_replays_in_a_cuda_graph():
    """The fused SiLU launch captured once in a CUDA graph, replayed with new gate | up values and new routing
    in its buffers: bit for bit silu_mul + the plain kernel run eagerly on the same inputs."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from fp4rl.kernels import fused, pdl

    gen = torch.Generator().manual_seed(5)
    e, top, i, h, t = 128, 8, 768, 2048, 8
    _, _, g, wc = _random_experts(e, h, i, seed=3)
    m = t * top
    gu_buf = _gate_up(m, i, gen)
    offs_buf = _routing(e, t, top, gen)
    y = torch.empty(m, h, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch_grouped(gu_buf, wc, g, offs_buf, y, x_silu=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda.launch_grouped(gu_buf, wc, g, offs_buf, y, x_silu=True)
    for hot in (None, 11, None):
        gu_buf.copy_(_gate_up(m, i, gen))
        offs_buf.copy_(_routing(e, t, top, gen, hot))
        y.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(y)
        gemv_cuda.launch_grouped(fused.silu_mul(gu_buf)[0], wc, g, offs_buf, want)
        assert not want.isnan().any()
        assert torch.equal(y, want), hot
