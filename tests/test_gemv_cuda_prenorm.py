"""The PRENORM builds of the mma16 W4A16 kernel (fp4rl.kernels.gemv_cuda_prenorm): the decode step's
residual add + RMSNorm (PRENORM 1) or the previous MoE layer's combine + RMSNorm (PRENORM 2) inside the GEMM's
x staging.

On CPU: the plans (the whole K staged with the plain plan's K split, shared memory, row limits, the in-CTA
split switch) and the operand checks. On the GPU (-m gpu): each build against prenorm.reference and the plain
launch bit for bit at every row count it plans."""

import pytest
import torch

from fp4rl.kernels import gemv_cuda
from fp4rl.kernels.gemv_cuda_prenorm import PN_STATE, launch_prenorm, prenorm_plan, prenorm_static_bytes
from tests.test_gemv_cuda import _gpu_case, _weight

PRENORM_SHAPES = [(6144, 4096), (24576, 4096), (4096, 4096), (5120, 2048), (8192, 2048)]


@pytest.mark.parametrize("n,k", PRENORM_SHAPES)
def test_prenorm_plan_stages_x_whole_with_the_launchs_split(n, k):
    """prenorm_plan: 1-8 rows of Qwen3-8B / 30B-A3B's q/k/v and gate/up shapes get a build that stages the
    whole K (SPLIT 1), K split as launch's plan splits it (ksplit equal: the GEMM's bits for the same y), the
    residual's and hr's rows and the norm weight counted in shared memory, two CTAs per SM; none past 8 rows,
    for shapes the kernel does not take, or with the in-CTA split turned off where the plan needs it."""
    for m in range(1, 9):
        cfg = prenorm_plan(n, k, m, 132)
        base = gemv_cuda.choose(n, k, m, 132)
        if cfg is None:  # only where the whole K of m + 1 rows, hr's and the weight leave no room
            assert m >= 4 and gemv_cuda.smem_bytes(dict(base, SPLIT=1, KW=base["SPLIT"], PRENORM=1), k, m) \
                > gemv_cuda.SMEM_LIMIT, (n, k, m)
            continue
        assert cfg["SPLIT"] == 1 and cfg["PRENORM"] == 1 and not cfg.get("XSTREAM")
        assert gemv_cuda.ksplit(cfg) == gemv_cuda.ksplit(base) and cfg["MG"] == base["MG"], (cfg, base)
        plain = {key: v for key, v in cfg.items() if key != "PRENORM"}
        xrows = m + 1
        ring = gemv_cuda.WARPS * cfg["DEPTH"] * cfg["NT"] * gemv_cuda.STAGE_BYTES
        assert gemv_cuda.smem_bytes(cfg, k, m) - ring == \
            -(-(xrows * (k + 8) * 2 + m * (k + 8) * 2 + 2 * k) // 128) * 128
        assert gemv_cuda.smem_bytes(cfg, k, m) > gemv_cuda.smem_bytes(plain, k, m)
        assert gemv_cuda.smem_bytes(cfg, k, m) <= gemv_cuda.SMEM_LIMIT
    assert prenorm_plan(n, k, 1, 132) is not None  # one row always
    assert prenorm_plan(n, k, 9, 132) is None and prenorm_plan(n, k, 0, 132) is None
    assert prenorm_plan(n + 8, k, 1, 132) is None
    assert prenorm_plan(n, k + 64, 1, 132) is None


def test_prenorm_plan_follows_the_in_cta_split_switch(monkeypatch):
    """With the in-CTA split off (FP4RL_MMA16_KW=0) a shape whose plan splits K over a cluster has no PRENORM
    build (x's slice would not span K); one that does not split K keeps it."""
    assert gemv_cuda.choose(6144, 4096, 2, 132)["SPLIT"] > 1
    monkeypatch.setattr(gemv_cuda, "IN_CTA_SPLIT", False)
    assert prenorm_plan(6144, 4096, 2, 132) is None
    assert gemv_cuda.choose(16, 256, 1, 132)["SPLIT"] == 1
    assert prenorm_plan(16, 256, 1, 132) is not None


def test_launch_prenorm_refuses_operands_it_cannot_read():
    """launch_prenorm's checks come before any device work (so they run on a CPU): K against the weight's, the
    dtypes, y's shape, h's shape and dtype, the norm weight's width and dtype."""
    w = _weight(16, 256)
    wc = gemv_cuda.relayout(w.data, w.block_scale)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    nw = torch.ones(256, dtype=torch.bfloat16)
    y = torch.empty(2, 16, dtype=torch.bfloat16)
    g = torch.ones(1)
    with pytest.raises(ValueError, match="K=128"):
        launch_prenorm(x[:, :128], x[:, :128], nw[:128], 1e-6, wc, g, y)
    with pytest.raises(TypeError, match="bfloat16"):
        launch_prenorm(x.float(), x, nw, 1e-6, wc, g, y)
    with pytest.raises(ValueError, match=r"y must be \[2, 16\]"):
        launch_prenorm(x, x, nw, 1e-6, wc, g, y[:1])
    with pytest.raises(ValueError, match="h must be bfloat16"):
        launch_prenorm(x, x[:1], nw, 1e-6, wc, g, y)
    with pytest.raises(ValueError, match="norm_weight must be"):
        launch_prenorm(x, x, nw.float(), 1e-6, wc, g, y)
    d = torch.zeros(2 * 4, 256, dtype=torch.bfloat16)
    moe = (d, torch.arange(8, dtype=torch.int32), torch.ones(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one of the two"):
        launch_prenorm(x, x, nw, 1e-6, wc, g, y, moe=moe)
    with pytest.raises(ValueError, match="one of the two"):
        launch_prenorm(x, None, nw, 1e-6, wc, g, y)
    with pytest.raises(ValueError, match="moe pos must be"):
        launch_prenorm(x, None, nw, 1e-6, wc, g, y, moe=(d, moe[1].long(), moe[2]))


def test_prenorm_plan_with_the_moe_combine():
    """ktop > 0: PRENORM 2 with KTOP / MW_F32, the same K split as the plain plan, shared memory for ktop
    expert rows per row of x instead of hr's one; Qwen3-30B-A3B's q/k/v (5120 x 2048, 8 experts a token) at
    1-2 rows, none at 4 (8 x 4 expert rows of 2048 do not fit two CTAs per SM)."""
    for m in (1, 2):
        cfg = prenorm_plan(5120, 2048, m, 132, ktop=8, w_f32=True)
        plain = prenorm_plan(5120, 2048, m, 132)
        assert cfg == dict(plain, PRENORM=2, KTOP=8, MW_F32=1), cfg
        rows = (8 - 1) * m * (2048 + 8) * 2
        more = gemv_cuda.smem_bytes(cfg, 2048, m) - gemv_cuda.smem_bytes(plain, 2048, m)
        assert rows <= more < rows + 128, (more, rows)
        assert prenorm_static_bytes(cfg) == prenorm_static_bytes(plain) + 8 * 8 * 8
    assert prenorm_plan(5120, 2048, 4, 132, ktop=8) is None


def _mma_sync(n, k, m):
    """The mma.sync configuration of m rows (the PRENORM build's arithmetic; the default plan may take the
    wgmma build at 2-16 rows, gemv_cuda.choose_narrow, which rounds a few elements differently)."""
    return gemv_cuda.choose(n, k, m, torch.cuda.get_device_properties(0).multi_processor_count)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (5120, 2048), (24576, 4096), (144, 640)])
def test_gpu_prenorm_is_add_rmsnorm_then_the_gemm_bit_for_bit(n, k):
    """The PRENORM build against its definition on the same GPU: x' and the GEMM's output equal
    prenorm.reference's x' and launch() on prenorm.reference's y bit for bit, for every row count it plans
    (1-8), per-tensor and per-row global scales, a residual with a row stride; only CTA 0 writes x' and it is
    complete; a row's result does not depend on the other rows. (K = 640: 2.5 groups of 256 columns, the last
    lanes' chunks past K.)"""
    from fp4rl.kernels import prenorm

    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 8, seed=11)
    gr = (g * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
    gen = torch.Generator().manual_seed(12)
    wide = (torch.randn(8, k + 64, generator=gen) * 3).bfloat16().cuda()  # the residual, row stride K + 64
    xr = wide[:, :k]
    hr = base
    nw = (torch.rand(k, generator=gen) + 0.5).bfloat16().cuda()
    planned = 0
    for m in range(1, 9):
        if prenorm_plan(n, k, m, torch.cuda.get_device_properties(0).multi_processor_count) is None:
            continue
        planned += 1
        xs_ref, y_ref = prenorm.reference(xr[:m], hr[:m], nw, 1e-6)
        for gs in (g, gr):
            want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            gemv_cuda.launch(y_ref, wc, gs, want, cfg=_mma_sync(n, k, m))
            got = torch.full_like(want, float("nan"))
            out = launch_prenorm(xr[:m], hr[:m], nw, 1e-6, wc, gs, got)
            assert out is not None and out[1] is got
            assert torch.equal(out[0], xs_ref), (m, gs.numel())
            assert torch.equal(got, want), (m, gs.numel(), (got.float() - want.float()).abs().max().item())
            if m > 1:  # batch invariance: row 0 alone gives the same bits
                one = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
                launch_prenorm(xr[:1], hr[:1], nw, 1e-6, wc, gs, one)
                assert torch.equal(one[0], got[0]), m
    assert planned and PN_STATE["ok"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,ktop", [(5120, 2048, 8), (144, 640, 3)])
def test_gpu_prenorm_combine_is_add_rmsnorm_moe_then_the_gemm_bit_for_bit(n, k, ktop, w_dtype):
    """PRENORM 2 against its definition on the same GPU: x' and the GEMM's output equal
    prenorm.reference(moe=)'s x' and launch() on its y bit for bit at the rows it plans, the experts' rows in
    a shuffled order (pos a permutation), d with a row stride; x' is fused.add_rmsnorm(moe=)'s x' too."""
    from fp4rl.kernels import fused, prenorm

    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    w, wc, wd, g, base = _gpu_case(n, k, {}, 8, seed=13)
    gen = torch.Generator().manual_seed(14)
    xr = (torch.randn(8, k, generator=gen) * 3).bfloat16().cuda()
    nw = (torch.rand(k, generator=gen) + 0.5).bfloat16().cuda()
    planned = 0
    for m in range(1, 9):
        if prenorm_plan(n, k, m, torch.cuda.get_device_properties(0).multi_processor_count, ktop,
                                  w_dtype == torch.float32) is None:
            continue
        planned += 1
        dwide = torch.randn(m * ktop, k + 32, generator=gen).bfloat16().cuda()
        d = dwide[:, :k]
        pos = torch.randperm(m * ktop, generator=gen).to(torch.int32).cuda()
        wts = torch.softmax(torch.randn(m, ktop, generator=gen), -1).to(w_dtype).cuda()
        xs_ref, y_ref = prenorm.reference(xr[:m], None, nw, 1e-6, moe=(d, pos, wts))
        assert torch.equal(xs_ref, fused.add_rmsnorm(xr[:m], None, nw, 1e-6, moe=(d, pos, wts))[0])
        want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        gemv_cuda.launch(y_ref, wc, g, want, cfg=_mma_sync(n, k, m))
        got = torch.full_like(want, float("nan"))
        out = launch_prenorm(xr[:m], None, nw, 1e-6, wc, g, got, moe=(d, pos, wts))
        assert out is not None and torch.equal(out[0], xs_ref), m
        assert torch.equal(got, want), (m, (got.float() - want.float()).abs().max().item())
    assert planned and PN_STATE["moe_ok"] is True
