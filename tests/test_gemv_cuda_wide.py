"""The CUDA mma16 kernel's wgmma configuration (gemv_cuda.choose_wide, launch_wide; sm_90a): how it covers
rows and where gemm.gemm sends them, on any device; on a Hopper GPU (-m gpu) against the float64 reference
(bf16 and W4A4 x, per-tensor and per-row scales, strided x) and its x staging / A-in-shared-memory variants
bit for bit. The mma.sync configurations: tests/test_gemv_cuda.py."""

import os
import subprocess
import sys

import pytest
import torch
from test_gemv_cuda import _gpu_case, _rel

from fp4rl.kernels import gemv_cuda, tensor_map


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1008, 1280), (4096, 4096)])
def test_gpu_wide_x_staging_forms_give_the_same_bits(n, k):
    """The wgmma configuration's x staging in its three forms: addresses computed in every step (XPRE 0), per
    thread and chunk once (XPRE 1, the default at MG <= 4), one running pointer per thread with rows past M
    reading row M - 1 instead of zeros (XPRE 2, the default above): the same bits at 17-300 rows (partial row
    groups, several row blocks, MG 3-16), every split, with W4A4's per-row x scales."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 300, seed=13)
    xs = torch.rand(300, device="cuda") + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (17, 32, 45, 64, 100, 128, 300):
        plan = gemv_cuda.choose_wide(n, k, m, sms)
        for split in sorted({1, plan["SPLIT"], 4}):
            if (k // 128) < split:
                continue
            for x_scale in (None, xs[:m]):
                out = []
                for xpre in (0, 1, 2):
                    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    cfg = dict(plan, SPLIT=split, XPRE=xpre)
                    gemv_cuda.launch(base[:m], wc, g, y, cfg=cfg, x_scale=x_scale)
                    assert not y.isnan().any(), (m, split, xpre)
                    out.append(y)
                if x_scale is None:
                    assert _rel(out[0], base[:m].double() @ wd.T) < 4e-3
                assert torch.equal(out[0], out[1]), (m, split, x_scale is None)
                assert torch.equal(out[0], out[2]), (m, split, x_scale is None)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1008, 1280), (4096, 4096), (768, 14336)])
def test_gpu_wide_a_in_shared_memory_gives_the_same_bits(n, k):
    """ASH (the weights' A operand unpacked into shared memory by stmatrix, 8 shared-memory wgmma per step)
    against the register-A build: the same products summed in the same order, so the same bits, at 17-300
    rows, depths 3-4, every split, with W4A4's per-row x scales; N not a multiple of the CTA's 128 rows."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 300, seed=17)
    xs = torch.rand(300, device="cuda") + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (17, 64, 100, 128, 300):
        plan = dict(gemv_cuda.choose_wide(n, k, m, sms), NT=1, XPRE=2)
        plan.pop("WARPS", None)  # (ASH is for the 8-warp build)
        for split in sorted({1, plan["SPLIT"]}):
            for x_scale in (None, xs[:m]):
                ref = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                gemv_cuda.launch(base[:m], wc, g, ref, cfg=dict(plan, SPLIT=split), x_scale=x_scale)
                for depth in (3, 4):
                    cfg = dict(plan, SPLIT=split, ASH=1, DEPTH=depth)
                    if gemv_cuda.smem_bytes(cfg, k, m) > gemv_cuda.SMEM_MAX:
                        continue
                    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    gemv_cuda.launch(base[:m], wc, g, y, cfg=cfg, x_scale=x_scale)
                    if x_scale is None:
                        assert _rel(y, base[:m].double() @ wd.T) < 4e-3, (m, split, depth)
                    assert torch.equal(y, ref), (m, split, depth, x_scale is None)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1008, 1280), (4096, 4096), (768, 14336)])
def test_gpu_wide_warp_specialized_gives_the_same_bits(n, k):
    """WS (FP4RL_WIDE_WS: a producer warp copies each step with the bulk / tensor copy engine into a ring of
    mbarrier-guarded stages) against the plain wgmma build: the same multiplies in the same order, so the same
    bits, at 17-300 rows (x's rows past M zero-filled by the tensor map, several row blocks), depths 2-6,
    every split, W4A4's per-row x scales and per-row global scales, N not a multiple of the CTA's 128 rows, a
    strided x; and chained in a CUDA graph with programmatic dependent launch."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    from fp4rl.kernels import pdl

    w, wc, wd, g, base = _gpu_case(n, k, {}, 300, seed=19)
    xs = torch.rand(300, device="cuda") + 0.5
    gr = g.reshape(-1).expand(n) * torch.linspace(0.5, 2.0, n, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def both(x, cfg, depth, gs=g, x_scale=None):
        ref = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(x, wc, gs, ref, cfg=cfg, x_scale=x_scale)
        y = torch.full_like(ref, float("nan"))
        gemv_cuda.launch(x, wc, gs, y, cfg=dict(cfg, WS=1, DEPTH=depth), x_scale=x_scale)
        return ref, y

    def choose(m):  # the rule's configuration in its 8-warp form (WS is for that build)
        plan = gemv_cuda.choose_wide(n, k, m, sms)
        plan.pop("WARPS", None)
        return plan

    for m, depths in ((17, (2, 4)), (32, (4, 6)), (100, (3,)), (300, (2,))):
        plan = choose(m)
        if plan["NT"] * plan["MG"] > gemv_cuda.WS_MAX_ACC:
            plan = dict(plan, NT=1)
        for split in sorted({1, plan["SPLIT"], 4}):
            if (k // 128) < split:
                continue
            for depth in depths:
                ref, y = both(base[:m], dict(plan, SPLIT=split), depth)
                assert _rel(y, base[:m].double() @ wd.T) < 4e-3, (m, split, depth)
                assert torch.equal(y, ref), (m, split, depth)
        for gs, x_scale in ((g, xs[:m]), (gr, None)):  # W4A4's per-row x scales; per-row global scales
            assert torch.equal(*both(base[:m], plan, depths[0], gs, x_scale)), (m, x_scale is None)
    xp = torch.zeros(40, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]  # a strided x
    xp.copy_(base[:40])
    assert torch.equal(*both(xp, choose(40), 4))
    if n == k:  # two chained launches in a CUDA graph, each starting before the previous one ends (PDL)
        x = base[:32].clone()
        plan = choose(32)
        y1, y2 = (torch.empty(32, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        r1, r2 = torch.empty_like(y1), torch.empty_like(y2)
        gemv_cuda.launch(x, wc, g, r1, cfg=plan)
        gemv_cuda.launch(r1, wc, g, r2, cfg=plan)
        cfg = dict(plan, WS=1, DEPTH=4)
        off = pdl.kinds_off()
        pdl.set_kinds_off(())  # ("wide" launches go without PDL by default)
        try:
            with pdl.step():
                gemv_cuda.launch(x, wc, g, y1, cfg=cfg)  # compiled, its tensor maps made, outside the capture
                gemv_cuda.launch(y1, wc, g, y2, cfg=cfg)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    gemv_cuda.launch(x, wc, g, y1, cfg=cfg)
                    gemv_cuda.launch(y1, wc, g, y2, cfg=cfg)
        finally:
            pdl.set_kinds_off(off)
        y1.zero_(), y2.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y1, r1) and torch.equal(y2, r2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1008, 1280), (4096, 4096), (768, 14336)])
def test_gpu_wide_one_warpgroup_a_ctas_gives_the_same_bits(n, k):
    """WARPS 4 (one warpgroup a CTA: 64 weight rows, twice the CTAs) against the 8-warp build: each m64 tile's
    steps multiplied and its split's partials reduced in the same order, so the same bits, at 17-300 rows
    (MG 3-16: 1008 x 1280 at 128 rows; several row blocks), XPRE 0-2, depths 2-3, every split, W4A4's per-row
    x scales and per-row global scales, N not a multiple of 64 rows, a strided x; and the rule's launch."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 300, seed=23)
    xs = torch.rand(300, device="cuda") + 0.5
    gr = g.reshape(-1).expand(n) * torch.linspace(0.5, 2.0, n, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def both(x, cfg, gs=g, x_scale=None):
        cfg = {key: v for key, v in cfg.items() if key != "WARPS"}
        ref = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(x, wc, gs, ref, cfg=cfg, x_scale=x_scale)
        y = torch.full_like(ref, float("nan"))
        gemv_cuda.launch(x, wc, gs, y, cfg=dict(cfg, WARPS=4), x_scale=x_scale)
        return ref, y

    for m in (17, 32, 45, 64, 100, 128, 300):
        plan = dict(gemv_cuda.choose_wide(n, k, m, sms), NT=1)
        for split in sorted({1, plan["SPLIT"], 4, 8}):
            if (k // 128) < split:
                continue
            for extra in ({}, {"XPRE": 0}, {"XPRE": 2}, {"DEPTH": 3}):
                ref, y = both(base[:m], dict(plan, SPLIT=split, **extra))
                assert _rel(y, base[:m].double() @ wd.T) < 4e-3, (m, split, extra)
                assert torch.equal(y, ref), (m, split, extra)
        for gs, x_scale in ((g, xs[:m]), (gr, None)):  # W4A4's per-row x scales; per-row global scales
            assert torch.equal(*both(base[:m], plan, gs, x_scale)), (m, x_scale is None)
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch_wide(base[:m], wc, g, y)  # the rule (WARPS 4 where it takes it)
        assert torch.equal(y, both(base[:m], plan)[0]), m
    xp = torch.zeros(40, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]  # a strided x
    xp.copy_(base[:40])
    assert torch.equal(*both(xp, dict(gemv_cuda.choose_wide(n, k, 40, sms), NT=1)))


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

    from fp4rl.kernels import gemm, gemm_tune

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
        elif gemm.wide_candidate(m, n):  # the tuner's first candidate: taken untimed with tune=False
            gemm_tune._TUNED.clear()  # (a tuned pick of an earlier test would stand for this key)
            assert torch.equal(gemm.gemm(x, wm, tune=False), y)
        for split in (1, 2, 4, 8) if m in (33, 129) else ():
            for nt, swz in ((1, 0), (2, 0), (1, 1), (2, 1)):  # x stages without / with the 128 B swizzle
                if (k // 128) >= split:
                    cfg = dict(gemv_cuda.choose_wide(n, k, m, sms), SPLIT=split, NT=nt, SWZ=swz)
                    y2.fill_(float("nan"))
                    gemv_cuda.launch(x, wc, g, y2, cfg=cfg)
                    assert _rel(y2, ref) < 4e-3, (m, split, nt, swz)
    # within a band of rows (17-32, 33-64, 65-128, 129+) a row's result does not depend on the other rows
    for band in ((17, 24, 32), (33, 50, 64), (65, 100, 128), (129, 200, 300)):
        ys = []
        for m in band:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ys.append(gemv_cuda.launch_wide(base[:m], wc, g, y)[:band[0]])
        assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), band
    # nor on the rows per block (65-128 rows: one block or two, see choose_wide), nor on the m64 tiles per
    # warpgroup (NT, chosen by how full the GPU is)
    for m, name, values in ((128, "MG", (8, 16)), (300, "NT", (1, 2))):
        plan = gemv_cuda.choose_wide(n, k, m, sms)
        ys = []
        for v in values:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ys.append(gemv_cuda.launch(base[:m], wc, g, y, cfg={**plan, name: v}))
        assert torch.equal(ys[0], ys[1]), name
    # W4A4: x = e2m1 * block_scale with per-row global scales over 4 decades (through gemm.gemm at 48 rows,
    # directly at 150: two row blocks; gemm.gemm's WIDE candidate where wide_rows does not take the rows)
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
        if gemm.wide_candidate(m, n):
            assert torch.equal(gemm.gemm(None, wm, xq=xq, config=gemm_tune.WIDE), y), m
    # per-output-row global scales (the fused q/k/v and gate/up groups) through the WIDE candidate: the
    # direct launch's bits
    lin = torch.linspace(0.5, 2.0, n, device="cuda")
    gr = g.reshape(-1).expand(n) * lin  # the weight's own scale(s) times a spread per output row
    wr = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=gr, mma16=wc)
    for m in (100, 150):
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch_wide(base[:m], wc, gr, y)
        assert torch.equal(gemm.gemm(base[:m], wr, config=gemm_tune.WIDE), y), m
        assert _rel(y, (base[:m].double() @ wd.T) * lin.double()) < 4e-3, m
    # a strided x (padded rows) is read through its stride
    xs = torch.zeros(40, k + 64, dtype=torch.bfloat16, device="cuda")[:, :k]
    xs.copy_(base[:40])
    y = torch.empty(40, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda.launch_wide(xs, wc, g, y)
    assert _rel(y, base[:40].double() @ wd.T) < 4e-3


def test_wgmma_source_has_one_operand_per_accumulator():
    for mg in (1, 2, 3, 4, 13, 16):
        src = gemv_cuda._wgmma_source(mg)
        assert f"m64n{8 * mg}k16.f32.bf16.bf16" in src
        # n / 2 fp32 accumulators per thread, in the register-A form and the shared-memory-A form (ASH)
        assert src.count('"+f"(d[') == 2 * 4 * mg
        assert f"%{4 * mg + 4}, p, 1, 1, 0;" in src  # the descriptor follows the 4 A registers
        assert f"%{4 * mg}, %{4 * mg + 1}, p, 1, 1, 0, 0;" in src  # ASH: A's descriptor, then B's
    cfg = dict(NT=1, MG=4, SPLIT=2, DEPTH=2)
    assert "void wgmma_m64k16(" in gemv_cuda.source(dict(cfg, XSTREAM=1, WGMMA=1), False)
    assert "void wgmma_m64k16(" not in gemv_cuda.source(cfg, False)


def test_choose_wide_covers_every_row_in_blocks_of_at_most_128():
    for n, k in ((4096, 14336), (14336, 4096), (6144, 4096), (144, 384), (2048, 768)):
        for m in (1, 17, 24, 33, 64, 100, 128, 129, 300, 512, 1000, 4096):
            cfg = gemv_cuda.choose_wide(n, k, m, 132)
            zb = -(-m // (8 * cfg["MG"]))
            assert cfg["WGMMA"] == 1 and cfg["XSTREAM"] == 1 and cfg["SWZ"] == 1 and cfg["MG"] <= 16
            # as few row blocks as 128-row blocks allow (at 65-128 rows two, split 2, where one would be
            # split 4 or 8 ways) ...
            two = 64 < m <= 128 and k // 128 >= 4 and cfg["SPLIT"] == 2 and zb == 2
            assert zb == -(-m // 128) or two, (n, k, m, cfg)
            assert 8 * cfg["MG"] * zb - m < 8 * zb  # ... with the rows spread evenly (< 8 padding rows each)
            # several row blocks: 256 weight rows share x chunks (NT 2) where 3/4 of the SMs still get a CTA
            assert cfg["NT"] == (2 if zb > 1 and -(-n // 256) * zb * 4 >= 3 * 132 else 1)
            assert gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_MAX
            assert cfg["SPLIT"] in (1, 2, 4, 8) and (cfg["SPLIT"] == 1 or (k // 128) // cfg["SPLIT"] >= 2)
    # the splits the H200 sweep found best (bench/RESULTS.md, sixth session)
    for n, k, m, split in ((4096, 14336, 32, 8), (14336, 4096, 64, 2), (24576, 4096, 32, 2),
                           (6144, 4096, 64, 4), (14336, 4096, 512, 1)):
        assert gemv_cuda.choose_wide(n, k, m, 132)["SPLIT"] == split, (n, k, m)
    # 65-128 rows: two row blocks with split 2 where one block would take split 4-8 (twentieth session)
    for n, k, m, mg, split in ((4096, 6144, 128, 8, 2), (4096, 14336, 100, 7, 2), (4096, 4096, 65, 5, 2),
                               (6144, 4096, 128, 8, 2), (14336, 4096, 128, 16, 2), (4096, 14336, 64, 8, 8)):
        cfg = gemv_cuda.choose_wide(n, k, m, 132)
        assert (cfg["MG"], cfg["SPLIT"]) == (mg, split), (n, k, m, cfg)
    # NT as the nineteenth session's 256-512-row sweep found best
    for n, k, m, nt in ((14336, 4096, 256, 2), (24576, 4096, 512, 2), (4096, 14336, 256, 1),
                        (6144, 4096, 512, 1), (4096, 4096, 512, 1)):
        assert gemv_cuda.choose_wide(n, k, m, 132)["NT"] == nt, (n, k, m)
    with pytest.raises(ValueError, match="at least one row"):
        gemv_cuda.choose_wide(4096, 4096, 0, 132)


def test_wide_rows_dispatch_ranges():
    from fp4rl.kernels import gemm

    assert not gemm.wide_rows(16, 14336)  # mma.sync up to 16 rows
    assert gemm.wide_rows(17, 4096) and gemm.wide_rows(32, 4096)  # wgmma at 17-32 rows on any weight
    assert not gemm.wide_rows(48, 4096) and gemm.wide_rows(48, 14336)  # 33-64 rows on wide weights only
    assert not gemm.wide_rows(65, 14336) and not gemm.wide_rows(512, 14336)  # the tuner's candidates
    # the tuner's first candidate: the rows up to 512 that wide_rows does not take
    assert gemm.wide_candidate(48, 4096) and gemm.wide_candidate(65, 14336) and gemm.wide_candidate(512, 4096)
    assert not any(gemm.wide_candidate(m, 14336) for m in (1, 16, 17, 32, 48, 64, 513))


def test_choose_wide_split_depends_on_the_band_of_rows_only():
    for n, k in ((14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)):
        for band in (range(1, 33), range(33, 65), range(65, 129), range(129, 1025)):
            assert len({gemv_cuda.choose_wide(n, k, m, 132)["SPLIT"] for m in band}) == 1, (n, k, band)


@pytest.fixture(autouse=True)
def _the_rules_tiles(monkeypatch):
    # the rule's NT and build whatever FP4RL_WIDE_NT / FP4RL_WIDE_WS the shell running the tests has set
    monkeypatch.setattr(gemv_cuda, "WIDE_NT", 0)
    monkeypatch.setattr(gemv_cuda, "WIDE_WS", 0)
    monkeypatch.setattr(gemv_cuda, "WIDE_WARPS", 0)
    monkeypatch.setattr(gemv_cuda, "NARROW_FROM", gemv_cuda.NARROW_FROM_DEFAULT)


def test_wide_ws_switch_takes_the_warp_specialized_build_where_it_fits(monkeypatch):
    # FP4RL_WIDE_WS (A/B): the rule's configuration with WS 1 at the switch's ring depth, except where its
    # accumulators (NT x MG) would spill at 288 threads; the other keys stay the rule's
    cases = [(n, k, m) for n, k in ((6144, 4096), (4096, 12288), (24576, 4096), (14336, 4096))
             for m in (17, 24, 32, 64, 128, 300, 512)]
    rule = {c: gemv_cuda.choose_wide(*c, 132) for c in cases}
    assert not any("WS" in cfg for cfg in rule.values())
    for depth in (2, 4, 6):
        monkeypatch.setattr(gemv_cuda, "WIDE_WS", depth)
        taken = 0
        for c in cases:
            cfg = gemv_cuda.choose_wide(*c, 132)
            if rule[c]["NT"] * rule[c]["MG"] <= gemv_cuda.WS_MAX_ACC:
                eight = {key: v for key, v in rule[c].items() if key != "WARPS"}  # (WS: the 8-warp build)
                assert cfg == dict(eight, WS=1, DEPTH=cfg["DEPTH"]), c
                # the switch's depth, or the deepest ring that fits one CTA's shared memory
                assert cfg["DEPTH"] == depth or (
                    2 <= cfg["DEPTH"] < depth
                    and gemv_cuda.smem_bytes(dict(cfg, DEPTH=cfg["DEPTH"] + 1), c[1], c[2])
                    > gemv_cuda.SMEM_MAX)
                taken += 1
            else:
                assert cfg == rule[c], c
            assert gemv_cuda.smem_bytes(cfg, c[1], c[2]) <= gemv_cuda.SMEM_MAX
        assert taken >= len(cases) // 2  # (17-128 rows everywhere)
    for raw, want in (("", 0), ("0", 0), (" 4 ", 4), ("2", 2), ("8", 8)):
        monkeypatch.setenv("FP4RL_WIDE_WS", raw)
        assert gemv_cuda._wide_ws_from_env() == want
    for bad in ("1", "9", "four", "-2"):
        monkeypatch.setenv("FP4RL_WIDE_WS", bad)
        with pytest.raises(ValueError, match="FP4RL_WIDE_WS"):
            gemv_cuda._wide_ws_from_env()


def test_x_tensor_map_refuses_what_a_tensor_map_cannot_describe():
    # checked before any driver call: x's rows must be 16-byte aligned, apart, with unit column stride; a box
    # of at most 256 rows
    x = torch.zeros(8, 264, dtype=torch.bfloat16)
    odd = torch.zeros(8, 260, dtype=torch.bfloat16)[:, :256]  # rows 520 B apart
    rows0 = torch.zeros(1, 256, dtype=torch.bfloat16).expand(8, 256)  # every row the same memory
    for bad, rows in ((x[:, :260:2], 8), (x[:, 4:260], 8), (odd, 8), (x[:, :256], 257), (rows0, 8)):
        with pytest.raises(ValueError, match="tensor map"):
            tensor_map.x_tensor_map(bad, rows)


def test_wide_nt_switch_forces_the_tiles_and_keeps_the_split(monkeypatch):
    # FP4RL_WIDE_NT (A/B of NT 2 at 17-32 rows): the m64 tiles a warpgroup forced, the other keys the rule's
    cases = [(n, k, m) for n, k in ((6144, 4096), (4096, 12288), (24576, 4096), (14336, 4096), (4096, 14336))
             for m in (17, 24, 32, 64, 256)]
    rule = {c: gemv_cuda.choose_wide(*c, 132) for c in cases}
    assert {cfg["NT"] for c, cfg in rule.items() if c[2] <= 32} == {1}  # the rule: NT 1 for one row block
    for forced in (1, 2):
        monkeypatch.setattr(gemv_cuda, "WIDE_NT", forced)
        for c in cases:
            cfg = gemv_cuda.choose_wide(*c, 132)
            # (NT 2: the 8-warp build, WARPS 4 is taken with NT 1 only)
            want = {key: v for key, v in rule[c].items() if key != "WARPS" or forced == 1}
            assert cfg == dict(want, NT=forced), c
            assert gemv_cuda.smem_bytes(cfg, c[1], c[2]) <= gemv_cuda.SMEM_MAX
    for raw, want in (("", 0), ("0", 0), (" 2 ", 2), ("1", 1)):
        monkeypatch.setenv("FP4RL_WIDE_NT", raw)
        assert gemv_cuda._wide_nt_from_env() == want
    for bad in ("3", "two", "-1"):
        monkeypatch.setenv("FP4RL_WIDE_NT", bad)
        with pytest.raises(ValueError, match="FP4RL_WIDE_NT"):
            gemv_cuda._wide_nt_from_env()
    # the variable reaches the module in a fresh process (how the device scripts set it)
    code = ("from fp4rl.kernels import gemv_cuda as g; "
            "print(g.WIDE_NT, g.choose_wide(4096, 4096, 32, 132)['NT'])")
    for raw, want in (("2", "2 2"), ("0", "0 1")):
        env = {**os.environ, "FP4RL_WIDE_NT": raw}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True)
        assert out.stdout.split() == want.split(), out


def test_wide_warps_rule_and_switch(monkeypatch):
    # choose_wide's WARPS 4 (one warpgroup a CTA) where the 8-warp grid of one row block is at most 2.5 CTAs
    # a SM (17-32 rows) / two on few n-blocks (33-64); the 8-warp build elsewhere (no key: the key as it was)
    want4 = {(4096, 4096, 17), (4096, 4096, 32), (4096, 4096, 64), (4096, 12288, 32), (4096, 14336, 64),
             (6144, 4096, 32), (14336, 4096, 24), (5120, 2048, 32), (5120, 2048, 64), (2048, 4096, 64),
             (19456, 2560, 32), (19456, 2560, 17), (5120, 17408, 32)}
    want8 = {(24576, 4096, 32), (12288, 4096, 17), (24576, 4096, 33), (6144, 4096, 33), (6144, 4096, 64),
             (14336, 4096, 48), (4096, 4096, 65), (7168, 5120, 48), (5120, 12288, 64), (19456, 2560, 64),
             (4096, 4096, 300), (151936, 4096, 32), (1008, 1280, 100), (1008, 1280, 128), (4096, 1024, 128)}
    for c in want4 | want8:
        cfg = gemv_cuda.choose_wide(*c, 132)
        assert cfg.get("WARPS", 8) == (4 if c in want4 else 8), (c, cfg)
        assert cfg.get("WARPS") in (None, 4)  # (8 is never written into the key)
        if c in want4:  # the same split and tiles as the 8-warp build: the same bits
            monkeypatch.setattr(gemv_cuda, "WIDE_WARPS", 8)
            assert gemv_cuda.choose_wide(*c, 132) == {key: v for key, v in cfg.items() if key != "WARPS"}
            monkeypatch.setattr(gemv_cuda, "WIDE_WARPS", 0)
        assert gemv_cuda.block_rows(cfg) == 16 * cfg.get("WARPS", 8) * cfg["NT"]
        assert gemv_cuda.smem_bytes(cfg, c[1], c[2]) <= gemv_cuda.SMEM_MAX
    monkeypatch.setattr(gemv_cuda, "WIDE_WARPS", 4)  # forced: every NT 1 configuration, any rows
    for c in want8:
        cfg = gemv_cuda.choose_wide(*c, 132)
        assert cfg.get("WARPS") == (4 if cfg["NT"] == 1 else None), (c, cfg)
    monkeypatch.setattr(gemv_cuda, "WIDE_WS", 4)  # the warp-specialized build has 8 warps
    assert "WARPS" not in gemv_cuda.choose_wide(4096, 4096, 32, 132)
    for raw, want in (("", 0), ("0", 0), (" 4 ", 4), ("8", 8)):
        monkeypatch.setenv("FP4RL_WIDE_WARPS", raw)
        assert gemv_cuda._wide_warps_from_env() == want
    for bad in ("2", "16", "four"):
        monkeypatch.setenv("FP4RL_WIDE_WARPS", bad)
        with pytest.raises(ValueError, match="FP4RL_WIDE_WARPS"):
            gemv_cuda._wide_warps_from_env()



def test_choose_narrow_keeps_the_one_row_split(monkeypatch):
    """choose_narrow: the mma.sync build below NARROW_FROM rows, the wgmma build (WARPS 4) from there to 16
    rows with the split of K the one-row launch has (so the same sums), never at one row or past 16."""
    for n, k in ((4096, 14336), (14336, 4096), (6144, 4096), (24576, 4096), (4096, 4096), (2048, 768),
                 (16, 128), (5120, 2048), (1008, 1280)):
        one = gemv_cuda.ksplit(gemv_cuda.choose(n, k, 1, 132))
        for start in (0, 2, 9, 16):
            monkeypatch.setattr(gemv_cuda, "NARROW_FROM", start)
            for m in range(1, 17):
                cfg = gemv_cuda.choose_narrow(n, k, m, 132)
                assert gemv_cuda.ksplit(cfg) == one, (n, k, m, cfg)
                steps = -(-(k // 128) // one)
                if start and m >= max(2, start) and not (m <= 8 and 4 < steps < 12):
                    depth = 3 if m <= 8 and steps >= 12 else 2  # (a 3-deep ring: long slices, one row group)
                    assert cfg == dict(NT=1, MG=1 if m <= 8 else 2, SPLIT=one, DEPTH=depth, XSTREAM=1,
                                       WGMMA=1, SWZ=1, WARPS=4), (n, k, m)
                    assert gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_LIMIT
                else:
                    assert cfg == gemv_cuda.choose(n, k, m, 132)
    # the rule on Qwen3-8B's shapes at 2-8 rows (H100 sweep): 4096x4096 (4 steps a CTA) depth 2, 6144x4096 (8)
    # mma.sync, 24576x4096 / 4096x12288 (16 / 12) depth 3; at 9-16 rows depth 2 on all four
    monkeypatch.setattr(gemv_cuda, "NARROW_FROM", 2)
    shapes = ((4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288))
    got = {c: gemv_cuda.choose_narrow(*c, 8, 132) for c in shapes}
    got = {c: cfg["DEPTH"] if cfg.get("WGMMA") else None for c, cfg in got.items()}
    assert got == {(4096, 4096): 2, (6144, 4096): None, (24576, 4096): 3, (4096, 12288): 3}
    assert all(gemv_cuda.choose_narrow(n, 4096, 16, 132)["DEPTH"] == 2 for n in (4096, 6144, 24576))
    with pytest.raises(ValueError, match="1-64 rows"):
        gemv_cuda.choose_narrow(4096, 4096, 65, 132)
    for raw, want in (("", gemv_cuda.NARROW_FROM_DEFAULT), ("0", 0), (" 2 ", 2), ("16", 16)):
        monkeypatch.setenv("FP4RL_NARROW_WGMMA", raw)
        assert gemv_cuda._narrow_from_env() == want
    for bad in ("1", "17", "on"):
        monkeypatch.setenv("FP4RL_NARROW_WGMMA", bad)
        with pytest.raises(ValueError, match="FP4RL_NARROW_WGMMA"):
            gemv_cuda._narrow_from_env()


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(144, 640), (1008, 1280), (4096, 4096), (768, 14336), (6144, 4096)])
def test_gpu_narrow_wgmma_rows_keep_their_bits_from_2_to_16(n, k, monkeypatch):
    """2-16 rows on the wgmma build (choose_narrow from 2 rows): within bf16 GEMM error of the reference
    (per-tensor and per-row global scales, W4A4's per-row x scales), each row's bits the same at every row
    count 2-16 (1-2 row groups: n8 / n16 multiplies), and within rounding of the mma.sync build at the same
    split (the two instructions' adders round differently: a few elements in 10^4 differ, H100)."""
    if not gemv_cuda.wide_available():
        pytest.skip("needs an sm_90 GPU (wgmma) and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 16, seed=17)
    gr = (g * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
    xs = torch.rand(16, device="cuda") + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setattr(gemv_cuda, "NARROW_FROM", 2)
    gemv_cuda._plan.cache_clear()
    try:
        for gs, x_scale in ((g, None), (gr, None), (g, xs)):
            scale = (gs / g).double()[None, :] * (1 if x_scale is None else x_scale[:, None].double())
            ref = (base.double() @ wd.T) * scale
            full = None
            for m in (16, 2, 3, 8, 9, 12):
                xsm = None if x_scale is None else x_scale[:m]
                wide, sync = (torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                              for _ in range(2))
                plan = gemv_cuda._plan(n, k, m, 0)
                assert plan == gemv_cuda.choose_narrow(n, k, m, sms)
                gemv_cuda.launch(base[:m], wc, gs, sync, cfg=gemv_cuda.choose(n, k, m, sms), x_scale=xsm)
                for depth in (2, 3):  # (the rule's mma.sync rows too: the wgmma build at both ring depths)
                    cfg = dict(NT=1, MG=plan["MG"], SPLIT=gemv_cuda.ksplit(plan), DEPTH=depth, XSTREAM=1,
                               WGMMA=1, SWZ=1, WARPS=4)
                    wide.fill_(float("nan"))
                    gemv_cuda.launch(base[:m], wc, gs, wide, cfg=cfg, x_scale=xsm)
                    assert not wide.isnan().any() and _rel(wide, ref[:m]) < 4e-3, (m, gs.numel())
                    full = wide.clone() if full is None else full
                    assert torch.equal(wide, full[:m]), (m, depth, gs.numel(), x_scale is None)
                    # (rounding flips: a few elements in 10^4 one bf16 ulp apart on the H100; a broken build
                    # is off by ~1 relative)
                    assert int((wide != sync).sum()) <= max(3, wide.numel() // 100), (m, gs.numel())
                    assert _rel(wide, sync.double()) < 1e-3, (m, gs.numel())
                if plan.get("WGMMA"):  # the default launch takes the rule's wgmma build: the same bits
                    again = torch.full_like(wide, float("nan"))
                    assert torch.equal(gemv_cuda.launch(base[:m], wc, gs, again, x_scale=xsm), wide)
    finally:
        gemv_cuda._plan.cache_clear()
