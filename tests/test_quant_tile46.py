"""quant.cu's 16x16-tile 4/6 decision (nvfp4_quant_tile16 with FAST46 3: decide46 per tile, tile46_decide) run
on the CPU, tile by tile against fp4rl.nvfp4.reference: the kernel file compiled by g++ as in
tests/test_quant_fast46.py (its host_builder; the harness quantize_tiles_host loops over a tile's 16 lanes
and sums in the shuffles' pairs). The GPU runs the kernel itself (tests/test_quant_cuda.py)."""

import shutil

import pytest
import torch

from fp4rl.nvfp4 import reference
from tests.test_quant_fast46 import PARAMS, _v, adjacent_flips, host_builder

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the kernel source as C++)")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return host_builder(tmp_path_factory.mktemp("tile46"))


def check_tiles(build, x, v, mae, src, nf=False):
    """The tile path's bytes (host build, FAST46 3) equal the reference's for x [16 n, 16 m]; returns the
    tiles tile46_decide decided."""
    x = x.contiguous()
    lib = build(mae, src, x.dtype == torch.float32, 3, nf)
    n_blk = x.numel() // 16
    codes = torch.empty(n_blk, 8, dtype=torch.uint8)
    sb = torch.empty(n_blk, dtype=torch.uint8)
    known = lib.quantize_tiles_host(x.data_ptr(), x.shape[0] // 16, x.shape[1] // 16, float(v),
                                    codes.data_ptr(), sb.data_ptr())
    kw = dict(scale_rule="4/6", err="mae" if mae else "mse", allow_nonfinite=nf, tile=(16, 16))
    kw["amax" if src == 0 else "global_scale"] = torch.tensor(v)
    q = reference.quantize(x, **kw)
    rd, rs = q.data.reshape(-1, 8), q.block_scale.view(torch.uint8).reshape(-1)
    bad = (codes != rd).any(1) | (sb != rs)
    assert not bad.any(), f"{int(bad.sum())} of {len(bad)} blocks differ, first {bad.nonzero()[:5].tolist()}"
    return known


@pytest.mark.parametrize("mae,src", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_decided_by_the_summed_bound(build, mae, src, dtype):
    """Random 16x16 tiles, tiles whose blocks span 12 decades below the tile's max (tiny blocks beside the
    max one), and all-zero tiles: the reference's bytes, and the summed bound decides nearly every ordinary
    tile."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16 * 32, 16 * 8, generator=g) * torch.logspace(-2, 2, 32).repeat_interleave(16)[:, None]
    x = x.to(dtype)
    n_tiles = x.numel() // 256
    assert check_tiles(build, x, _v(x, src), mae, src) >= 0.99 * n_tiles
    y = torch.randn(16 * 8, 16 * 4, generator=g) * torch.logspace(-12, 0, 16).repeat(8)[:, None]
    y[16:32] = 0.0
    y = y.to(dtype)
    assert check_tiles(build, y, _v(y, src), mae, src) >= 0.5 * (y.numel() // 256)


def tile_scale_bytes(x: torch.Tensor, t: torch.Tensor, v: float, mae: bool, src: int) -> torch.Tensor:
    """The reference's scale byte of each 16x16 tile of x [n, 16, 16], its rows 8..15 multiplied by t [n]."""
    kw = dict(scale_rule="4/6", err="mae" if mae else "mse", tile=(16, 16))
    kw["amax" if src == 0 else "global_scale"] = torch.tensor(v)
    return reference.quantize(scaled_rows(x, t), **kw).block_scale.view(torch.uint8)[::16, 0]


def scaled_rows(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    xt = x.clone()
    xt[:, 8:] *= t[:, None, None]
    return xt.reshape(-1, 16)


@pytest.mark.parametrize("mae,src", PARAMS)
def test_tile_near_ties_found_by_bisection(build, mae, src):
    """Tiles on both sides of a flip of the reference's choice: rows 8..15 of each tile scaled by t, scanned
    over (0.02, 0.98) for a flip (the tile's max, element (0, 0), stays put and with it the candidates'
    scales), then bisected over t's float32 bit patterns to adjacent values. The summed bound must send most
    of them to the exact errors and the tree order: the reference's bytes on both sides (with no margin, 5% of
    these tiles take the wrong candidate and this test fails)."""
    n = 512  # rows 0..7 favour 6 (two values a row near its grid), rows 8..15 favour 4 (all near its grid)
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    x = torch.zeros(n, 16, 16)
    x[:, :8, :2] = grid[torch.randint(0, 6, (n, 8, 2), generator=g)]
    x[:, 8:, :] = grid[torch.randint(0, 6, (n, 8, 16), generator=g)] * 1.5
    x = x * torch.where(torch.rand(n, 16, 16, generator=g) < 0.5, -1.0, 1.0)
    x = x * (1 + 0.05 * torch.randn(n, 16, 16, generator=g))  # off the grids: no exact ties
    x[:, 0, 0] = 6.0
    x = x * 2.0 ** torch.randint(-6, 7, (n, 1, 1), generator=g).float()
    top = x[:, 0, 0]
    v = float(top.max()) if src == 0 else float(top.max()) / 1536.0
    points = [torch.full((n,), 0.02)]
    points += [torch.full((n,), float(f)) for f in torch.linspace(0.02, 0.98, 49)[1:]]
    keep, a, b = adjacent_flips(x, points, lambda x, t: tile_scale_bytes(x, t, v, mae, src), torch.float32)
    x = x[keep]
    m = int(keep.sum())
    assert m >= 100, m  # most tiles flip somewhere in range
    xa, xb = scaled_rows(x, a), scaled_rows(x, b)
    assert bool((tile_scale_bytes(x, a, v, mae, src) != tile_scale_bytes(x, b, v, mae, src)).all())
    known = check_tiles(build, torch.cat([xa, xb]), v, mae, src)
    assert known < 0.5 * 2 * m  # most of them left to the exact errors


@pytest.mark.parametrize("mae,src", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_on_both_grids_moved_by_ulps(build, mae, src, dtype):
    """Exact ties: every value on both candidates' grids ({1.5, 3, 6} sigma6 = {1, 2, 4} sigma4, s4 = 1.5
    s6), moved by a few ulps, some blocks tiny or zero; both candidates decode to the same values, so the
    reference keeps 6; the cheap errors are of the order of their own rounding, so only B (not the relative
    margins) keeps these tiles from a wrong 4 (with B = 0, float32 tiles take 4; a helper's review case)."""
    g = torch.Generator().manual_seed(11)
    n = 256
    vals = torch.tensor([0.0, 1.5, 3.0, 6.0])
    x = vals[torch.randint(0, 4, (n, 16, 16), generator=g)]
    x = x * torch.where(torch.rand(n, 16, 16, generator=g) < 0.5, -1.0, 1.0)
    x[:, 0, 0] = 6.0
    x = x.to(dtype)
    ulp = torch.randint(-3, 4, (n, 16, 16), generator=g, dtype=torch.int32)
    bits = x.view(torch.int16).to(torch.int32) if dtype == torch.bfloat16 else x.view(torch.int32)
    moved = torch.where(x != 0, bits + ulp, bits)
    moved[:, 0, 0] = bits[:, 0, 0]
    x = moved.to(torch.int16).view(torch.bfloat16) if dtype == torch.bfloat16 else moved.view(torch.float32)
    tiny = torch.rand(n, 16, generator=g) < 0.25
    x = torch.where(tiny[:, :, None], x * 2.0 ** -30, x)
    x = x * 2.0 ** torch.randint(-20, 21, (n, 1, 1), generator=g).to(dtype)
    # tiles side by side: [16, 16 n]
    x = x.permute(1, 0, 2).reshape(16, 16 * n).contiguous()
    # global amax = each tile's own: one tile column at a time
    for j in range(n):
        t = x[:, 16 * j:16 * (j + 1)].contiguous()
        check_tiles(build, t, _v(t, src), mae, src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_nonfinite_and_tree_order(build, dtype):
    """NaN / Inf in a tile (allow_nonfinite: the tile takes the exact errors), and TE's tree order (a tile
    whose pick flips under any other pairing of its rows, decided by the exact errors)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 64, generator=g)
    x[3, 5], x[20, 17], x[40, 50] = float("nan"), float("inf"), -float("inf")
    x[48:64, 32:48] = float("nan")
    x = x.to(dtype)
    v = float(torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    check_tiles(build, x, v, False, 0, nf=True)
    t = torch.zeros(16, 16)
    t[0, 0], t[2, 0], t[3, 0], t[4, 0] = 6.0, 4.5, 2.0 ** -13, 5 * 2.0 ** -15
    t[1, :4] = 1.0
    x = torch.cat([torch.cat([t] * 2, 1), torch.cat([t] * 2, 1) * 0.5]).to(dtype)
    assert reference.quantize(x, tile=(16, 16), scale_rule="4/6").block_scale.float()[0, 0] == 384.0
    check_tiles(build, x, 6.0, False, 0)
    check_tiles(build, x, 2.0 ** -8, False, 3)
