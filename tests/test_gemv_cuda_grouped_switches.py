"""The routed experts' GEMM switches that leave its bits (fp4rl.kernels.gemv_cuda_grouped: SLOT_TABLE, the
one-token view, the early per-row scales, LD_VOLATILE): on a Hopper GPU (-m gpu) each against the kernel
without it; the slot table's words on any device. The kernel itself: tests/test_gemv_cuda_grouped.py."""

import pytest
import torch
from test_gemv_cuda_grouped import _gate_up, _random_experts, _routing

from fp4rl.kernels import gemv_cuda, gemv_cuda_grouped


def _grouped(x, wc, g, offs, shape, **kwargs):
    """launch_grouped into a fresh NaN-filled bfloat16 y of `shape` (a row it misses stays NaN)."""
    y = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    return gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("e", [6, 128, 300])
def test_gpu_slot_table_finds_the_same_experts(e, monkeypatch):
    """SLOTTABLE (gemv_cuda_grouped.SLOT_TABLE, the default): the experts' offsets read in one round trip give
    the bits of the 32-experts-a-trip search, for fewer experts than a warp, 128 (one table of 4 words) and
    300 (8 words, then the rest 32 at a time; or one word, then the rest), routings that use the last experts,
    several chunks of one expert, plain x, the gather and the SiLU staging."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(17 + e)
    n, k = 64, 256
    _, _, g, wc = _random_experts(e, n, k, seed=9)
    routings = [_routing(e, t, min(4, e), gen, hot=e - 1) for t in (1, 8)]
    counts = torch.zeros(e, dtype=torch.int64)
    counts[e - 1], counts[e // 2] = 20, 3  # the last expert in three 8-row chunks
    routings.append(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32).cuda())
    for offs in routings:
        m = int(offs[-1])
        xt = torch.randn(m, k, generator=gen).bfloat16().cuda()
        rows = torch.randint(0, m, (m,), generator=gen, dtype=torch.int32).cuda()
        gu = _gate_up(m, k, gen)
        for kwargs, x in (({}, xt), ({"x_rows": rows}, xt), ({"x_silu": True}, gu)):
            outs = []
            # no table; all words (300: 8 words, then 32 a trip); one word
            for table, cap in ((False, 8), (True, 8), (True, 1)):
                monkeypatch.setattr(gemv_cuda_grouped, "SLOT_TABLE", table)
                monkeypatch.setattr(gemv_cuda_grouped, "SLOT_TABLE_MAX", cap)
                outs.append(_grouped(x, wc, g, offs, (m, n), **kwargs))
            assert not outs[0].isnan().any(), (e, m, list(kwargs))
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), (e, m, list(kwargs))


@pytest.mark.gpu
def test_gpu_one_token_view_keeps_the_gathers_bits(monkeypatch):
    """ONE_TOKEN_VIEW (FP4RL_MMA16_ONE_TOKEN): at one token the gather's rows read x through a row stride of 0
    instead of x_rows, with the bits of the gather, eagerly and in a CUDA graph replayed with new routing;
    more tokens keep the gather."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(19)
    e, n, k = 128, 64, 512
    _, _, g, wc = _random_experts(e, n, k, seed=12)
    for t in (1, 2):
        x = torch.randn(t, k, generator=gen).bfloat16().cuda()
        for _ in range(3):
            offs = _routing(e, t, 8, gen)
            m = t * 8
            rows = torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda()
            outs = []
            for view in (False, True):
                monkeypatch.setattr(gemv_cuda_grouped, "ONE_TOKEN_VIEW", view)
                outs.append(_grouped(x, wc, g, offs, (m, n), x_rows=rows))
            assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), t
    # a graph captured with the view, new routing
    monkeypatch.setattr(gemv_cuda_grouped, "ONE_TOKEN_VIEW", True)
    x = torch.randn(1, k, generator=gen).bfloat16().cuda()
    offs = _routing(e, 1, 8, gen)
    rows = torch.zeros(8, dtype=torch.int32, device="cuda")
    y = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, x_rows=rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, x_rows=rows)
    for _ in range(3):
        offs.copy_(_routing(e, 1, 8, gen))
        x.copy_(torch.randn(1, k, generator=gen).bfloat16())
        graph.replay()
        want = torch.empty_like(y)
        monkeypatch.setattr(gemv_cuda_grouped, "ONE_TOKEN_VIEW", False)
        gemv_cuda_grouped.launch_grouped(x, wc, g, offs, want, x_rows=rows)
        monkeypatch.setattr(gemv_cuda_grouped, "ONE_TOKEN_VIEW", True)
        assert torch.equal(y, want)


@pytest.mark.gpu
def test_gpu_grouped_row_scales_read_early_keep_the_bits(monkeypatch):
    """ROW_SCALE_EARLY (FP4RL_MMA16_GSR) on the experts' gate / up launch (per-row global scales [E, N], the
    gather and plain x, 1 and 8 tokens): the bits of the epilogue's own read."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(23)
    e, n, k = 16, 384, 1024
    _, _, g, wc = _random_experts(e, n, k, seed=14)
    gr = (g[:, None] * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
    for t in (1, 8):
        offs = _routing(e, t, 4, gen)
        m = t * 4
        xt = torch.randn(t, k, generator=gen).bfloat16().cuda()
        rows = torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda()
        xm = torch.randn(m, k, generator=gen).bfloat16().cuda()
        for kwargs, x in (({"x_rows": rows}, xt), ({}, xm)):
            outs = []
            for early in (False, True):
                monkeypatch.setattr(gemv_cuda, "ROW_SCALE_EARLY", early)
                outs.append(_grouped(x, wc, gr, offs, (m, n), **kwargs))
            assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), (t, list(kwargs))


@pytest.mark.gpu
def test_gpu_volatile_offsets_keep_the_bits(monkeypatch):
    """LD_VOLATILE (FP4RL_MMA16_LDVOL): the offsets and x_rows read by volatile loads leave the bits: plain x,
    the gather and the SiLU staging at 1 and 8 tokens of 128 experts."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(31)
    e, n, k = 128, 256, 512
    _, _, g, wc = _random_experts(e, n, k, seed=16)
    for t in (1, 8):
        offs = _routing(e, t, 8, gen, hot=e - 1)
        m = t * 8
        xt = torch.randn(t, k, generator=gen).bfloat16().cuda()
        rows = torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda()
        xm = torch.randn(m, k, generator=gen).bfloat16().cuda()
        gu = _gate_up(m, k, gen)
        for kwargs, x in (({}, xm), ({"x_rows": rows}, xt), ({"x_silu": True}, gu)):
            outs = []
            for vol in (False, True):
                monkeypatch.setattr(gemv_cuda_grouped, "LD_VOLATILE", vol)
                outs.append(_grouped(x, wc, g, offs, (m, n), **kwargs))
            assert not outs[0].isnan().any(), (t, list(kwargs))
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), (t, list(kwargs))


def test_slot_table_words_by_experts(monkeypatch):
    """slot_table: the 32-expert words of offsets a routed-experts CTA reads at once (SLOTTABLE), up to
    SLOT_TABLE_MAX; 0 with the table off (FP4RL_MMA16_SLOTTABLE=0)."""
    assert [gemv_cuda_grouped.slot_table(e) for e in (1, 32, 33, 128, 256, 300)] == [1, 1, 2, 4, 8, 8]
    monkeypatch.setattr(gemv_cuda_grouped, "SLOT_TABLE", False)
    assert gemv_cuda_grouped.slot_table(128) == 0


def _route_then_experts(b):
    """The MoE step's order: new offsets written (the route's place), gate / up with the gather, then the down
    projection: with SiLU staging (b.silu), or after a silu_mul launch as past 8 tokens (the plain build)."""
    from fp4rl.kernels import fused

    b.offs.copy_(b.offs_src)
    gemv_cuda_grouped.launch_grouped(b.x, b.wc_gu, b.g_gu, b.offs, b.gu, x_rows=b.rows)
    if b.silu:
        gemv_cuda_grouped.launch_grouped(b.gu, b.wc_d, b.g_d, b.offs, b.y, x_silu=True)
    else:
        gemv_cuda_grouped.launch_grouped(fused.silu_mul(b.gu)[0], b.wc_d, b.g_d, b.offs, b.y)


@pytest.mark.gpu
def test_gpu_gate_up_trigger_keeps_the_bits_and_sees_each_routing(monkeypatch):
    """In a CUDA graph under PDL whose first node writes new offsets each replay (as the route does), gate /
    up -> down gives, replay after replay, the bits of the same launches run eagerly; 1 and 8 tokens of 128
    experts, top 8, the SiLU in the down projection's staging, and 16 tokens with silu_mul launched between
    (the plain build); with the gate / up's trigger where it is (after its stream) and right after its wait
    (GATE_UP_TRIGGER 3)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.kernels import pdl

    gen = torch.Generator().manual_seed(41)
    e, top, i, h = 128, 8, 256, 512
    _, _, g_gu, wc_gu = _random_experts(e, 2 * i, h, seed=21)
    _, _, g_d, wc_d = _random_experts(e, h, i, seed=22)
    for t, trigger in ((1, None), (8, None), (16, None), (1, 3), (8, 3), (16, 3)):
        monkeypatch.setattr(gemv_cuda_grouped, "GATE_UP_TRIGGER", trigger)
        m = t * top
        offs_src = _routing(e, t, top, gen)
        b = SimpleNamespace(x=torch.randn(t, h, generator=gen).bfloat16().cuda(), offs_src=offs_src,
                            rows=torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda(),
                            offs=torch.empty_like(offs_src), wc_gu=wc_gu, g_gu=g_gu, wc_d=wc_d, g_d=g_d,
                            gu=torch.empty(m, 2 * i, dtype=torch.bfloat16, device="cuda"),
                            y=torch.empty(m, h, dtype=torch.bfloat16, device="cuda"), silu=t <= 8)
        _route_then_experts(b)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), pdl.step():
            _route_then_experts(b)
        for hot in (None, e - 1, 3, None):
            b.offs_src.copy_(_routing(e, t, top, gen, hot))
            b.x.copy_(torch.randn(t, h, generator=gen).bfloat16())
            b.y.fill_(float("nan"))
            graph.replay()
            got = b.y.clone()
            _route_then_experts(b)  # eager
            assert not b.y.isnan().any() and torch.equal(got, b.y), (t, trigger, hot)


# the route's place in a PDL chain, written late: lets the next kernel start at once, then writes dst ~spin
# cycles after its own wait
_LATE_WRITE = r"""
extern "C" __global__ void late_write(const int* src, int* dst, int n, int spin) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {}
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"""


@pytest.mark.gpu
def test_gpu_down_projection_waits_for_a_route_that_writes_late(monkeypatch):
    """The offsets written by a PDL kernel in the route's place that lets the next kernel start at once and
    writes ~50 us later. With the gate / up between letting the down projection start after its stream
    (GATE_UP_TRIGGER None) or right after its own wait (3), the down projection (which reads the offsets only
    after its own wait) gives the bits of the same launches without PDL, routing after routing. (The removed
    EARLY build, reading them before its wait, failed this: bench/RESULTS.md, thirty-fifth session.)"""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    from types import SimpleNamespace

    from fp4rl.kernels import fused, pdl

    gen = torch.Generator().manual_seed(43)
    e, top, i, h, t = 128, 8, 256, 512, 1
    _, _, g_gu, wc_gu = _random_experts(e, 2 * i, h, seed=23)
    _, _, g_d, wc_d = _random_experts(e, h, i, seed=24)
    m = t * top
    offs_src = _routing(e, t, top, gen)
    b = SimpleNamespace(x=torch.randn(t, h, generator=gen).bfloat16().cuda(), offs_src=offs_src,
                        rows=torch.zeros(m, dtype=torch.int32, device="cuda"), offs=offs_src.clone(),
                        gu=torch.empty(m, 2 * i, dtype=torch.bfloat16, device="cuda"),
                        y=torch.empty(m, h, dtype=torch.bfloat16, device="cuda"))
    late = torch.cuda._compile_kernel(_LATE_WRITE, "late_write")

    def chained(trigger):
        monkeypatch.setattr(gemv_cuda_grouped, "GATE_UP_TRIGGER", trigger)
        with pdl.step():
            pdl.launch(late, (1, 1, 1), (128, 1, 1), [b.offs_src, b.offs, b.offs.numel(), 100_000], 0,
                       torch.cuda.current_stream(), True)
            gemv_cuda_grouped.launch_grouped(b.x, wc_gu, g_gu, b.offs, b.gu, x_rows=b.rows)
            gemv_cuda_grouped.launch_grouped(b.gu, wc_d, g_d, b.offs, b.y, x_silu=True)
        torch.cuda.synchronize()
        return b.y.clone()

    def reference():  # no PDL: each launch after the one before
        gemv_cuda_grouped.launch_grouped(b.x, wc_gu, g_gu, b.offs_src, b.gu, x_rows=b.rows)
        y = torch.empty_like(b.y)
        gemv_cuda_grouped.launch_grouped(fused.silu_mul(b.gu)[0], wc_d, g_d, b.offs_src, y)
        return y

    for trigger in (None, 3):  # compiled before the timing matters
        chained(trigger)
    for n, trigger in enumerate([None, 3] * 4):
        b.offs_src.copy_(_routing(e, t, top, gen, hot=n % e))  # another routing than the one in b.offs
        torch.cuda.synchronize()
        assert torch.equal(chained(trigger), reference()), (n, trigger)


def test_early_build_is_refused_from_the_environment(monkeypatch):
    """FP4RL_MMA16_EARLY (the EARLY build of the experts' down projection, removed: unsound and slower) is
    refused with an error that says it was removed, rather than ignored; unset, empty or 0 passes. At import
    too (a fresh interpreter)."""
    import os
    import subprocess
    import sys

    for ok in ("", "0", " 0 "):
        monkeypatch.setenv("FP4RL_MMA16_EARLY", ok)
        gemv_cuda_grouped._refuse_early()
    monkeypatch.delenv("FP4RL_MMA16_EARLY")
    gemv_cuda_grouped._refuse_early()
    for bad in ("1", "yes"):
        monkeypatch.setenv("FP4RL_MMA16_EARLY", bad)
        with pytest.raises(ValueError, match="FP4RL_MMA16_EARLY.*was removed.*unset it"):
            gemv_cuda_grouped._refuse_early()
    env = {**os.environ, "FP4RL_MMA16_EARLY": "1"}
    run = subprocess.run([sys.executable, "-c", "import fp4rl.kernels.gemv_cuda_grouped"], env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "FP4RL_MMA16_EARLY='1'" in run.stderr and "was removed" in run.stderr
