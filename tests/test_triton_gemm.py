"""W4A16 / W4A4 GEMMs on packed NVFP4 weights vs the reference dequantize + a float matmul.

The kernels multiply exact (e2m1 * block_scale) bfloat16 operands with an FP32 accumulator and
apply the global scale(s) to the accumulator, so against the float64 product of the reference
dequantized operands the only error is the bfloat16 output rounding (plus accumulation order):
a relative error ~2^-8/sqrt(3). The dequantize-then-matmul fallback also rounds every
weight to bfloat16 first, so it gets the looser bfloat16 GEMM bound. Runs in Triton's CPU
interpreter when there is no CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import gemm  # noqa: E402
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
    y_fb = gemm.gemm(x, w, config=gemm.FALLBACK)  # reference dequantize -> bf16, then matmul
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
    w = NVFP4Tensor(data=torch.stack([q.data for q in ws]),
                    block_scale=torch.stack([q.block_scale for q in ws]),
                    global_scale=torch.stack([q.global_scale for q in ws]),
                    shape=torch.Size((e, n, k)), dtype=torch.float32)
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
    w = NVFP4Tensor(data=torch.stack([q.data for q in ws]),
                    block_scale=torch.stack([q.block_scale for q in ws]),
                    global_scale=torch.stack([q.global_scale for q in ws]),
                    shape=torch.Size((e, n, k)), dtype=torch.float32)
    x = _x(4, k, seed=7)  # 4 tokens, 2 experts each: 8 sorted rows, tokens repeated
    rows = torch.tensor([0, 2, 3, 0, 1, 1, 2, 3], dtype=torch.int32, device=DEV)
    offsets = torch.tensor([0, 3, 6, 8], dtype=torch.int32, device=DEV)
    want = gemm.gemm(x.index_select(0, rows), w, offsets=offsets, tokens=4)
    assert torch.equal(gemm.gemm(x, w, offsets=offsets, tokens=4, rows=rows), want)
    with pytest.raises(ValueError, match="grouped W4A16"):
        gemm.gemm(x, ws[0], rows=rows)
    with pytest.raises(TypeError, match="int32"):
        gemm.gemm(x, w, offsets=offsets, rows=rows.long())


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 64, 200, 512])
def test_gpu_shapes_every_config(m):
    n, k = 4096, 14336  # a benchmark shape (its kernels are then compiled once)
    w = _weight(n, k, seed=m)
    x = _x(m, k, seed=m)
    ref = x.double() @ reference.dequantize(w).double().T
    for cfg in gemm.candidate_configs(m, n, k // 2, x.device) + [gemm.FALLBACK]:
        for _ in range(3):  # split-K reduction through counters: must not race
            y = gemm.gemm(x, w, config=cfg)
            assert _rel(y, ref) < (TOL_BF16 if cfg == gemm.FALLBACK else TOL), cfg


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
            cands = gemm.candidate_configs(m, n, k // 2, x.device, w4a16=True, layout=layout)
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
