"""The CUDA mma16 kernel's routed-expert (grouped) launches (fp4rl.kernels.gemv_cuda_grouped): the stacked
weight copy and the configuration on any device; on a Hopper GPU (-m gpu) the grouped kernel against the
float64 reference over any routing (empty experts, several chunks of one expert; 8-, 16- and 32-row chunks),
in CUDA graphs replayed with new routing, its gather of the sorted rows (x_rows) and its SiLU(gate) * up
staging (x_silu) bit for bit against silu_mul then the plain launch. The dense kernel:
tests/test_gemv_cuda.py."""

import pytest
import torch
from test_gemv_cuda import _rel, _weight

from fp4rl.kernels import gemv_cuda, gemv_cuda_grouped
from fp4rl.nvfp4 import reference


def test_relayout_stack_is_the_experts_copies_one_after_another():
    e, n, k = 3, 32, 256
    ws = [_weight(n, k, seed=i) for i in range(e)]
    data = torch.stack([w.data for w in ws])
    scale = torch.stack([w.block_scale for w in ws])
    st = gemv_cuda_grouped.relayout_stack(data, scale)
    assert (st.n, st.k) == (n, k) and st.wt.shape[0] == e * n // 16
    one = [gemv_cuda.relayout(w.data, w.block_scale) for w in ws]
    assert torch.equal(st.wt, torch.cat([c.wt for c in one]))
    assert torch.equal(st.st, torch.cat([c.st for c in one]))
    with pytest.raises(ValueError, match=r"\[E, N, K/2\]"):
        gemv_cuda_grouped.relayout_stack(ws[0].data, ws[0].block_scale)


def test_choose_grouped_splits_to_fill_the_gpu():
    cfg = gemv_cuda_grouped.choose_grouped(1536, 2048, 8, 132)
    assert cfg["MG"] == 1 and gemv_cuda.ksplit(cfg) >= 2  # 8 experts x 12 n-blocks: split to fill the GPU
    assert cfg["SPLIT"] == 1  # ... between the warps of a CTA (x's whole K of 8 rows fits)
    # many experts: a wave already
    assert gemv_cuda.ksplit(gemv_cuda_grouped.choose_grouped(1536, 2048, 128, 132)) == 1
    assert gemv_cuda.ksplit(gemv_cuda_grouped.choose_grouped(2048, 768, 8, 132)) <= 768 // 128 // 2


def test_grouped_fill_lets_the_split_take_more_ctas_per_sm(monkeypatch):
    """GROUPED_FILL (FP4RL_MMA16_GFILL): the CTAs per SM the split may fill. Qwen3-30B-A3B's one-token gate /
    up (8 experts x 12 n-blocks of 128 rows) splits K over 2 warps (192 CTAs) at 2 and over 4 (384 CTAs) at
    the default 3; its down projection (8 x 16 n-blocks, K = 768) stays at 2: at 3, 512 CTAs would be 3.9 per
    SM, and 4 parts would leave a warp fewer than 2 of its 6 steps."""
    def plan(n, k):
        cfg = gemv_cuda_grouped.choose_grouped(n, k, 8, 132)
        return gemv_cuda.ksplit(cfg), cfg["SPLIT"], 8 * -(-n // gemv_cuda.block_rows(cfg)) * cfg["SPLIT"]

    assert plan(1536, 2048) == (4, 1, 384) and plan(2048, 768) == (2, 1, 256)
    monkeypatch.setattr(gemv_cuda_grouped, "GROUPED_FILL", 2)
    assert plan(1536, 2048) == (2, 1, 192) and plan(2048, 768) == (2, 1, 256)
    monkeypatch.setattr(gemv_cuda_grouped, "GROUPED_FILL", 4)
    assert plan(1536, 2048) == (4, 1, 384) and plan(2048, 768) == (2, 1, 256)
    monkeypatch.setattr(gemv_cuda_grouped, "GROUPED_FILL", 6)  # K over 8 warps: 768 CTAs, 3 fit an SM
    assert plan(1536, 2048) == (4, 1, 384)
    # where 3 CTAs do not fit an SM's shared memory, 3 a SM would be two waves: the plan of 2 a SM
    monkeypatch.setattr(gemv_cuda_grouped, "GROUPED_FILL", 3)
    cfg = gemv_cuda_grouped.choose_grouped(3072, 4096, 8, 132)  # K over 2 warps: 94.5 KB a CTA
    assert gemv_cuda_grouped._grouped_plan(3072, 4096, 8, 132, 1, 3).get("KW") == 2
    assert plan(3072, 4096) == (1, 1, 192) and gemv_cuda.smem_bytes(cfg, 4096, 8) > 228 * 1024 // 3


def test_grouped_chunks_grow_with_rows_per_expert():
    """8-row chunks up to 8 rows per expert on average, 16 up to 16, then 32 (each chunk re-streams its
    expert's weights); a chunk whose x slice does not fit shared memory takes fewer row groups."""
    rows = (1, 512, 1024, 1025, 2048, 2049, 4096)
    assert [gemv_cuda_grouped.grouped_mg(m, 128) for m in rows] == [1, 1, 1, 2, 2, 4, 4]
    for mg in (1, 2, 4):
        cfg = gemv_cuda_grouped.choose_grouped(1536, 2048, 128, 132, mg)
        assert cfg["MG"] == mg and gemv_cuda.smem_bytes(cfg, 2048, 8 * mg) <= gemv_cuda.SMEM_MAX
    # 32 rows of K=4096 exceed shared memory, 16 fit
    big = gemv_cuda_grouped.choose_grouped(1024, 4096, 128, 132, 4)
    assert big["MG"] == 2 and gemv_cuda.smem_bytes(big, 4096, 16) <= gemv_cuda.SMEM_MAX


@pytest.mark.gpu
def test_gpu_grouped_experts_match_reference_and_replay_new_routing():
    """Routed experts on the grouped mma16 kernel: each expert's rows against the float64 reference, with
    empty experts, one expert taking every row, 9-100 rows per expert (several chunks of 8, 16 or 32 rows,
    gemv_cuda_grouped.grouped_mg), per-row and
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
    wc = gemv_cuda_grouped.relayout_stack(data, scale)

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
            gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, x_scale=xs)
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
    check([9, 9, 9, 9, 9, 9], per_row=False, w4a4=True)  # 9 rows per expert: 16-row chunks (MG 2)
    check([0, 100, 0, 7, 0, 0], per_row=True)  # ~18 per expert: 32-row chunks (MG 4), one expert in four
    check([40, 0, 50, 9, 0, 30], per_row=False, w4a4=True)
    # one graph, new routing each replay (same M, same most-rows bound)
    offs = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    m = 8
    x = torch.randn(m, k, device="cuda").bfloat16()
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    offs.copy_(torch.tensor([0, 8, 8, 8, 8, 8, 8], dtype=torch.int32))
    gemv_cuda_grouped.launch_grouped(x, wc, gexp, offs, y)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda_grouped.launch_grouped(x, wc, gexp, offs, y)
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
    wc = gemv_cuda_grouped.relayout_stack(torch.stack([w.data for w in ws]),
                                          torch.stack([w.block_scale for w in ws]))
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
            gemv_cuda_grouped.launch_grouped(x.index_select(0, rows), wc, g, offs, want)
            gemv_cuda_grouped.launch_grouped(x, wc, g, offs, got, x_rows=rows)
        assert torch.equal(got, want)
    rows_buf, offs_buf = routing()
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    gemv_cuda_grouped.launch_grouped(x, wc, g, offs_buf, y, x_rows=rows_buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda_grouped.launch_grouped(x, wc, g, offs_buf, y, x_rows=rows_buf)
    for _ in range(3):
        rows, offs = routing()
        rows_buf.copy_(rows)
        offs_buf.copy_(offs)
        y.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(y)
        gemv_cuda_grouped.launch_grouped(x.index_select(0, rows), wc, g, offs, want)
        assert torch.equal(y, want)
    with pytest.raises(ValueError, match="W4A16"):
        gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, x_scale=torch.ones(t, device="cuda"), x_rows=rows)
    with pytest.raises(TypeError, match="int32"):
        gemv_cuda_grouped.launch_grouped(x, wc, g, offs, y, x_rows=rows.long())


def test_launch_grouped_silu_refusals():
    """x_silu (SiLU(gate) * up in the x staging): W4A16 only, not with x_rows, x must be gate | up [M, 2K].
    Checked before anything runs (no GPU needed)."""
    e, n, k = 2, 16, 128
    ws = [_weight(n, k, seed=40 + i) for i in range(e)]
    wc = gemv_cuda_grouped.relayout_stack(torch.stack([w.data for w in ws]),
                                          torch.stack([w.block_scale for w in ws]))
    g = torch.ones(e)
    offs = torch.tensor([0, 1, 2], dtype=torch.int32)
    gu = torch.zeros(2, 2 * k, dtype=torch.bfloat16)
    y = torch.empty(2, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="W4A16"):
        gemv_cuda_grouped.launch_grouped(gu, wc, g, offs, y, x_scale=torch.ones(2), x_silu=True)
    with pytest.raises(ValueError, match="x_rows"):
        gemv_cuda_grouped.launch_grouped(gu, wc, g, offs, y, x_rows=offs[:2].clone(), x_silu=True)
    with pytest.raises(ValueError, match=r"gate \| up \[M, 2K\] with K=128"):
        gemv_cuda_grouped.launch_grouped(gu[:, :k], wc, g, offs, y, x_silu=True)
    with pytest.raises(ValueError, match=r"gate \| up \[M, 2K\] with K=128"):
        gemv_cuda_grouped.launch_grouped(torch.zeros(2, 3 * k, dtype=torch.bfloat16), wc, g, offs, y,
                                         x_silu=True)


def _random_experts(e, n, k, seed):
    """Random stacked NVFP4 weights [E, N, K/2] on the GPU (random codes, E4M3 block scales in 1/16..4) and
    per-expert global scales: (data, block scales, global scales [E], the mma16 copy). The SILU tests compare
    kernel against kernel, so any codes do."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8).cuda()
    scale = (torch.rand(e, n, k // 16, generator=gen) * 4 + 0.0625).to(torch.float8_e4m3fn).cuda()
    g = (torch.rand(e, generator=gen) * 1e-2 + 1e-3).cuda()
    return data, scale, g, gemv_cuda_grouped.relayout_stack(data, scale)


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
    return gemv_cuda_grouped.relayout_stack(data, scale), torch.full((e,), 1 / 256, device="cuda")


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
    gemv_cuda_grouped.launch_grouped(gu, wci, gi, offs, got, x_silu=True)
    a = fused.silu_mul(gu)[0]
    plain = torch.empty_like(got)
    gemv_cuda_grouped.launch_grouped(a, wci, gi, offs, plain)
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
            gemv_cuda_grouped.launch_grouped(a, w, gs, offs, want)
            gemv_cuda_grouped.launch_grouped(gu, w, gs, offs, got, x_silu=True)
        return a, want, got

    calls = []  # fused.silu_mul launches (gemm.gemm calls it as gemm._fused.silu_mul)
    silu_mul = fused.silu_mul
    monkeypatch.setattr(gemm._fused, "silu_mul", lambda *a, **kw: calls.append(1) or silu_mul(*a, **kw))
    cases = [(1, None, 0), (8, None, 0), (32, None, 0), (32, 7, 0), (8, None, 40), (1, 3, 24), (2, None, 0)]
    for t, hot, pad in cases:
        offs = _routing(e, t, top, gen, hot)
        gu = _gate_up(t * top, i, gen, pad)
        assert gu.stride(0) == 2 * i + pad
        cfg = gemv_cuda_grouped.choose_grouped(h, i, min(e, t * top), sms)
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
    assert gemv_cuda.ksplit(gemv_cuda_grouped.choose_grouped(n2, k2, 4, sms)) == 2
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
    gemv_cuda_grouped.launch_grouped(gu_buf, wc, g, offs_buf, y, x_silu=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), pdl.step():
        gemv_cuda_grouped.launch_grouped(gu_buf, wc, g, offs_buf, y, x_silu=True)
    for hot in (None, 11, None):
        gu_buf.copy_(_gate_up(m, i, gen))
        offs_buf.copy_(_routing(e, t, top, gen, hot))
        y.fill_(float("nan"))
        graph.replay()
        want = torch.empty_like(y)
        gemv_cuda_grouped.launch_grouped(fused.silu_mul(gu_buf)[0], wc, g, offs_buf, want)
        assert not want.isnan().any()
        assert torch.equal(y, want), hot


@pytest.mark.gpu
def test_gpu_grouped_in_cta_split_gives_the_cluster_splits_bits():
    """The routed experts with K split between KW warps of a CTA (choose_grouped's default where x fits)
    give the bits of SPLIT = KW CTAs of a cluster: plain x, the gather (x_rows), SiLU staging (x_silu),
    per-row global scales, uneven step ranges (K = 640: 5 steps over 2 and 4 parts), several chunks per
    expert, chunks of 8, 16 and 32 rows (MG 1, 2, 4)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(7)
    for e, n, k, top in ((16, 256, 640, 4), (8, 512, 1024, 2)):
        _, _, g, wc = _random_experts(e, n, k, seed=3)
        gr = (g[:, None] * torch.linspace(0.5, 2.0, n, device="cuda")).contiguous()
        for t in (1, 3, 8, 20):
            offs = _routing(e, t, top, gen)
            m = t * top
            xt = torch.randn(t, k, generator=gen).bfloat16().cuda()
            rows = torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda()
            xm = torch.randn(m, k, generator=gen).bfloat16().cuda()
            gu = _gate_up(m, k, gen)
            for split, mg in ((2, 1), (4, 1), (2, 2), (4, 4)):
                cluster = dict(NT=1, MG=mg, SPLIT=split, DEPTH=2)
                inside = dict(NT=1, MG=mg, SPLIT=1, DEPTH=2, KW=split)
                if gemv_cuda.smem_bytes(inside, k, 8 * mg) > gemv_cuda.SMEM_MAX:
                    continue
                for gs in (g, gr):
                    for kwargs, x in (({}, xm), ({"x_rows": rows}, xt), ({"x_silu": True}, gu)):
                        a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                        b = torch.full_like(a, float("nan"))
                        gemv_cuda_grouped.launch_grouped(x, wc, gs, offs, a, cfg=cluster, **kwargs)
                        gemv_cuda_grouped.launch_grouped(x, wc, gs, offs, b, cfg=inside, **kwargs)
                        assert not a.isnan().any() and torch.equal(a, b), (e, k, t, split, mg, list(kwargs))
                        if split == 2 and gs is g and t in (3, 20):  # the global scale read late (GSE 0)
                            b.fill_(float("nan"))
                            gemv_cuda_grouped.launch_grouped(x, wc, gs, offs, b, cfg=dict(inside, GSE=0),
                                                             **kwargs)
                            assert torch.equal(a, b), (e, k, t, list(kwargs))


@pytest.mark.gpu
def test_gpu_grouped_deeper_rings_give_the_same_bits():
    """gemv_cuda.deeper (FP4RL_MMA16_GDEPTH): rings of 3-8 steps give the bits of choose_grouped's depth-2
    ring (plain x, the gather and the SiLU staging; K = 768 and 2048, the Qwen3-30B-A3B experts' K)."""
    if not gemv_cuda.available():
        pytest.skip("needs a Hopper GPU and torch.cuda._compile_kernel")
    gen = torch.Generator().manual_seed(11)
    for e, n, k in ((16, 256, 768), (8, 384, 2048)):
        _, _, g, wc = _random_experts(e, n, k, seed=4)
        for t in (1, 8):
            offs = _routing(e, t, 4, gen)
            m = t * 4
            xt = torch.randn(t, k, generator=gen).bfloat16().cuda()
            rows = torch.randint(0, t, (m,), generator=gen, dtype=torch.int32).cuda()
            gu = _gate_up(m, k, gen)
            base = gemv_cuda_grouped.choose_grouped(n, k, min(e, m), 132)
            for kwargs, x in (({"x_rows": rows}, xt), ({"x_silu": True}, gu)):
                a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv_cuda_grouped.launch_grouped(x, wc, g, offs, a, cfg=base, **kwargs)
                assert not a.isnan().any()
                for depth in (3, 4, 6, 8):
                    cfg = gemv_cuda.deeper(base, depth, k, 8)
                    b = torch.full_like(a, float("nan"))
                    gemv_cuda_grouped.launch_grouped(x, wc, g, offs, b, cfg=cfg, **kwargs)
                    assert torch.equal(a, b), (k, t, depth, cfg, list(kwargs))
