"""fp4rl.kernels.prenorm: the arithmetic of the residual add + RMSNorm that the CUDA router's and the dense
mma16 GEMM's PRENORM builds fold into their launches (their GPU tests hold the kernels to it bit for bit)."""

import pytest
import torch

from fp4rl.kernels import prenorm
from fp4rl.model import RMSNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _scalar_sumsq(xs, t):
    """One row's PRENORM sum of squares scalar by scalar in numpy float32 (the builds' order): lane l of
    warp w adds its chunks c = l + 32 i (i = w, w + 8, .. ascending, 8 squares each in order), the xor
    butterfly adds the lanes, the warps' sums are added in warp order."""
    import numpy as np

    row = xs[t].float().cpu().numpy().astype(np.float32)
    nch = -(-row.size // 256)
    row = np.concatenate([row, np.zeros(256 * nch - row.size, np.float32)])
    total = None
    for w in range(8):
        lanes = []
        for lane in range(32):
            acc = np.float32(0)
            for i in range(w, nch, 8):
                for el in range(8):
                    v = row[8 * (lane + 32 * i) + el]
                    acc = np.float32(acc + np.float32(v * v))
            lanes.append(acc)
        for m in (16, 8, 4, 2, 1):
            lanes = [np.float32(lanes[lane] + lanes[lane ^ m]) for lane in range(32)]
        total = lanes[0] if total is None else np.float32(total + lanes[0])
    return float(total)


@pytest.mark.parametrize("t,h", [(1, 2048), (4, 2048), (3, 296), (2, 4096), (1, 64)])
def test_reference_is_the_residual_add_and_rmsnorm(t, h):
    """prenorm.reference (the PRENORM builds' arithmetic, which the GPU tests hold the kernels to): x' =
    bf16(x + h) exactly; its sum of squares in the kernels' lane / warp order (a scalar emulation of two
    rows); y within a bf16 ulp of fp4rl.model's RMSNorm of x' (the sum's order, IEEE sqrt and division
    instead of rsqrt) and equal in >= 98% of the elements."""
    g = torch.Generator().manual_seed(t * 13 + h)
    x = (torch.randn(t, h, generator=g) * 2).bfloat16().to(DEV)
    hh = torch.randn(t, h, generator=g).bfloat16().to(DEV)
    norm = RMSNorm(h, 1e-6).bfloat16().to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=g) + 0.5)
    xs, y = prenorm.reference(x, hh, norm.weight, 1e-6)
    assert torch.equal(xs, (x.float() + hh.float()).bfloat16())
    sums = prenorm.sumsq(xs)
    for row in {0, t - 1}:
        assert _scalar_sumsq(xs, row) == float(sums[row]), row
    with torch.no_grad():
        ref = norm(xs)
    a, b = y.view(torch.int16).int(), ref.view(torch.int16).int()
    assert int((a - b).abs().max()) <= 1 and (y == ref).float().mean().item() >= 0.98


def test_float_parameters_travel_as_their_float32_bits():
    """f32_bits: the float32 rounding of the value (RNE) as a signed int, as the kernels reinterpret it."""
    for v in (1.0 / 4096, 1e-6, 1.0 / 2048, -2.5, 3.0e38):
        want = torch.tensor([v], dtype=torch.float32).view(torch.int32).item()
        assert prenorm.f32_bits(v) == want, v


def test_check_refuses_what_the_builds_cannot_read():
    """check: h of another shape / dtype, a norm weight of another width, dtype or not contiguous."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    prenorm.check(x, x.clone(), w, "t")
    with pytest.raises(ValueError, match="h must be bfloat16"):
        prenorm.check(x, x.float(), w, "t")
    with pytest.raises(ValueError, match="h must be bfloat16"):
        prenorm.check(x, x[:1], w, "t")
    with pytest.raises(ValueError, match="norm_weight must be"):
        prenorm.check(x, x, w[:32], "t")
    with pytest.raises(ValueError, match="norm_weight must be"):
        prenorm.check(x, x, w.float(), "t")
    with pytest.raises(ValueError, match="norm_weight must be"):
        prenorm.check(x, x, torch.ones(128, dtype=torch.bfloat16)[::2], "t")


def test_check_moe_refuses_what_the_combine_build_cannot_read():
    """check_moe: d [T k, H] bfloat16, pos [T k] int32 contiguous, w [T, k <= 16] bf16 / fp32 with unit column
    stride; what it returns is what the launch passes (pos flattened)."""
    t, k, hd = 2, 4, 64
    x = torch.zeros(t, hd, dtype=torch.bfloat16)
    nw = torch.ones(hd, dtype=torch.bfloat16)
    d = torch.zeros(t * k, hd, dtype=torch.bfloat16)
    pos = torch.arange(t * k, dtype=torch.int32)
    w = torch.ones(t, k, dtype=torch.bfloat16)
    dd, pp, ww = prenorm.check_moe(x, (d, pos.view(t, k), w), nw, "t")
    assert dd is d and pp.shape == (t * k,) and ww is w
    bad = [((d[:-1], pos, w), "moe d must be"), ((d.float(), pos, w), "moe d must be"),
           ((d, pos.long(), w), "moe pos must be"), ((d, pos[:-1], w), "moe pos must be"),
           ((d, pos, w.half()), "moe w must be"), ((d, pos, w.t().contiguous().t()), "moe w must be"),
           ((d, pos, torch.ones(t, 17, dtype=torch.bfloat16)), "moe w must be"), ((d, pos), "moe must be")]
    for moe, msg in bad:
        with pytest.raises(ValueError, match=msg):
            prenorm.check_moe(x, moe, nw, "t")
