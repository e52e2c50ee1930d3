"""Triton NVFP4 quantize vs the plain-torch reference: byte-identical codes, block scales and
global scales for every deterministic mode; stochastic rounding tested statistically.

On a machine without CUDA the kernels run in Triton's CPU interpreter (small shapes); with
CUDA they run compiled, and the `gpu` tests add large shapes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels.quantize import quantize_2d  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.nvfp4 import triton as tq  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _same(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(a.data, b.data), f"{(a.data != b.data).sum().item()} code bytes differ"
    sa, sb = a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)
    assert torch.equal(sa, sb), f"{(sa != sb).sum().item()} block scales differ"
    assert a.global_scale.shape == b.global_scale.shape
    assert torch.equal(a.global_scale, b.global_scale)


def _data(kind, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "wide":  # many orders of magnitude, so blocks get very different scales
        x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    elif kind == "grid":  # E2M1 grid points and their midpoints: every rounding tie
        v = torch.arange(-48, 49, dtype=torch.float32) * 0.125
        x = v[torch.randint(0, v.numel(), shape, generator=g)]
        x.view(-1)[0] = 6.0
    elif kind == "zero":
        x = torch.zeros(shape)
        x[..., :16] = torch.randn(shape[:-1] + (16,), generator=g)  # one live block per row
        x[0] = 0.0  # an all-zero row
    elif kind == "max":
        x = torch.randn(shape, generator=g).sign() * torch.finfo(dtype).max
        x[..., 1::3] *= 0.3
    elif kind == "tiny":
        x = torch.randn(shape, generator=g) * 1e-30
    return x.to(dtype).to(DEV)


CASES = [  # (data, dtype, scale_rule, err, scope, tile)
    ("wide", torch.float32, "6", "mse", "tensor", 16),
    ("wide", torch.bfloat16, "6", "mse", "row", 16),
    ("grid", torch.float32, "6", "mse", "tensor", 16),
    ("wide", torch.float16, "4/6", "mse", "tensor", 16),
    ("wide", torch.bfloat16, "4/6", "mae", "row", 16),
    ("grid", torch.float32, "4/6", "mse", "row", 16),
    ("wide", torch.float32, "6", "mse", "tensor", (16, 16)),
    ("wide", torch.bfloat16, "4/6", "mse", "tensor", (16, 16)),
    ("grid", torch.float32, "4/6", "mae", "tensor", (16, 16)),
    ("zero", torch.float32, "4/6", "mse", "row", 16),
    ("zero", torch.bfloat16, "6", "mse", "tensor", (16, 16)),
    ("max", torch.bfloat16, "6", "mse", "tensor", 16),
    ("max", torch.float32, "4/6", "mse", "row", 16),
    ("tiny", torch.float32, "6", "mse", "row", 16),
]


@pytest.mark.parametrize("kind,dtype,rule,err,scope,tile", CASES)
def test_matches_reference(kind, dtype, rule, err, scope, tile):
    x = _data(kind, (32, 64), dtype)
    kw = dict(scale_rule=rule, err=err, scale_scope=scope, tile=tile)
    _same(tq.quantize(x, **kw), reference.quantize(x, **kw))


def test_4over6_really_picks_both():
    x = _data("wide", (16, 64), torch.float32, seed=3)
    q = tq.quantize(x, scale_rule="4/6")
    six = reference.quantize(x, scale_rule="4/6")
    _same(q, six)
    base = reference.quantize(x, scale_rule="6", global_scale=q.global_scale)  # same g, rule 6 scales
    changed = (base.block_scale.float() != q.block_scale.float()).float().mean().item()
    assert 0.0 < changed < 1.0  # some blocks chose 4, some kept 6


def test_imposed_scales_and_shapes():
    x = _data("wide", (2, 16, 48), torch.bfloat16, seed=1)
    amax = x.float().abs().amax(dim=-1, keepdim=True) * 0.5  # values beyond saturate
    _same(tq.quantize(x, scale_scope="row", amax=amax), reference.quantize(x, scale_scope="row", amax=amax))
    g = torch.tensor(0.01, device=DEV)
    kw = dict(scale_rule="4/6", global_scale=g)
    _same(tq.quantize(x, **kw), reference.quantize(x, **kw))
    x40 = x[..., :40]
    _same(tq.quantize(x40, pad=True), reference.quantize(x40, pad=True))
    got = tq.dequantize(tq.quantize(x40, pad=True))
    want = reference.dequantize(reference.quantize(x40, pad=True))
    assert got.shape == x40.shape and torch.equal(got, want)


def test_nonfinite():
    x = _data("wide", (16, 32), torch.float32)
    x[3, 5], x[7, 1], x[9, 30] = float("nan"), float("inf"), -float("inf")
    for scope in ("tensor", "row"):
        with pytest.raises(ValueError, match="NaN or Inf"):
            tq.quantize(x, scale_scope=scope)
        kw = dict(scale_scope=scope, allow_nonfinite=True, scale_rule="4/6")
        _same(tq.quantize(x, **kw), reference.quantize(x, **kw))


def test_dequantize_bit_exact():
    x = _data("wide", (32, 64), torch.float32, seed=5)
    for kw in (dict(), dict(scale_scope="row", scale_rule="4/6"), dict(tile=(16, 16))):
        q = reference.quantize(x, **kw)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(tq.dequantize(q, dtype), reference.dequantize(q, dtype))


@pytest.mark.parametrize("rule", ["6", "4/6"])
def test_stochastic_is_unbiased(rule):
    # 128 copies of one row: each element is rounded 128 times independently.
    row = (torch.randn(1, 64, generator=torch.Generator().manual_seed(7)) * torch.logspace(-1, 1, 64)).to(DEV)
    x = row.expand(128, 64).contiguous()
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = tq.quantize(x, rounding="stochastic", scale_rule=rule, generator=gen)
    nearest = reference.quantize(x, scale_rule=rule)
    assert torch.equal(q.global_scale, nearest.global_scale)
    dq, lo_hi = tq.dequantize(q), reference.dequantize(nearest)
    step = (dq - lo_hi).abs()
    # every value lands on one of the two grid neighbours of x
    scale = (q.block_scale.float().repeat_interleave(16, -1) * q.global_scale)
    assert bool((step <= 2 * scale * (1 + 1e-6)).all())
    mean = dq.mean(0)
    rel = (mean - row[0]).abs() / (scale[0] * 2)  # error of the mean in units of the largest step
    assert rel.mean().item() < 0.06 and rel.max().item() < 0.3  # sd of the mean <= 1/22 here
    assert not torch.equal(dq[0], dq[1])  # draws differ between rows
    gen2 = torch.Generator(device=DEV).manual_seed(0)
    q2 = tq.quantize(x, rounding="stochastic", scale_rule=rule, generator=gen2)
    _same(q, q2)  # reproducible for a given generator state


def test_quantize_2d_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_2d(torch.zeros(4, 24, device=DEV))
    with pytest.raises(ValueError, match="16x16"):
        quantize_2d(torch.zeros(8, 32, device=DEV), tile16=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule,err,scope,tile", [
    ("6", "mse", "tensor", 16), ("6", "mse", "row", 16), ("4/6", "mse", "tensor", 16),
    ("4/6", "mae", "row", 16), ("6", "mse", "tensor", (16, 16)), ("4/6", "mse", "tensor", (16, 16)),
])
def test_gpu_large(rule, err, scope, tile):
    for kind, dtype in (("wide", torch.bfloat16), ("grid", torch.float32), ("tiny", torch.float32)):
        x = _data(kind, (4096, 2048), dtype, seed=11)
        kw = dict(scale_rule=rule, err=err, scale_scope=scope, tile=tile)
        _same(tq.quantize(x, **kw), reference.quantize(x, **kw))
