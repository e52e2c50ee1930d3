"""W4A16 / W4A4 GEMMs on packed NVFP4 weights vs the reference dequantize + a float matmul.

The kernels multiply exact (e2m1 * block_scale) bfloat16 operands with an FP32 accumulator and
apply the global scale(s) to the accumulator, so against the float64 product of the reference
dequantized operands the only error is the bfloat16 output rounding (plus accumulation order):
a relative error ~2^-8/sqrt(3). The dequantize-then-matmul fallback also rounds every
weight to bfloat16 first, so it gets the looser bfloat16 GEMM bound. Runs in Triton's CPU
interpreter when there is no CUDA."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import gemm, gemm_tune  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.nvfp4.format import NVFP4Tensor  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 4e-3  # bfloat16 output rounding, as a relative Frobenius error
TOL_BF16 = 1e-2  # bfloat16 operands and output


def _rel(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def _weight(n, k, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return reference.quantize((torch.randn(n, k, generator=g) * 0.05).to(DEV), **kw)


def _stacked(ws):
    """The experts' NVFP4 weights [N, K] as one stacked [E, N, K] tensor (grouped GEMM operand)."""
    return NVFP4Tensor(data=torch.stack([q.data for q in ws]),
                       block_scale=torch.stack([q.block_scale for q in ws]),
                       global_scale=torch.stack([q.global_scale for q in ws]),
                       shape=torch.Size((len(ws), *ws[0].shape)), dtype=torch.float32)


def _x(m, k, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16().to(DEV)


@pytest.mark.parametrize("m,n,k,kw", [
    (1, 48, 96, {}),  # decode: split-K over a K that is not a multiple of the tile
    (3, 64, 128, {"scale_scope": "row"}),  # per-output-row global scale
    (40, 48, 64, {"tile": (16, 16), "scale_rule": "4/6"}),  # prefill tiles, masked edges
])
def test_linear_w4a16(m, n, k, kw):
    w = _weight(n, k, **kw)
    x = _x(m, k)
    ref = x.double() @ reference.dequantize(w).double().T
    y = gemm.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert _rel(y, ref) < TOL


def test_fallback_and_configs_agree():
    w, x = _weight(32, 64), _x(20, 64)
    ref = x.double() @ reference.dequantize(w).double().T
    y_fb = gemm.gemm(x, w, config=gemm_tune.FALLBACK)  # reference dequantize -> bf16, then matmul
    assert _rel(y_fb, ref) < TOL_BF16
    assert _rel(gemm.gemm(x, w), ref) < TOL
    for swap in (True, False):  # many-row tiles interleave W back to natural order instead of splitting x
        cfg = dict(SWAP=swap, BM=64, BN=32, BK=64, SPLIT_K=2 if swap else 1, num_warps=4, num_stages=1)
        assert _rel(gemm.gemm(x, w, config=cfg), ref) < TOL
    for bm in (1, 2):  # the CUDA-core path for 1-2 rows (any row count still works, tile by tile)
        cfg = dict(SWAP=True, BM=bm, BN=32, BK=64, SPLIT_K=2, num_warps=4, num_stages=1)
        assert _rel(gemm.gemm(x[:3], w, config=cfg), ref[:3]) < TOL


def test_grouped_with_empty_experts():
    e, n, k = 4, 32, 64
    ws = [_weight(n, k, seed=s) for s in range(e)]
    w = _stacked(ws)
    counts = [3, 0, 5, 1]  # expert 1 gets no tokens
    offsets = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32, device=DEV)
    x = _x(sum(counts), k)
    y = gemm.grouped_linear(x, w, offsets)
    ref = torch.cat([x[offsets[i]:offsets[i + 1]].double() @ reference.dequantize(ws[i]).double().T
                     for i in range(e)])
    assert _rel(y, ref) < TOL


def test_grouped_rows_gather_the_tokens():
    """gemm(x, rows=...) for grouped W4A16: x holds the tokens, sorted row r is x[rows[r]] (the MoE route's
    gather, read by the kernel where it can): equal to the gemm of x.index_select(0, rows)."""
    e, n, k = 3, 32, 64
    ws = [_weight(n, k, seed=20 + s) for s in range(e)]
    w = _stacked(ws)
    x = _x(4, k, seed=7)  # 4 tokens, 2 experts each: 8 sorted rows, tokens repeated
    rows = torch.tensor([0, 2, 3, 0, 1, 1, 2, 3], dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 3, 6, 8], dtype=torch.int32, device=DEV)
    want = gemm.gemm(x.index_select(0, rows), w, offsets=offsets, tokens=4)
    assert torch.equal(gemm.gemm(x, w, offsets=offsets, tokens=4, rows=rows), want)
    with pytest.raises(ValueError, match="grouped W4A16"):
        gemm.gemm(x, ws[0], rows=rows)
    with pytest.raises(TypeError, match="int32"):
        gemm.gemm(x, w, offsets=offsets, rows=rows.long())


def _gate_up(m, k, seed):
    """gate | up [m, 2K] bf16: gate over ~4 decades either sign (exp overflow below -88.7), up over 4."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(m, 2 * k, generator=g) * 10.0 ** (torch.rand(m, 2 * k, generator=g) * 4 - 2)
    v[:, :6] = torch.tensor([0.0, -0.0, 88.0, -89.0, 1e4, -1e4])
    return v.bfloat16().to(DEV)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy exp/div
@pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")
def test_silu_is_silu_mul_then_the_gemm():
    """gemm(x = gate | up, silu=True) = gemm(fused.silu_mul(x)) bit for bit, on grouped weights (with empty
    experts, with rows: the tokens' gate | up gathered), dense weights and with FUSED_SILU off; the bad
    inputs are refused with clear errors."""
    from fp4rl.kernels import fused

    e, n, k = 3, 32, 64
    ws = [_weight(n, k, seed=30 + s) for s in range(e)]
    w = _stacked(ws)
    offsets = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEV)  # expert 1 gets no rows
    gu = _gate_up(8, k, seed=3)
    a = fused.silu_mul(gu)[0]
    assert a.shape == (8, k)
    want = gemm.gemm(a, w, offsets=offsets, tokens=4)
    assert torch.equal(gemm.gemm(gu, w, offsets=offsets, tokens=4, silu=True), want)
    assert torch.equal(gemm.gemm(gu, w, offsets=offsets, silu=True), want)  # no tokens: the Triton kernel
    gu_pad = torch.zeros(8, 2 * k + 16, dtype=torch.bfloat16, device=DEV)[:, :2 * k]  # a padded row stride
    gu_pad.copy_(gu)
    assert torch.equal(gemm.gemm(gu_pad, w, offsets=offsets, tokens=4, silu=True), want)
    old = gemm.FUSED_SILU
    try:
        gemm.FUSED_SILU = False
        assert torch.equal(gemm.gemm(gu, w, offsets=offsets, tokens=4, silu=True), want)
    finally:
        gemm.FUSED_SILU = old
    rows = torch.tensor([0, 2, 3, 0, 1, 1, 2, 3], dtype=torch.int32, device=DEV)  # 4 tokens' gate | up
    gu_t = gu[:4]
    want_rows = gemm.gemm(fused.silu_mul(gu_t)[0].index_select(0, rows), w, offsets=offsets, tokens=4)
    assert torch.equal(gemm.gemm(gu_t, w, offsets=offsets, tokens=4, rows=rows, silu=True), want_rows)
    wd = ws[0]  # dense
    for m in (1, 5):
        assert torch.equal(gemm.gemm(gu[:m], wd, silu=True), gemm.gemm(a[:m], wd))
    with pytest.raises(ValueError, match=r"silu=True needs x = gate \| up \[M, 2K\] with K=64"):
        gemm.gemm(a, w, offsets=offsets, silu=True)  # x [M, K]: not gate | up
    with pytest.raises(ValueError, match=r"silu=True needs x = gate \| up"):
        gemm.gemm(torch.cat([gu, gu], 1), wd, silu=True)  # 4K columns
    with pytest.raises(ValueError, match="silu=True is for W4A16"):
        gemm.gemm(None, wd, xq=gemm.quantize_activations(a), silu=True)
    with pytest.raises(TypeError, match="bfloat16"):
        gemm.gemm(gu.float(), wd, silu=True)


def test_grouped_dense_copy_runs_torch_grouped_mm():
    """Grouped experts carrying their DQ(W) stack (`dense`, Sampler(dense_rows=)): DENSE is torch's grouped
    GEMM on it, the per-expert product on the reference's dequantized weights bit for bit (empty experts,
    the rows gather, silu = silu_mul first, W4A4 on DQ(Q(x))); a copy of the wrong shape is refused."""
    from types import SimpleNamespace

    from fp4rl.kernels import fused

    e, n, k = 3, 32, 64
    ws = [_weight(n, k, seed=40 + s) for s in range(e)]
    w = _stacked(ws)
    # (float32, rounded by torch, as the sampler's copy: Triton's interpreter truncates float32 -> bfloat16)
    dq = torch.stack([gemm.dequantize(q.data, q.block_scale, q.global_scale, torch.float32).bfloat16()
                      for q in ws])
    assert torch.equal(dq, torch.stack([reference.dequantize(q).bfloat16() for q in ws]))
    wd = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, dense=dq)
    offsets = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEV)  # expert 1 gets no rows
    bounds = offsets.tolist()

    def per_expert(x):
        return torch.cat([torch.matmul(x[bounds[i]:bounds[i + 1]], dq[i].t()) for i in range(e)])

    x = _x(8, k, seed=5)
    y = gemm.gemm(x, wd, offsets=offsets, tune=False)  # untuned: the caller's choice, DENSE
    assert torch.equal(y, per_expert(x))
    assert _rel(y, torch.cat([x[bounds[i]:bounds[i + 1]].double() @ reference.dequantize(ws[i]).double().T
                              for i in range(e)])) < TOL_BF16
    rows = torch.tensor([0, 2, 3, 0, 1, 1, 2, 3], dtype=torch.int32, device=DEV)
    xt = _x(4, k, seed=6)
    assert torch.equal(gemm.gemm(xt, wd, offsets=offsets, rows=rows, tune=False),
                       per_expert(xt.index_select(0, rows)))
    gu = _gate_up(8, k, seed=7)
    assert torch.equal(gemm.gemm(gu, wd, offsets=offsets, silu=True, tune=False),
                       per_expert(fused.silu_mul(gu)[0]))
    xq = gemm.quantize_activations(x)
    assert torch.equal(gemm.gemm(None, wd, xq=xq, offsets=offsets, tune=False),
                       per_expert(gemm.dequantize(*xq, torch.bfloat16)))
    bad = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, dense=dq[0])
    with pytest.raises(ValueError, match=r"must be the weight's DQ\(W\), bfloat16 \[3, 32, 64\]"):
        gemm.gemm(x, bad, offsets=offsets, tune=False)


def test_grouped_cuda_kernel_takes_few_rows_per_expert(monkeypatch):
    """Experts carrying their mma16 copy go to the grouped CUDA kernel while the caller passes `tokens` and
    the rows average at most MMA16_GROUPED_ROWS_PER_EXPERT per expert (the batch size alone does not decide:
    Qwen3-30B-A3B's batch 256 puts 16 rows on each of 128 experts); above that, the Triton grouped GEMM."""
    from types import SimpleNamespace

    e, n, k = 2, 32, 64
    ws = [_weight(n, k, seed=50 + s) for s in range(e)]
    w = _stacked(ws)
    m16 = SimpleNamespace(n=n, k=k, wt=torch.empty(e * n // 16, 1), st=torch.empty(e * n // 16, 1))
    wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=m16)
    launched = []

    def launch(xin, wc, g, offsets, y, **kw):
        launched.append(xin.shape[0])
        return y.zero_()

    monkeypatch.setattr(gemm._mma16, "available", lambda device=None: True)
    monkeypatch.setattr(gemm._mma16_grouped, "launch_grouped", launch)
    monkeypatch.setattr(gemm, "MMA16_GROUPED_ROWS_PER_EXPERT", 16)
    # (tokens 100: past the old 64-token bound, still 16 rows per expert)
    for m, tokens, cuda in ((32, 4, True), (32, 100, True), (32, None, False), (33, 33, False)):
        launched.clear()
        x = _x(m, k, seed=m)
        offsets = torch.tensor([0, m // 2, m], dtype=torch.int32, device=DEV)
        y = gemm.gemm(x, wm, offsets=offsets, tokens=tokens)
        assert launched == ([m] if cuda else []), (m, tokens)
        if not cuda:  # the Triton kernel's product
            ref = torch.cat([x[a:b].double() @ reference.dequantize(q).double().T
                             for q, a, b in zip(ws, (0, m // 2), (m // 2, m))])
            assert _rel(y, ref) < TOL


def test_w4a4_matches_fake_quantized_operands():
    w, x = _weight(48, 64, scale_rule="4/6"), _x(5, 64, seed=4)
    xq = reference.quantize(x, scale_scope="row")  # what the kernel's per-token quantizer must give
    d, s, g = gemm.quantize_activations(x)
    assert torch.equal(d, xq.data) and torch.equal(s.view(torch.uint8), xq.block_scale.view(torch.uint8))
    assert torch.equal(g, xq.global_scale.reshape(-1))
    ref = reference.dequantize(xq).double() @ reference.dequantize(w).double().T
    assert _rel(gemm.linear_w4a4(x, w), ref) < TOL


def test_bad_inputs():
    w = _weight(32, 64)
    with pytest.raises(ValueError, match="K=32"):
        gemm.linear(_x(2, 32), w)
    with pytest.raises(TypeError, match="bfloat16"):
        gemm.linear(_x(2, 64).float(), w)


def test_tuner_rotation_copies():
    """The tuner rotates through enough copies that a pass reads >= 3x the L2, bounded by a count, a byte
    budget and a quarter of the free memory; never fewer than the weight itself."""
    mb = 2**20
    assert gemm_tune.rotation_copies(33 * mb, 66 * mb, 50 * mb, 100 * 2**30) == 5  # ceil(150 / 33)
    assert gemm_tune.rotation_copies(1 * mb, 2 * mb, 50 * mb, 100 * 2**30) == gemm_tune.TUNE_MAX_COPIES
    assert gemm_tune.rotation_copies(300 * mb, 600 * mb, 50 * mb, 100 * 2**30) == 1  # 3x L2 read in one call
    assert gemm_tune.rotation_copies(20 * mb, 40 * mb, 50 * mb, 80 * mb) == 1  # 20 MB free for copies: none
    assert gemm_tune.rotation_copies(20 * mb, 40 * mb, 50 * mb, 400 * mb) == 3  # 100 MB: two copies
    big = gemm_tune.TUNE_COPY_BUDGET
    assert gemm_tune.rotation_copies(10 * mb, big // 2, 50 * mb, 100 * 2**30) == 3  # byte budget: 2 copies
    assert gemm_tune.rotation_copies(0, 0, 0, 0) == 1


def test_gemm_operand_copies_are_fresh_memory():
    import dataclasses

    w = _weight(32, 256)
    ops = gemm._weight_parts(w, False) + (None, None, None)
    copy = gemm_tune._clone_operands(ops)
    for a, b in zip(ops[:3], copy[:3]):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert copy[3:] == (None, None, None)
    @dataclasses.dataclass
    class W:
        wt: torch.Tensor
        st: torch.Tensor
        n: int
        k: int

    wc = W(torch.zeros(4), torch.ones(2), 32, 256)
    dense = torch.ones(32, 256, dtype=torch.bfloat16)
    c = gemm_tune._clone_operands(ops[:3] + (wc, ops[0][0], dense))
    assert torch.equal(c[3].wt, wc.wt) and c[3].wt.data_ptr() != wc.wt.data_ptr() and c[3].n == 32
    assert c[4].data_ptr() != ops[0].data_ptr()
    assert torch.equal(c[5], dense) and c[5].data_ptr() != dense.data_ptr()
    from types import SimpleNamespace  # any object with the copy's fields

    c = gemm_tune._clone_operands(ops[:3] + (SimpleNamespace(wt=wc.wt, st=wc.st, n=32, k=256), None, None))
    assert torch.equal(c[3].st, wc.st) and c[3].st.data_ptr() != wc.st.data_ptr() and c[3].k == 256
    assert gemm_tune._operand_bytes(ops[:3] + (wc, ops[0][0], dense)) == (
        sum(t.nbytes for t in ops[:3]) + 16 + 8 + 4096 + 32 * 256 * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tuner_keeps_the_candidate_that_replays_fastest():
    """The tuner's pick replays (CUDA graph, rotated weights: as the sampler runs it) within 10% of the
    fastest of its candidates timed independently; its weight copies are freed. 4096x14336 at 64 rows, where
    single launches after an L2 flush kept a Triton configuration 20% slower than the wgmma build."""
    from types import SimpleNamespace

    from fp4rl.benchmarks.gpu_kernels import copies_for, time_calls
    from fp4rl.kernels import gemv_cuda

    n, k, m = 4096, 14336, 64
    w = _weight(n, k, seed=5)
    mma16 = gemv_cuda.relayout(w.data, w.block_scale) if gemv_cuda.available() else None
    x = _x(m, k, seed=5)
    gemm_tune._TUNED.clear()
    gemm_tune.TUNE_LOG.clear()
    wm = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=mma16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = gemm.gemm(x, wm)
    torch.cuda.synchronize()
    # the rotation's copies (4+ of 66 MB) are gone; what stays is y and the split-K workspace (13 MB)
    assert torch.cuda.memory_allocated() - before < w.data.nbytes and y.shape == (m, n)
    (key, log), = gemm_tune.TUNE_LOG.items()
    timed = [(c, t) for c, t in log if not isinstance(t, str)]
    assert len(timed) >= 2
    pick = gemm_tune._TUNED[key]
    ops = gemm._weight_parts(wm, False) + (mma16, None, None)
    sets = [ops] + [gemm_tune._clone_operands(ops) for _ in range(copies_for(w.data.nbytes) - 1)]
    ws = [SimpleNamespace(data=d[0], block_scale=s[0], global_scale=g, mma16=c) for d, s, g, c, _, _ in sets]

    def replay(c):
        return time_calls([lambda w=w: gemm.gemm(x, w, config=c) for w in ws])

    best = min(replay(c) for c, _ in timed)
    assert replay(pick) <= 1.1 * best, (pick, log)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 64, 200, 512])
def test_gpu_shapes_every_config(m):
    n, k = 4096, 14336  # a benchmark shape (its kernels are then compiled once)
    w = _weight(n, k, seed=m)
    x = _x(m, k, seed=m)
    ref = x.double() @ reference.dequantize(w).double().T
    for cfg in gemm_tune.candidate_configs(m, n, k // 2, x.device) + [gemm_tune.FALLBACK]:
        for _ in range(3):  # split-K reduction through counters: must not race
            y = gemm.gemm(x, w, config=cfg)
            assert _rel(y, ref) < (TOL_BF16 if cfg == gemm_tune.FALLBACK else TOL), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_asm_unpack_equals_arithmetic():
    w = _weight(256, 512, seed=9)
    x = torch.eye(512, dtype=torch.bfloat16, device=DEV)[:64]  # y = rows of DQ(W).T (exact)
    y = gemm.gemm(x, w, config=dict(SWAP=False, BM=64, BN=64, BK=128, SPLIT_K=1, num_warps=4, num_stages=2))
    want = (gemm.dequantize(w.data, w.block_scale, w.global_scale, torch.float32).T[:64]).bfloat16()
    assert torch.equal(y, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,kw", [(100, 224, {}), (37, 1056, {"scale_scope": "row"}), (512, 4096, {})])
def test_gpu_gluon_gemv_every_config(n, k, kw):
    """The tensor-core GEMV for 1-4 rows, both code layouts, every candidate (masked edges too); 6 and
    16 rows (which it computes, but the dispatcher leaves to the Triton kernels) with the first one."""
    from types import SimpleNamespace

    from fp4rl.kernels import gemv

    if not gemv.available():
        pytest.skip(f"Gluon unavailable: {gemv.STATE['error']}")
    w = _weight(n, k, seed=n, **kw)
    swz = gemv.swizzle(w.data)
    assert torch.equal(gemv.unswizzle(swz), w.data)
    w32 = SimpleNamespace(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, gemv32=swz)
    for m in (1, 2, 3, 4):
        x = _x(m, k, seed=m + n)
        ref = x.double() @ reference.dequantize(w).double().T
        for layout, wt in ((0, w), (1, w32)):
            cands = gemm_tune.candidate_configs(m, n, k // 2, x.device, w4a16=True, layout=layout)
            assert cands[0]["KIND"] == "gemv_mma"
            for c in cands:
                for _ in range(2):  # split-K counters must reset
                    y = gemm.gemm(x, wt, config=c)
                    assert _rel(y, ref) < TOL, c
        assert _rel(gemm.gemm(x, w32), ref) < TOL  # tuned dispatch with the gemv32 copy
    for m in (6, 16):
        x = _x(m, k, seed=m + n)
        ref = x.double() @ reference.dequantize(w).double().T
        cfg = dict(KIND="gemv_mma", LAYOUT=1, **gemv.configs_mma(n, k // 2, 132, m)[0])
        from fp4rl.kernels.gemm import _WORKSPACE

        y = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
        g = w.global_scale.float().reshape(-1).contiguous()
        gemv.launch_mma(x, swz, w.block_scale.view(torch.uint8), g, y, cfg, _WORKSPACE, layout=1)
        assert _rel(y, ref) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dense_copy_is_weighed_against_the_cuda_kernel():
    """A weight with its mma16 copy and a dense copy (Sampler(dense_rows=)): at 1-16 rows the mma16 kernel
    runs as without the dense copy (nothing timed); at the wgmma's rows the tuner times DENSE and WIDE (no
    FALLBACK) and either gives the product."""
    from types import SimpleNamespace

    from fp4rl.kernels import gemv_cuda

    if not (gemv_cuda.available() and gemv_cuda.wide_available()):
        pytest.skip("needs the CUDA mma16 kernel and its wgmma build (sm_90)")
    n, k = 4096, 4096
    w = _weight(n, k, seed=7)
    m16 = gemv_cuda.relayout(w.data, w.block_scale)
    dense = gemm.dequantize(w.data, w.block_scale, w.global_scale)
    parts = dict(data=w.data, block_scale=w.block_scale, global_scale=w.global_scale, mma16=m16)
    wd, wm = SimpleNamespace(dense=dense, **parts), SimpleNamespace(**parts)
    gemm_tune._TUNED.clear()
    gemm_tune.TUNE_LOG.clear()
    x8 = _x(8, k, seed=1)
    assert torch.equal(gemm.gemm(x8, wd), gemm.gemm(x8, wm)) and not gemm_tune.TUNE_LOG
    x32 = _x(32, k, seed=2)
    ref = x32.double() @ dense.double().T
    y = gemm.gemm(x32, wd)
    (key, log), = gemm_tune.TUNE_LOG.items()
    assert key[gemm_tune.KEY_WIDE] and key[gemm_tune.KEY_DENSE]
    timed = [c for c, t in log if not isinstance(t, str)]
    assert timed[:2] == [gemm_tune.DENSE, gemm_tune.WIDE] and gemm_tune.FALLBACK not in timed, log
    assert _rel(y, ref) < TOL
    for c in (gemm_tune.DENSE, gemm_tune.WIDE):
        assert _rel(gemm.gemm(x32, wd, config=c), ref) < TOL, c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tuner_keeps_its_picks_on_disk(monkeypatch, tmp_path):
    """A tuned pick is written to the disk cache; a later process (the tuner's and the cache's memory
    cleared) takes it from the file without timing any candidate."""
    from fp4rl.kernels import tune_cache

    monkeypatch.setenv("FP4RL_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(tune_cache, "_ENTRIES", {})
    monkeypatch.setattr(gemm_tune, "TUNE_MIN_BYTES", 0)  # (a weight this small is not timed otherwise)
    w = _weight(512, 1024, seed=3)
    x = _x(80, 1024, seed=3)
    gemm_tune._TUNED.clear()
    gemm_tune.TUNE_LOG.clear()
    y = gemm.linear(x, w)
    (key, log), = gemm_tune.TUNE_LOG.items()
    assert len([t for _, t in log if not isinstance(t, str)]) >= 2  # timed
    pick = gemm_tune._TUNED[key]
    (path,) = tmp_path.glob("*.json")  # beside it, the store's lock file
    assert tune_cache.key_str(key) in json.loads(path.read_text())
    gemm_tune._TUNED.clear()
    gemm_tune.TUNE_LOG.clear()
    tune_cache._ENTRIES.clear()
    assert torch.equal(gemm.linear(x, w), y)
    assert gemm_tune._TUNED[key] == pick and not gemm_tune.TUNE_LOG  # from the file, nothing timed
