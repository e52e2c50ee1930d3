"""Triton NVFP4 quantize vs the plain-torch reference: byte-identical codes, block scales and
global scales for every deterministic mode; stochastic rounding tested statistically.

On a machine without CUDA the kernels run in Triton's CPU interpreter (small shapes); with
CUDA they run compiled, and the `gpu` tests add large shapes."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels.quantize import cuda as quant_cuda  # noqa: E402
from fp4rl.kernels.quantize import quantize_2d  # noqa: E402
from fp4rl.nvfp4 import reference  # noqa: E402
from fp4rl.nvfp4 import triton as tq  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["cuda", "triton"] if torch.cuda.is_available() else ["triton"])
def kernels(request, monkeypatch):
    """On a GPU every test runs twice: with the CUDA C++ kernels (quantize_2d's default there for 1x16
    round-to-nearest on bf16 / fp32) and with them off, so that the Triton kernels keep their byte checks."""
    monkeypatch.setitem(quant_cuda.STATE, "on", request.param == "cuda")
    yield request.param


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


@pytest.mark.parametrize("nbc,blocks", [(8, 128), (8, 256), (2, 32), (1, 16)])
def test_16x16_tiles_by_program_shape(nbc, blocks, monkeypatch):
    """The 16x16 kernel at the GPU's program shapes (8 tiles wide, 128 / 256 blocks) and narrower ones, on
    rows that leave a program's columns or tile rows partly masked: the reference's bytes in every mode."""
    import fp4rl.kernels.quantize as kq

    monkeypatch.setitem(kq.TILE16, "nbc", nbc)
    monkeypatch.setitem(kq.TILE16, "blocks", blocks)
    for kind, dtype in (("wide", torch.bfloat16), ("grid", torch.float32), ("zero", torch.float32)):
        x = _data(kind, (48, 80), dtype, seed=nbc)
        for kw in (dict(), dict(scale_rule="4/6"), dict(scale_rule="4/6", err="mae"),
                   dict(scale_rule="4/6", amax=torch.tensor(3.0, device=DEV)),
                   dict(scale_rule="4/6", global_scale=torch.tensor(0.002, device=DEV))):
            _same(tq.quantize(x, tile=(16, 16), **kw), reference.quantize(x, tile=(16, 16), **kw))
    x = _data("wide", (32, 48), torch.float32)
    x[3, 5], x[17, 1], x[30, 40] = float("nan"), float("inf"), -float("inf")
    kw = dict(tile=(16, 16), scale_rule="4/6", allow_nonfinite=True)
    _same(tq.quantize(x, **kw), reference.quantize(x, **kw))
    with pytest.raises(ValueError, match="NaN or Inf"):
        tq.quantize(x, tile=(16, 16))


def _tree_order_tile():
    """A 16x16 tile whose 4/6 pick depends on the order of its 16-row error tree (u = 2^-30, ulp(0.25) = 32u;
    amax 6, rule 4/6: S_enc 256, s6 256, s4 384, every decode exact). Row 1 (four 1.0) costs only 4: 0.25; row
    2 (4.5) only 6: 0.25; rows 3 (2^-13) and 4 (5 2^-15) 16u and 25u to both, at ties and near-ties of
    ulp(0.25). TE's order (rows r + r+8 first): err4 = 0.25 + 32u < err6 = 0.25 + 64u, 4 wins; rows (2j,
    2j+1) first: the other way round."""
    x = torch.zeros(16, 16)
    x[0, 0] = 6.0
    x[1, :4] = 1.0
    x[2, 0] = 4.5
    x[3, 0] = 2.0 ** -13
    x[4, 0] = 5 * 2.0 ** -15
    return x


@pytest.mark.parametrize("nbc,blocks", [(None, None), (8, 128), (1, 16), (4, 64)])
@pytest.mark.parametrize("k", [16, 64])
def test_16x16_tile_tree_order(nbc, blocks, k, monkeypatch):
    """The 16 rows' errors are summed in TE's tree order: this tile's pick flips under any other pairing."""
    import fp4rl.kernels.quantize as kq

    monkeypatch.setitem(kq.TILE16, "nbc", nbc)
    monkeypatch.setitem(kq.TILE16, "blocks", blocks)
    x = torch.cat([_tree_order_tile()] * (k // 16), 1)
    x = torch.cat([x, x * 0.5], 0).to(DEV)  # a second tile row (every error scales by 1/4: still exact)
    for kw in (dict(tile=(16, 16), scale_rule="4/6"),
               dict(tile=(16, 16), scale_rule="4/6", global_scale=torch.tensor(2.0 ** -8, device=DEV))):
        ref = reference.quantize(x, **kw)
        assert ref.block_scale.float()[0, 0].item() == 384.0  # the reference picks 4 here
        _same(tq.quantize(x, **kw), ref)


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
    with pytest.raises(ValueError, match="16x16"):  # one imposed value per row: not a per-tensor scale
        quantize_2d(torch.ones(16, 32, device=DEV), tile16=True, amax=torch.ones(16, device=DEV))


def test_tile16_program_shape_must_be_powers_of_two(monkeypatch):
    """(The Triton kernel's TILE16 settings: with the CUDA kernels off, which take 16x16 4/6 on a GPU.)"""
    import fp4rl.kernels.quantize as kq

    monkeypatch.setitem(quant_cuda.STATE, "on", False)
    monkeypatch.setitem(kq.TILE16, "blocks", 384)
    with pytest.raises(ValueError, match="powers of two"):
        quantize_2d(torch.ones(16, 32, device=DEV), tile16=True)


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


_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
# block values in units of the block's scale-6 step 2^j; 6-grid midpoints (0.25, 0.75, ...) are exact
# ties of the encode (its factor 2^-j is exact), the 4-grid midpoints (V / 1.5 = 0.25, 0.75, ...:
# V = 0.375, 1.125, ...) are left out (the 4 candidate's factor 1 / (1.5 2^j) is rounded)
_V = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0]
_TIES = [[4.5, 4.0], [5.5], [4.5, 1.0, 2.0], [3.0, 1.5], [], [5.5, 5.5, 4.5, 4.0]]  # err4 == err6


def _e2m1_rne(y):
    """float64 y >= 0 (scaled) -> nearest E2M1 grid value, ties to the even code, saturating at 6."""
    d = (y.clamp(max=6.0)[..., None] - _GRID).abs()
    key = d + (torch.arange(8) % 2) * 1e-9  # exact dyadic distances: the tie break only picks the even code
    return _GRID[key.argmin(-1)]


def _crafted_46(rows, nb, t_rows, seed):
    """x [rows, nb * 16] float32 whose every block is exact under both candidate scales' arithmetic:
    row r's amax is 1536 2^t_r (so S_enc = 2^-t_r), block (r, b) has amax 6 2^(j + t_r) (s6 = 2^j,
    s4 = 1.5 2^j, both E4M3), and values V 2^(j + t_r), V from _V. Returns x, the exact per-block errors
    of both candidates (float64, MSE and MAE, in units of 2^(j + t_r)), and j."""
    g = torch.Generator().manual_seed(seed)
    v = torch.zeros(rows, nb, 16, dtype=torch.float64)
    j = torch.randint(-8, 8, (rows, nb), generator=g)
    j[:, 0] = 8  # the row amax: 6 * 2^8 * 2^t = 1536 * 2^t
    vals = torch.tensor(_V, dtype=torch.float64)
    for r in range(rows):
        for b in range(nb):
            kind = (r * nb + b) % 4
            if kind == 0:  # a crafted tie (zero or not)
                tie = _TIES[(r * nb + b) // 4 % len(_TIES)]
                v[r, b, 1:1 + len(tie)] = torch.tensor(tie, dtype=torch.float64)
            else:  # random, sparse or dense
                n = [3, 6, 15][kind - 1]
                v[r, b, 1:1 + n] = vals[torch.randint(0, len(_V), (n,), generator=g)]
            v[r, b] = v[r, b, torch.randperm(16, generator=g)]
            v[r, b, torch.randint(0, 16, (1,), generator=g)] = 6.0  # the block max (others <= 6)
    v = v * torch.where(torch.rand(v.shape, generator=g) < 0.5, -1.0, 1.0)
    d6 = _e2m1_rne(v.abs()) - v.abs()
    d4 = _e2m1_rne(v.abs() / 1.5) * 1.5 - v.abs()
    errs = {"mse": ((d6 * d6).sum(-1), (d4 * d4).sum(-1)), "mae": (d6.abs().sum(-1), d4.abs().sum(-1))}
    unit = torch.pow(2.0, (j + torch.tensor(t_rows)[:, None]).double())
    x = (v * unit[..., None]).reshape(rows, nb * 16).float()
    return x, errs, j


@pytest.mark.parametrize("scope", ["tensor", "row"])
@pytest.mark.parametrize("err", ["mse", "mae"])
def test_4over6_pick_and_ties(scope, err):
    """Blocks that pick 4, keep 6, and tie exactly (zero and nonzero errors: 6 must win), per tensor and
    per row, with amaxes inside and outside the division-free x / 1536 range (2^-70 .. 2^100), against
    the reference byte for byte and against the exact errors."""
    rows, nb = 24, 8
    if scope == "tensor":
        t_rows = [0] * rows
    else:  # per-row amaxes 1536 2^t: ordinary, tiny and huge rows mixed within one program
        t_rows = [[0, -3, 5, -90, 100, 2][r % 6] for r in range(rows)]
    x, errs, j = _crafted_46(rows, nb, t_rows, seed=7)
    e6, e4 = errs[err]
    pick4 = e4 < e6
    tie = e4 == e6
    assert pick4.any() and (e4 > e6).any() and (tie & (e6 > 0)).any() and (tie & (e6 == 0)).any()
    want_s = torch.pow(2.0, j.double()) * torch.where(pick4, 1.5, 1.0)
    # squares of the tiny / huge rows' errors underflow / overflow in float32: no exact premise there
    known = (torch.tensor(t_rows).abs() <= 20) | (err == "mae")
    kws = [dict(scale_rule="4/6", err=err, scale_scope=scope)]
    if scope == "row":
        amax = (1536.0 * torch.pow(2.0, torch.tensor(t_rows, dtype=torch.float64))).float()[:, None]
        kws.append(dict(kws[0], amax=amax.to(DEV)))  # imposed per-row amax: the flat kernel, per block
    else:
        # imposed g: decoded = values * g
        kws.append(dict(kws[0], global_scale=torch.tensor(1.0, device=DEV)))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(DEV)
        assert torch.equal(xd.float().cpu(), x)  # exact in bf16 too
        for kw in kws:
            q = tq.quantize(xd, **kw)
            _same(q, reference.quantize(xd, **kw))
            assert torch.equal(q.block_scale.float().cpu().double()[known], want_s[known])


@pytest.mark.parametrize("scope", ["tensor", "row"])
def test_4over6_nonfinite_blocks(scope):
    """NaN (code 0, error NaN: 6 kept) and +-Inf (+-6, infinite errors: 6 kept) inside blocks that would
    otherwise pick 4 or tie, with allow_nonfinite, MSE and MAE."""
    x, _, _ = _crafted_46(16, 4, [0, 4, -2, 1] * 4, seed=2)
    x[1, 3], x[2, 17], x[5, 40] = float("nan"), float("inf"), -float("inf")
    x[7, 0:16] = float("nan")  # an all-NaN block
    x[9, 16:18] = torch.tensor([float("inf"), float("nan")])
    for err in ("mse", "mae"):
        kw = dict(scale_rule="4/6", err=err, scale_scope=scope, allow_nonfinite=True)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype).to(DEV)
            _same(tq.quantize(xd, **kw), reference.quantize(xd, **kw))
