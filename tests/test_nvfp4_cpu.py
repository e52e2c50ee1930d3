"""fp4rl.nvfp4.cpu (the C kernel for CPU tensors) against fp4rl.nvfp4.reference, byte for byte.

Every deterministic mode on the reference tests' tensor families (random normal, heavy-tailed,
rounding midpoints, all-zero blocks, very large and very small values, a single outlier),
float32 / bfloat16 / float16, 1x16 and 16x16 tiles, per-tensor and per-row scales, rule 6 and
4/6 (MSE and MAE), leading dims and imposed scales: codes, block-scale bytes, global scales
and dequantized bytes must be equal. The kernel's two roundings are swept on their own, what
it hands to the reference must come back as the reference's, and ``fp4rl.nvfp4`` must route
CPU tensors to it (the default runtime path is the one tested here).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings

import pytest
import torch

from fp4rl import nvfp4
from fp4rl.nvfp4 import cpu, reference
from fp4rl.nvfp4.format import E2M1_VALUES

if not (cpu._compiler() or shutil.which("gcc")):
    pytest.skip("no C compiler: the fast CPU path is off and CPU tensors use the reference",
                allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu.available(), f"the C kernel did not build: {cpu._failed}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def midpoints(rows: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of exact E2M1 rounding ties (and their float32 neighbours) under a power-of-two
    scale: each block holds its max 6 (so s = 2^e exactly, with amax = 448 * 6 * 2^-12)."""
    g = gen(seed)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    pick = ties[torch.randint(0, 7, (rows, k), generator=g)]
    nudge = torch.randint(-1, 2, (rows, k), generator=g)
    pick = torch.where(nudge < 0, torch.nextafter(pick, torch.zeros(())), pick)
    pick = torch.where(nudge > 0, torch.nextafter(pick, torch.full((), 8.0)), pick)
    sign = torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    x = pick * sign
    x[:, ::16] = 6.0
    x[0, 0] = 6.0 * 448
    return x * 2.0**-12


def families(rows: int = 32, k: int = 64) -> dict[str, torch.Tensor]:
    g = gen(0)
    normal = torch.randn(rows, k, generator=g)
    outlier = normal.clone()
    outlier[3, 5] = 1e4
    keep = (torch.rand(rows, k // 16, 1, generator=g) < 0.5).float()
    zero_blocks = normal * keep.expand(-1, -1, 16).reshape(rows, k)
    tail = torch.distributions.StudentT(3.0).sample((rows, k)) * 1e-3
    return {
        "normal": normal,
        "heavy-tailed": tail,
        "midpoints": midpoints(rows, k, 1),
        "zero blocks": zero_blocks,
        "all zero": torch.zeros(rows, k),
        "large": normal * 1e37,  # S_enc underflows towards 0, products near FLT_MAX
        "small": normal * 1e-37,  # subnormal block scales, S_enc near FLT_MAX
        "subnormal": normal * 1e-41,
        "outlier": outlier,
    }


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = [
    {},
    {"scale_scope": "row"},
    {"tile": (16, 16)},
    {"scale_rule": "4/6"},
    {"scale_rule": "4/6", "err": "mae"},
    {"scale_rule": "4/6", "scale_scope": "row"},
    {"scale_rule": "4/6", "err": "mae", "scale_scope": "row"},
    {"tile": (16, 16), "scale_rule": "4/6"},
    {"tile": (16, 16), "scale_rule": "4/6", "err": "mae"},
]


def assert_same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> None:
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    assert torch.equal(a.data, b.data)
    assert a.block_scale.dtype == b.block_scale.dtype and a.block_scale.shape == b.block_scale.shape
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    assert a.global_scale.dtype == b.global_scale.dtype and a.global_scale.shape == b.global_scale.shape
    assert torch.equal(a.global_scale.view(torch.int32), b.global_scale.view(torch.int32))
    assert (a.shape, a.dtype, a.tile, a.scale_rule, a.hadamard_seed) == (
        b.shape, b.dtype, b.tile, b.scale_rule, b.hadamard_seed)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    assert torch.equal(a.view(view), b.view(view))


def _mode_id(kwargs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kwargs.items()) or "default"


@pytest.mark.parametrize("kwargs", MODES, ids=_mode_id)
def test_same_bytes_as_the_reference(kwargs):
    for name, x in families().items():
        for dtype in DTYPES:
            xd = x.to(dtype)
            if not torch.isfinite(xd).all():
                continue  # 1e37 overflows float16
            try:
                a, b = cpu.quantize(xd, **kwargs), reference.quantize(xd, **kwargs)
                assert_same(a, b)
                for out in DTYPES:
                    assert_same_bits(cpu.dequantize(a, out), reference.dequantize(b, out))
                assert_same_bits(cpu.fake_quantize(xd, **kwargs), reference.fake_quantize(xd, **kwargs))
            except AssertionError as e:
                raise AssertionError(f"family {name!r}, {dtype}: {e}") from e


def test_one_block_and_ragged_row_groups():
    """Shapes at the edges of the kernel's loops: one block, and rows of 1..33 blocks (groups
    of 16 blocks with a partial last group)."""
    for k in (16, 32, 256, 272, 528):
        for rows in (1, 3, 16):
            x = torch.randn(rows, k, generator=gen(k + rows))
            for kwargs in MODES:
                if kwargs.get("tile") == (16, 16) and rows % 16:
                    continue
                assert_same(cpu.quantize(x, **kwargs), reference.quantize(x, **kwargs))


def test_leading_dims_and_one_dim():
    x = torch.randn(2, 3, 32, 48, generator=gen(6))
    for kwargs in MODES:
        a, b = cpu.quantize(x, **kwargs), reference.quantize(x, **kwargs)
        assert_same(a, b)
        assert_same_bits(cpu.dequantize(a), reference.dequantize(b))
    v = torch.randn(64, generator=gen(7))
    for kwargs in ({}, {"scale_scope": "row"}, {"scale_rule": "4/6"}):
        assert_same(cpu.quantize(v, **kwargs), reference.quantize(v, **kwargs))
    # a non-contiguous view reads as its values
    t = torch.randn(64, 48, generator=gen(8)).t()
    assert_same(cpu.quantize(t, scale_rule="4/6"), reference.quantize(t, scale_rule="4/6"))


def test_imposed_scales():
    x = torch.randn(32, 64, generator=gen(13))
    rows_amax = x.abs().amax(-1, keepdim=True)
    cases = [
        {"amax": x.abs().amax()},
        {"amax": x.abs().amax() * 3},  # a fused group's larger amax
        {"amax": 0.5},  # smaller than |x|: values saturate
        {"amax": 0.0},
        {"global_scale": torch.tensor(3e-3)},
        {"global_scale": 1e-6},  # block scales saturate at 448
        {"global_scale": 1e30},  # S_enc = 1/g underflows to ~0
        {"scale_scope": "row", "amax": rows_amax * 2},
        {"scale_scope": "row", "global_scale": torch.full((32, 1), 1e-3)},
    ]
    for case in cases:
        for rule in ({}, {"scale_rule": "4/6"}, {"scale_rule": "4/6", "err": "mae"}, {"tile": (16, 16)}):
            kwargs = {**case, **rule}
            if kwargs.get("tile") == (16, 16) and kwargs.get("scale_scope") == "row":
                continue
            for dtype in (torch.float32, torch.bfloat16):
                a, b = cpu.quantize(x.to(dtype), **kwargs), reference.quantize(x.to(dtype), **kwargs)
                assert_same(a, b)
                assert_same_bits(cpu.dequantize(a), reference.dequantize(b))


def test_thread_split_gives_the_same_bytes():
    """Rows are split over torch.get_num_threads() threads (16-row aligned for 16x16 tiles)."""
    x = torch.randn(48, 4096, generator=gen(21))  # 3 x 2^16 elements: up to 3 chunks of 16 rows
    threads = torch.get_num_threads()
    try:
        for kwargs in MODES[:3] + [{"scale_scope": "row", "scale_rule": "4/6"}, MODES[-2]]:
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(cpu.quantize(x, **kwargs))
                results.append(cpu.dequantize(results[-1], torch.bfloat16))
            torch.set_num_threads(1)
            ref = reference.quantize(x, **kwargs)
            for i in range(0, len(results), 2):
                assert_same(results[i], ref)
                assert_same_bits(results[i + 1], reference.dequantize(ref, torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


# ---- the two roundings on their own -------------------------------------------------------------
def _e4m3_grid() -> torch.Tensor:
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def _around(v: torch.Tensor) -> torch.Tensor:
    """v, its float32 neighbours, and the midpoints between consecutive values with theirs."""
    mid = (v[:-1] + v[1:]) / 2
    pts = torch.cat([v, mid])
    up, down = torch.full((), float("inf")), torch.zeros(())
    return torch.cat([pts, torch.nextafter(pts, up), torch.nextafter(pts, down)])


def test_e4m3_cast_matches_torch():
    grid = _e4m3_grid()
    extra = torch.tensor([448.0, 460.0, 464.0, 465.0, 1e30, 3.4e38, float("inf"), 0.0, 2.0**-10, 2.0**-11,
                          1e-45, 2.0**-6, 2.0**-6 - 2.0**-10])
    rand = torch.randint(0, 0x43F00000, (1 << 16,), generator=gen(3), dtype=torch.int32).view(torch.float32)
    v = torch.cat([_around(grid), extra, rand]).abs()
    byte, value = cpu._roundings("nvfp4_cast_e4m3", v)
    expected = nvfp4.cast_to_e4m3(v)
    assert torch.equal(byte, expected.view(torch.uint8))
    assert torch.equal(value, expected.float())


@pytest.mark.slow
def test_e4m3_cast_matches_torch_on_every_float32_up_to_512():
    """Every non-negative float32 bit pattern below 512 (1.14e9 values, in chunks)."""
    stop = int(torch.tensor(512.0).view(torch.int32))
    chunk = 1 << 24
    for start in range(0, stop, chunk):
        v = torch.arange(start, min(stop, start + chunk), dtype=torch.int32).view(torch.float32)
        byte, _ = cpu._roundings("nvfp4_cast_e4m3", v)
        assert torch.equal(byte, nvfp4.cast_to_e4m3(v).view(torch.uint8)), hex(start)


def test_e2m1_rounding_matches_the_format():
    grid = torch.tensor(E2M1_VALUES)
    special = torch.tensor([6.5, 7.0, 1e30, 3.4e38, float("inf"), float("nan"), 0.0, -0.0, 1e-45, 0.1])
    rand = torch.randn(1 << 14, generator=gen(4)) * 4
    z = torch.cat([_around(grid), special, rand])
    z = torch.cat([z, -z])
    code, value = cpu._roundings("nvfp4_round_e2m1", z)
    expected = nvfp4.round_to_e2m1(z)
    assert torch.equal(code, expected)
    ref_values = nvfp4.e2m1_codes_to_values(expected)
    assert torch.equal(value.abs(), ref_values.abs())
    # the kernel's value carries the sign of z (its 4/6 error only squares or takes |.|)
    assert torch.equal(value, torch.where(z < 0, -ref_values.abs(), ref_values.abs()))


# ---- what goes to the reference -------------------------------------------------------------------
def test_other_modes_are_the_reference():
    x = torch.randn(32, 64, generator=gen(5))
    a = cpu.quantize(x, rounding="stochastic", generator=gen(1), scale_rule="4/6")
    b = reference.quantize(x, rounding="stochastic", generator=gen(1), scale_rule="4/6")
    assert_same(a, b)
    assert_same(cpu.quantize(x, hadamard_seed=3), reference.quantize(x, hadamard_seed=3))
    assert_same_bits(cpu.dequantize(cpu.quantize(x, hadamard_seed=3)), reference.dequantize(
        reference.quantize(x, hadamard_seed=3)))
    x40 = torch.randn(4, 40, generator=gen(9))
    qa, qb = cpu.quantize(x40, pad=True), reference.quantize(x40, pad=True)
    assert_same(qa, qb)
    assert_same_bits(cpu.dequantize(qa), reference.dequantize(qb))
    y = x.clone()
    y[0, 0], y[1, 1] = float("nan"), float("inf")
    assert_same(cpu.quantize(y, allow_nonfinite=True), reference.quantize(y, allow_nonfinite=True))
    assert_same(cpu.quantize(x, pad=True), reference.quantize(x))  # K already a multiple of 16


@pytest.mark.parametrize("x,kwargs,exc,match", [
    (torch.full((4, 32), float("nan")), {}, ValueError, "NaN or Inf"),
    (torch.full((4, 32), float("inf")), {"scale_scope": "row", "scale_rule": "4/6"}, ValueError,
     "NaN or Inf"),
    (torch.ones(32, 32).index_fill_(0, torch.tensor([20]), float("inf")), {"tile": (16, 16)}, ValueError,
     "NaN or Inf"),
    (torch.ones(4, 32).to(torch.bfloat16).index_fill_(1, torch.tensor([3]), float("nan")), {"amax": 1.0},
     ValueError, "NaN or Inf"),
    # a NaN in a 16x16 tile with an imposed scale (the weights' path in qat): a float compare of the rows'
    # maxima dropped it, and the NaN was packed as code 0
    (torch.ones(16, 32).index_put_((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"))),
     {"tile": (16, 16), "amax": 1.0}, ValueError, "NaN or Inf"),
    (torch.ones(16, 32).index_put_((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"))),
     {"tile": (16, 16), "global_scale": 0.01, "scale_rule": "4/6"}, ValueError, "NaN or Inf"),
    (torch.ones(4, 32), {"global_scale": torch.ones(4)}, ValueError, r"global_scale has shape \(4,\)"),
    (torch.ones(4, 32), {"amax": torch.tensor(-1.0)}, ValueError, "amax must be finite and >= 0"),
    (torch.ones(4, 32), {"global_scale": torch.tensor(1.0, dtype=torch.float64)}, TypeError, "float32"),
    (torch.ones(4, 32), {"amax": 1.0, "global_scale": 1.0}, ValueError, "at most one"),
    (torch.ones(4, 24), {}, ValueError, "pad=True"),
    (torch.ones(24, 32), {"tile": (16, 16)}, ValueError, "multiple of 16"),
    (torch.ones(16, 32), {"tile": (16, 16), "scale_scope": "row"}, ValueError, "scale_scope='tensor'"),
    (torch.ones(4, 32), {"err": "l1"}, ValueError, "err must be"),
    (torch.ones(0, 32), {}, ValueError, "empty"),
])
def test_bad_input_raises_the_reference_error(x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cpu.quantize(x, **kwargs)


def test_dequantize_of_other_objects_is_the_reference():
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        cpu.dequantize(torch.ones(4))
    q = cpu.quantize(torch.randn(16, 32, generator=gen(10)))
    bad_bytes = q.block_scale.view(torch.uint8).clone()
    bad_bytes[0, 0] = 0x7F  # an E4M3 NaN, from no quantizer: decodes as torch decodes it
    odd = dataclasses.replace(q, block_scale=bad_bytes.view(torch.float8_e4m3fn))
    for dtype in DTYPES:
        assert_same_bits(cpu.dequantize(odd, dtype), reference.dequantize(odd, dtype))


# ---- dispatch ----------------------------------------------------------------------------------------
def test_cpu_tensors_take_the_fast_path(monkeypatch):
    """fp4rl.nvfp4 routes CPU tensors here, and the supported modes never call the reference."""
    x = torch.randn(16, 64, generator=gen(11))
    assert nvfp4._implementation(x) is cpu

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference was called")

    monkeypatch.setattr(reference, "quantize", no_reference)
    monkeypatch.setattr(reference, "dequantize", no_reference)
    imposed = [{"amax": 2.0}, {"global_scale": 1e-3}, {"scale_scope": "row", "amax": torch.ones(16, 1)}]
    for kwargs in MODES + imposed:
        for dtype in DTYPES:
            q = nvfp4.quantize(x.to(dtype), **kwargs)
            nvfp4.dequantize(q, dtype)
            nvfp4.fake_quantize(x.to(dtype), **kwargs)


def test_env_forces_the_reference(monkeypatch):
    x = torch.randn(16, 64, generator=gen(12))
    monkeypatch.setenv("FP4RL_NVFP4_CPU", "reference")
    assert nvfp4._implementation(x) is reference
    calls = []
    real = reference.quantize
    monkeypatch.setattr(reference, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    nvfp4.quantize(x)
    assert calls
    monkeypatch.delenv("FP4RL_NVFP4_CPU")
    assert nvfp4._implementation(x) is cpu


def test_build_failure_falls_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_failed", None)

    def broken():
        raise RuntimeError("cc: not today")

    monkeypatch.setattr(cpu, "build", broken)
    x = torch.randn(16, 64, generator=gen(14))
    with pytest.warns(RuntimeWarning, match="not today"):
        assert nvfp4._implementation(x) is reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert nvfp4._implementation(x) is reference
        assert_same(nvfp4.quantize(x, scale_rule="4/6"), reference.quantize(x, scale_rule="4/6"))
        assert_same(cpu.quantize(x, scale_rule="4/6"), reference.quantize(x, scale_rule="4/6"))


def test_build_is_cached():
    path = cpu.build()
    assert path.exists() and cpu.build() == path


def test_tmp_cache_fallback_trusts_only_a_private_folder(tmp_path, monkeypatch):
    """With ~/.cache not writable, compiled kernels go to <tmp>/fp4rl-<uid>, but only if this user owns it
    and no one else can write to it (another user could plant a library there): else a private folder."""
    import os
    import tempfile

    from fp4rl.nvfp4 import cpu

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # <file>/fp4rl cannot be created
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"fp4rl-{os.getuid()}"
    assert cpu._cache_dir() == shared and shared.stat().st_mode & 0o777 == 0o700
    shared.chmod(0o777)  # world-writable: not trusted
    other = cpu._cache_dir()
    assert other != shared and other.stat().st_mode & 0o077 == 0
