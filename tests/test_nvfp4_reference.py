"""fp4rl.nvfp4 on its own: hand-computed examples, the format's pieces, options and errors.
(Byte-exactness against TE, torchao, ModelOpt and fouroversix is in test_nvfp4_oracles.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from fp4rl import nvfp4
from fp4rl.nvfp4 import reference

E2M1 = torch.tensor(nvfp4.E2M1_VALUES)


def gen(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def values_of(codes: torch.Tensor) -> torch.Tensor:
    return nvfp4.e2m1_codes_to_values(codes)


# ---- E2M1 codes, rounding, packing -----------------------------------------------------------
def test_code_table():
    codes = torch.arange(16, dtype=torch.uint8)
    v = values_of(codes)
    assert v[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert v[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(v[8]) and not torch.signbit(v[0])


def test_round_half_to_even_table():
    """MISSION.md: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; ties keep the
    code whose mantissa bit is 0; off a tie, the nearest value."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert values_of(nvfp4.round_to_e2m1(ties)).tolist() == expected
    assert values_of(nvfp4.round_to_e2m1(-ties)).tolist() == [-v for v in expected]
    below = torch.nextafter(ties, torch.zeros(()))
    above = torch.nextafter(ties, torch.full((), 10.0))
    assert values_of(nvfp4.round_to_e2m1(below)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4]
    assert values_of(nvfp4.round_to_e2m1(above)).tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]
    grid = E2M1.clone()
    assert torch.equal(nvfp4.round_to_e2m1(grid), torch.arange(8, dtype=torch.uint8))


def test_rounding_saturates_and_signs():
    z = torch.tensor([6.5, 7.0, 1e30, float("inf"), -1e30, float("-inf"), -0.0, -0.1, 0.1, float("nan")])
    assert nvfp4.round_to_e2m1(z).tolist() == [7, 7, 7, 7, 15, 15, 0x0, 0x8, 0x0, 0x0]


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    assert nvfp4.pack_fp4(codes).tolist() == [[0x21, 0x8F]]
    random_codes = torch.randint(0, 16, (3, 5, 32), generator=gen(1), dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_fp4(nvfp4.pack_fp4(random_codes)), random_codes)
    with pytest.raises(ValueError, match="even"):
        nvfp4.pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        nvfp4.pack_fp4(torch.zeros(4))


def _e4m3_values() -> torch.Tensor:
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def test_e4m3_cast_rounds_to_nearest_even_and_saturates():
    v = _e4m3_values()
    lo, hi = v[:-1], v[1:]
    mid = (lo + hi) / 2  # exact in fp32
    even_is_hi = torch.arange(1, 127) % 2 == 0  # the code of hi is even
    cast = nvfp4.cast_to_e4m3(mid).float()
    assert torch.equal(cast, torch.where(even_is_hi, hi, lo))
    assert torch.equal(nvfp4.cast_to_e4m3(torch.nextafter(mid, hi)).float(), hi)
    assert torch.equal(nvfp4.cast_to_e4m3(torch.nextafter(mid, lo)).float(), lo)
    assert torch.equal(nvfp4.cast_to_e4m3(v).float(), v)
    big = torch.tensor([448.0, 460.0, 464.0, 1e30, float("inf")])
    assert nvfp4.cast_to_e4m3(big).float().tolist() == [448.0] * 5


def test_true_div_is_a_correctly_rounded_division():
    t = torch.rand(10000, generator=gen(2)) * 100 + 1e-3
    exact = (2688.0 / t.double()).float()  # float64 quotient rounded once more is exact here
    assert torch.equal(nvfp4.format.true_div(2688.0, t), exact)
    assert torch.equal(nvfp4.format.true_div(t, 6.0), (t.double() / 6.0).float())


# ---- quantize: hand-computed example -------------------------------------------------------------
def test_hand_computed_example():
    """g = amax/2688 = 2^-12. Block 0 holds the amax: scale 448 and codes of its grid values.
    Block 1: max 6 * 2^-1 * 2^-12 -> scale 0.5 exactly; the other values are the RNE ties
    0.25 .. 5 (times the scale), rounded by MISSION.md's table."""
    unit = 2.0**-12
    block0 = torch.tensor([6.0, -4, 3, -2, 1.5, 1, 0.5, 0, 6, -6, 4, 3, 2, 1, -0.5, 0]) * 448 * unit
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0]
    block1 = torch.tensor([6.0] + ties) * 0.5 * unit
    x = torch.cat([block0, block1])[None]  # [1, 32]
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == unit and q.global_scale.shape == ()
    assert q.block_scale.float().tolist() == [[448.0, 0.5]]
    assert q.data.shape == (1, 16) and q.block_scale.shape == (1, 2)
    expected1 = [6.0, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 0]
    assert values_of(q.codes)[0, 16:].tolist() == expected1
    assert torch.equal(values_of(q.codes)[0, :16] * 448 * unit, block0)
    assert torch.equal(nvfp4.dequantize(q)[0, 16:], torch.tensor(expected1) * 0.5 * unit)
    assert q.nbytes == 16 + 2 + 4


def test_four_over_six_hand_examples():
    """amax = 1.5 -> g = 1.5/1536 = 2^-10; a block with max 6 * 2^-3 * g has s6 = 2^-3 and
    s4 = 1.5 * 2^-3. Values 0, 1.5, 3, 6 (x s6) are exact on both grids: a tie, 6 is kept.
    Values 6 and 4.5: the 6-grid rounds 4.5 to 4, the 4-grid holds 4 and 3 exactly: 4 wins."""
    g, s6 = 2.0**-10, 2.0**-3
    amax_block = torch.tensor([6.0 * 256] + [0.0] * 15) * g  # scale 256 (< 1.5 * 256 < 448)
    tied = torch.tensor([6.0, 3, 1.5, 0, -6, -3, -1.5, 0, 6, 3, 1.5, 0, -6, -3, -1.5, 0]) * s6 * g
    four = torch.tensor([6.0, 4.5] * 8) * s6 * g
    x = torch.cat([amax_block, tied, four])[None]
    for err in ("mse", "mae"):
        q = nvfp4.quantize(x, scale_rule="4/6", err=err)
        assert q.global_scale.item() == g
        assert q.block_scale.float()[0, 1:].tolist() == [s6, 1.5 * s6]
        assert torch.equal(nvfp4.dequantize(q)[0, 16:32], tied)
        assert values_of(q.codes)[0, 32:34].tolist() == [4.0, 3.0]
        assert torch.equal(nvfp4.dequantize(q)[0, 32:], four)
    assert values_of(nvfp4.quantize(x).codes)[0, 32:34].tolist() == [6.0, 4.0]  # rule 6


# ---- quantize / dequantize properties ------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {}, {"tile": (16, 16)}, {"scale_scope": "row"}, {"scale_rule": "4/6"},
    {"scale_rule": "4/6", "err": "mae", "tile": (16, 16)}, {"rounding": "stochastic", "generator": gen(0)},
])
def test_round_trip_error_is_bounded(kwargs):
    """|x - x'| <= (half the widest E2M1 gap, or a whole gap when stochastic) * s * g,
    where the widest gap (4 -> 6) is 2; and the SNR of N(0,1) data is what NVFP4 gives."""
    x = randn(64, 128, seed=3)
    q = nvfp4.quantize(x, **kwargs)
    y = nvfp4.dequantize(q)
    assert y.shape == x.shape and y.dtype == torch.float32
    step = q.block_scale.float().repeat_interleave(16, -1) * q.global_scale
    gap = 2.0 if kwargs.get("rounding") == "stochastic" else 1.0
    assert ((x - y).abs() <= gap * step * (1 + 1e-6)).all()
    snr = 10 * math.log10(x.pow(2).sum() / (x - y).pow(2).sum())
    assert snr > (14 if "rounding" in kwargs else 18)


def test_fake_quantize_keeps_dtype_and_equals_dequantize_quantize():
    x = randn(32, 64, seed=4).to(torch.bfloat16)
    y = nvfp4.fake_quantize(x, scale_rule="4/6")
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, nvfp4.dequantize(nvfp4.quantize(x, scale_rule="4/6"), torch.bfloat16))


def test_dtypes_read_as_float32():
    x = randn(16, 64, seed=5).to(torch.float16)
    a, b = nvfp4.quantize(x), nvfp4.quantize(x.float())
    assert torch.equal(a.data, b.data) and torch.equal(a.global_scale, b.global_scale)
    assert a.dtype == torch.float16 and b.dtype == torch.float32


def test_leading_dims():
    x = randn(2, 3, 32, 48, seed=6)
    flat = x.reshape(-1, 48)
    q, qf = nvfp4.quantize(x), nvfp4.quantize(flat)
    assert q.data.shape == (2, 3, 32, 24) and q.block_scale.shape == (2, 3, 32, 3)
    assert torch.equal(q.data.reshape(-1, 24), qf.data) and torch.equal(q.global_scale, qf.global_scale)
    r, rf = nvfp4.quantize(x, scale_scope="row"), nvfp4.quantize(flat, scale_scope="row")
    assert r.global_scale.shape == (2, 3, 32, 1)
    assert torch.equal(r.global_scale.reshape(-1, 1), rf.global_scale)
    assert torch.equal(r.data.reshape(-1, 24), rf.data)
    assert nvfp4.dequantize(r).shape == x.shape
    # 16x16 tiles tile each matrix of the batch; with the batch's amax imposed they match
    t = nvfp4.quantize(x, tile=(16, 16))
    amax = x.abs().amax()
    for i in range(2):
        ti = nvfp4.quantize(x[0, i], tile=(16, 16), amax=amax)
        assert torch.equal(t.data[0, i], ti.data) and torch.equal(t.block_scale[0, i], ti.block_scale)
    one_dim = nvfp4.quantize(randn(32, seed=7))
    assert one_dim.data.shape == (16,) and nvfp4.dequantize(one_dim).shape == (32,)


def test_16x16_tiles_make_the_transpose_identical():
    w = randn(64, 96, seed=8)
    q, qt = nvfp4.quantize(w, tile=(16, 16)), nvfp4.quantize(w.t().contiguous(), tile=(16, 16))
    assert torch.equal(q.codes.t(), qt.codes)
    tile_scales = q.block_scale.float()[::16]  # [64/16, 96/16]: one per tile
    assert torch.equal(q.block_scale.float(), tile_scales.repeat_interleave(16, 0))
    assert torch.equal(tile_scales.t(), qt.block_scale.float()[::16])
    assert torch.equal(nvfp4.dequantize(q).t(), nvfp4.dequantize(qt))
    # 1x16 blocks do not have that property
    assert not torch.equal(nvfp4.quantize(w).codes.t(), nvfp4.quantize(w.t().contiguous()).codes)


def test_padding_keeps_the_original_shape():
    x = randn(4, 40, seed=9)
    q = nvfp4.quantize(x, pad=True)
    assert q.shape == (4, 40) and q.data.shape == (4, 24) and q.block_scale.shape == (4, 3)
    padded = torch.nn.functional.pad(x, (0, 8))
    qp = nvfp4.quantize(padded)
    assert torch.equal(q.data, qp.data) and torch.equal(q.block_scale, qp.block_scale)
    assert torch.equal(nvfp4.dequantize(q), nvfp4.dequantize(qp)[:, :40])
    assert nvfp4.fake_quantize(x, pad=True).shape == x.shape


@pytest.mark.parametrize("kwargs", [
    {}, {"tile": (16, 16)}, {"scale_scope": "row"}, {"scale_rule": "4/6", "tile": (16, 16)},
    {"scale_rule": "4/6", "err": "mae", "scale_scope": "row"}, {"rounding": "stochastic"},
])
def test_row_groups_give_the_same_bytes(kwargs):
    """On one CPU thread the reference works through groups of rows (2^18 elements): the
    bytes are those of whole-tensor passes."""
    x = randn(96, 4096, seed=21)  # 96 * 4096 > 2^18: two groups, the second one partial
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            extra = {"generator": gen(5)} if "rounding" in kwargs else {}
            results.append(nvfp4.quantize(x, **kwargs, **extra))
    finally:
        torch.set_num_threads(threads)
    a, b = results
    assert torch.equal(a.data, b.data) and torch.equal(a.global_scale, b.global_scale)
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))


def test_all_zero_tensor():
    q = nvfp4.quantize(torch.zeros(16, 32))
    assert (q.data == 0).all() and (q.block_scale.float() == 0).all() and q.global_scale.item() == 0
    assert (nvfp4.dequantize(q) == 0).all()


# ---- imposed scales --------------------------------------------------------------------------------
def test_imposed_amax_reproduces_a_fused_group():
    """q, k, v sharing one global scale: quantizing each with the group amax gives the bytes
    of quantizing the concatenation."""
    q_w, k_w, v_w = randn(32, 64, seed=10), randn(16, 64, seed=11) * 3, randn(16, 64, seed=12) * 0.1
    fused = torch.cat([q_w, k_w, v_w])
    group = nvfp4.quantize(fused, scale_rule="4/6")
    amax = fused.abs().amax()
    parts = [nvfp4.quantize(w, scale_rule="4/6", amax=amax) for w in (q_w, k_w, v_w)]
    assert torch.equal(torch.cat([p.data for p in parts]), group.data)
    assert torch.equal(torch.cat([p.block_scale for p in parts]), group.block_scale)
    assert all(torch.equal(p.global_scale, group.global_scale) for p in parts)


def test_imposed_global_scale():
    x = randn(32, 64, seed=13)
    x[0, 0] = 2688 * 2.0**-9  # amax with an exact power-of-two decode scale 2^-9
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == 2.0**-9
    again = nvfp4.quantize(x, global_scale=q.global_scale)  # S_dec = g, S_enc = 1/g: exact here
    assert torch.equal(again.data, q.data) and torch.equal(again.block_scale, q.block_scale)
    # a larger imposed scale (e.g. the sampler's) is kept as given and still decodes x closely
    g = torch.tensor(3e-3)
    r = nvfp4.quantize(x, global_scale=g)
    assert r.global_scale.item() == g.item()
    y = nvfp4.dequantize(r)
    assert ((x - y).abs() <= r.block_scale.float().repeat_interleave(16, -1) * g * 1.0001).all()
    rows = nvfp4.quantize(x, scale_scope="row", global_scale=torch.full((32, 1), 1e-3))
    assert rows.global_scale.shape == (32, 1)


# ---- stochastic rounding ------------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    row = randn(1, 64, seed=14)
    x = row.expand(4096, 64).contiguous()  # every row: same scales, independent draws
    q = nvfp4.quantize(x, rounding="stochastic", generator=gen(15))
    y = nvfp4.dequantize(q)  # [4096, 64]
    scale = q.block_scale.float()[0].repeat_interleave(16)  # [64]
    step = scale * q.global_scale
    gs = reference.global_scales_from_amax(row.abs().amax())
    z = row[0] * nvfp4.block_encode_scale(scale, gs.decode_for_encoding)  # as quantize scales x
    lo = E2M1[torch.searchsorted(E2M1, z.abs(), right=True) - 1]
    hi = E2M1[torch.clamp(torch.searchsorted(E2M1, z.abs(), right=True), max=7)]
    mag = values_of(q.codes).abs()
    assert ((mag == lo) | (mag == hi)).all()
    # mean: within 5 standard errors (sd <= half the local gap) of z * s * g; |z| > 6 (a
    # block max whose E4M3 scale rounded down) saturates to 6 and is the only bias
    sd = (hi - lo) * step / 2 / math.sqrt(x.shape[0])
    inside = z.abs() <= 6
    assert ((y.mean(0) - z * step).abs() <= 5 * sd + 1e-7 * step)[inside].all()
    assert (mag[:, ~inside] == 6).all()
    assert (q.codes != q.codes[0]).any(dim=0).float().mean() > 0.5  # really random


def test_stochastic_rounding_is_reproducible_with_a_seed():
    x = randn(64, 64, seed=16)
    for rule in ("6", "4/6"):
        a = nvfp4.quantize(x, scale_rule=rule, rounding="stochastic", generator=gen(1))
        b = nvfp4.quantize(x, scale_rule=rule, rounding="stochastic", generator=gen(1))
        c = nvfp4.quantize(x, scale_rule=rule, rounding="stochastic", generator=gen(2))
        assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    grid = torch.tensor([[6.0, 4, 3, 2, 1.5, 1, 0.5, 0] * 2]) * 2.0**-12 * 448  # exact values
    s = nvfp4.quantize(grid, rounding="stochastic", generator=gen(3))
    assert torch.equal(s.codes, nvfp4.quantize(grid).codes)


# ---- random Hadamard transform -------------------------------------------------------------------
def test_hadamard_matches_the_matrix_and_inverts():
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = nvfp4.hadamard_signs(7)
    assert set(signs.tolist()) == {-1.0, 1.0}
    x = randn(3, 8, 32, seed=17)
    y = nvfp4.random_hadamard(x, 7)
    blocks = x.reshape(3, 8, 2, 16)
    expected = (blocks * signs) @ h.t() / 4
    torch.testing.assert_close(y, expected.reshape(x.shape), rtol=0, atol=1e-6)
    torch.testing.assert_close(nvfp4.inverse_random_hadamard(y, 7), x, rtol=0, atol=1e-6)
    torch.testing.assert_close(y.norm(), x.norm())
    assert not torch.equal(nvfp4.random_hadamard(x, 8), y)


def test_quantize_with_hadamard_decodes_in_the_original_domain():
    x = randn(32, 64, seed=18)
    q = nvfp4.quantize(x, hadamard_seed=5)
    assert q.hadamard_seed == 5
    assert torch.equal(q.data, nvfp4.quantize(nvfp4.random_hadamard(x, 5)).data)
    y = nvfp4.dequantize(q)
    assert 10 * math.log10(x.pow(2).sum() / (x - y).pow(2).sum()) > 18


# ---- non-finite input ------------------------------------------------------------------------------
def test_allow_nonfinite_saturates_inf_and_zeroes_nan():
    x = randn(16, 32, seed=19)
    with pytest.raises(ValueError, match="allow_nonfinite=True"):
        nvfp4.quantize(torch.where(x > 2, float("nan"), x))
    y = x.clone()
    y[0, 0], y[0, 1], y[1, 5] = float("nan"), float("inf"), float("-inf")
    q = nvfp4.quantize(y, allow_nonfinite=True)
    finite = torch.isfinite(y)
    assert q.global_scale.item() == (y[finite].abs().max() / 2688).item()
    assert q.codes[0, 0] == 0 and q.codes[0, 1] == 7 and q.codes[1, 5] == 15
    clean = x.clone()
    clean[0, :2], clean[1, 5] = 0, 0
    other = torch.ones(16, 32, dtype=torch.bool)
    other[0, :16], other[1, :16] = False, False  # blocks holding the non-finite values
    assert torch.equal(q.codes[other], nvfp4.quantize(clean, amax=y[finite].abs().max()).codes[other])
    assert nvfp4.quantize(y, allow_nonfinite=True, scale_rule="4/6").codes[0, 1] in (7, 6)


# ---- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("x,kwargs,exc,match", [
    (torch.ones(4, 24), {}, ValueError, "pad=True"),
    (torch.ones(24, 32), {"tile": (16, 16)}, ValueError, r"x.shape\[-2\].*multiple of 16"),
    (torch.ones(0, 32), {}, ValueError, "empty"),
    (torch.ones(4, 32, dtype=torch.float64), {}, TypeError, "float32, bfloat16 or float16"),
    (torch.ones(4, 32, dtype=torch.int32), {}, TypeError, "float32, bfloat16 or float16"),
    ([1.0] * 16, {}, TypeError, "torch.Tensor"),
    (torch.full((4, 32), float("inf")), {}, ValueError, "NaN or Inf"),
    (torch.ones(4, 32), {"tile": 32}, ValueError, "tile must be"),
    (torch.ones(4, 32), {"scale_rule": "4"}, ValueError, "scale_rule must be"),
    (torch.ones(4, 32), {"err": "l1"}, ValueError, "err must be"),
    (torch.ones(4, 32), {"rounding": "up"}, ValueError, "rounding must be"),
    (torch.ones(4, 32), {"scale_scope": "column"}, ValueError, "scale_scope must be"),
    (torch.ones(16, 32), {"tile": (16, 16), "scale_scope": "row"}, ValueError, "scale_scope='tensor'"),
    (torch.ones(4, 32), {"global_scale": torch.ones(4)}, ValueError,
     r"global_scale has shape \(4,\), expected \(\)"),
    (torch.ones(4, 32), {"scale_scope": "row", "global_scale": torch.ones(())}, ValueError,
     r"expected \(4, 1\)"),
    (torch.ones(4, 32), {"global_scale": torch.tensor(0.0)}, ValueError,
     "global_scale must be finite and > 0"),
    (torch.ones(4, 32), {"global_scale": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "float32"),
    (torch.ones(4, 32), {"amax": torch.tensor(-1.0)}, ValueError, "amax must be finite and >= 0"),
    (torch.ones(4, 32), {"amax": 1.0, "global_scale": 1.0}, ValueError, "at most one"),
    (torch.ones(4, 32), {"generator": gen()}, ValueError, "rounding='stochastic'"),
    (torch.ones(4, 32), {"hadamard_seed": -1}, ValueError, "hadamard seed"),
])
def test_bad_input_raises_a_clear_error(x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nvfp4.quantize(x, **kwargs)


def test_dequantize_rejects_other_objects():
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        nvfp4.dequantize(torch.ones(4))


def test_tensor_container():
    x = randn(16, 32, seed=20).to(torch.bfloat16)
    q = nvfp4.quantize(x, tile=(16, 16), scale_rule="4/6")
    assert (q.shape, q.dtype, q.tile, q.scale_rule) == (x.shape, torch.bfloat16, (16, 16), "4/6")
    assert q.nbytes == 16 * 16 + 16 * 2 + 4
    moved = q.to("cpu")
    assert torch.equal(moved.data, q.data) and moved.device.type == "cpu"
    assert "NVFP4Tensor(shape=(16, 32)" in repr(q)


# ---- device --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [
    {}, {"tile": (16, 16)}, {"scale_scope": "row"}, {"scale_rule": "4/6"},
    {"scale_rule": "4/6", "err": "mae", "tile": (16, 16)}, {"hadamard_seed": 3},
])
def test_cuda_gives_the_same_bytes_as_cpu(kwargs):
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.distributions.StudentT(3).sample((256, 512)) * 1e-3).to(dtype)
        a, b = nvfp4.quantize(x, **kwargs), nvfp4.quantize(x.cuda(), **kwargs)
        assert torch.equal(a.data, b.data.cpu())
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.cpu().view(torch.uint8))
        assert torch.equal(a.global_scale, b.global_scale.cpu())
        assert torch.equal(nvfp4.dequantize(a), nvfp4.dequantize(b).cpu())


@pytest.mark.gpu
def test_cuda_stochastic_rounding_is_reproducible():
    x = torch.randn(256, 256, device="cuda")
    a = nvfp4.quantize(x, rounding="stochastic", generator=gen(1, "cuda"))
    b = nvfp4.quantize(x, rounding="stochastic", generator=gen(1, "cuda"))
    assert torch.equal(a.data, b.data)


# ---- the benchmark ---------------------------------------------------------------------------------
def test_bench_quantize_runs_and_4_over_6_wins(tmp_path, capsys):
    from fp4rl.cli import main

    results = tmp_path / "RESULTS.md"
    assert main(["bench", "quantize", "--size", "64", "--snr-size", "128", "--repeats", "1",
                 "--results", str(results)]) == 0
    text = results.read_text()
    assert text.startswith("\n## quantize\n") and "| quantize 1x16, tensor scale, 4/6 mae |" in text
    assert "Command: `fp4rl bench quantize --size 64" in text
    assert "| normal N(0, 1) | 1x16 |" in capsys.readouterr().out


def test_the_cli_turns_a_refused_value_into_a_message_and_exit_2(capsys, monkeypatch, tmp_path):
    from fp4rl.cli import main

    monkeypatch.delenv("FP4RL_TRACEBACK", raising=False)
    # a ValueError in the library (bench's numeric options are now refused by argparse itself, exit 2)
    refused = ["export", str(tmp_path / "src"), str(tmp_path / "out"), "--calib-prompts", "0"]
    assert main(refused) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl export: error: ") and "Traceback" not in err and "FP4RL_TRACEBACK" in err
    assert main(["plot", str(tmp_path / "missing")]) == 2  # a file error too
    with pytest.raises(SystemExit) as parsed:
        main(["bench", "quantize", "--size", "0", "--repeats", "1"])
    assert parsed.value.code == 2 and "--size: '0': expected an integer >= 16" in capsys.readouterr().err
    monkeypatch.setenv("FP4RL_TRACEBACK", "1")
    with pytest.raises(ValueError):
        main(refused)
    for command in (["train"], ["ablate", "--presets", "bf16,nvfp4-w4a16"]):  # they catch config errors
        with pytest.raises(FileNotFoundError):  # themselves: the variable shows the traceback there too
            main([*command, "--config", str(tmp_path / "missing.toml")])


def test_output_piped_into_a_reader_that_stops_is_not_an_error(tmp_path):
    """`fp4rl train --help-config | head -2`: exit 0, no 'Broken pipe' error (it exited 2 with one). The
    reader here (`true`) has gone before the command (seconds of imports) writes anything: always a broken
    pipe."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m fp4rl.cli train --help-config | true"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Broken pipe" not in out.stderr and not out.stderr.strip(), out.stderr


@pytest.mark.parametrize("impl", ["reference", "default"])
def test_quantize_detaches_copies_imposed_scales_and_refuses_what_breaks_it(impl):
    """Both implementations: no autograd graph in the result (the reference carried one through amax); an
    imposed global scale is copied (an in-place change of the caller's tensor changed tensors already
    quantized); a Hadamard transform that overflows float32 is refused (it gave NaN/Inf scales silently);
    NVFP4Tensor.to(dtype) is refused (it cast the packed bytes and scales)."""
    q_fn = reference.quantize if impl == "reference" else nvfp4.quantize
    x = torch.randn(4, 32, requires_grad=True)
    q = q_fn(x)
    assert not q.global_scale.requires_grad and not nvfp4.dequantize(q).requires_grad
    g = torch.tensor(0.01)
    q = q_fn(torch.randn(2, 16), global_scale=g)
    before = nvfp4.dequantize(q).clone()
    g.mul_(100)
    assert q.global_scale.data_ptr() != g.data_ptr() and torch.equal(nvfp4.dequantize(q), before)
    spread = torch.randn(1, 16, generator=torch.Generator().manual_seed(1)) * 1e38
    for big in (torch.full((1, 16), 3.0e38), spread):
        with pytest.raises(ValueError, match="Hadamard transform overflows float32"):
            q_fn(big, hadamard_seed=1)
    assert torch.isfinite(nvfp4.dequantize(q_fn(torch.randn(2, 16) * 1e30, hadamard_seed=1))).all()
    with pytest.raises(TypeError, match=r"NVFP4Tensor.to\(torch.float16\): takes a device"):
        q.to(torch.float16)
    for bad in (torch.int32, "float32"):  # an int dtype was accepted and returned ints
        with pytest.raises(TypeError, match="dequantize: dtype must be a floating torch dtype"):
            nvfp4.dequantize(q, bad)
    assert q.to("cpu").data.dtype == torch.uint8
