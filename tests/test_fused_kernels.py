"""fp4rl.kernels.fused against the unfused torch path of fp4rl/model.py and against the shared quantizer.

Claims checked (fused.py's docstring): the residual add, RoPE, the weight product and the KV write are
bit-equal; RMSNorm and q/k-norm are bit-equal except where the fp32 sum of squares, added in another
order, moves y by one bfloat16 ulp; SiLU * up is bit-equal on the GPU and within one ulp on the CPU
(numpy's exp); a fused Q(y) is byte-identical to fp4rl.kernels.quantize.quantize_2d (and so to the
reference) for the y the kernel produced. On a machine without CUDA the kernels run in Triton's
interpreter (conftest.py)."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import fused, moe_route  # noqa: E402
from fp4rl.kernels.quantize import quantize_2d  # noqa: E402
from fp4rl.model import RMSNorm, rope_tables, rotate_half  # noqa: E402
from fp4rl.nvfp4 import quantize as reference_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = [dict(scale_rule="6", err="mse"), dict(scale_rule="4/6", err="mse"),
          dict(scale_rule="4/6", err="mae")]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # the interpreter's numpy warns on the quantizer's 1/0 (then masked)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bf16(shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).bfloat16().to(DEV)


def _norm(k, seed):
    n = RMSNorm(k, 1e-6).bfloat16().to(DEV)
    with torch.no_grad():
        n.weight.copy_(torch.rand(k, generator=_gen(seed)) + 0.5)
    return n


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bfloat16 ulps (same-sign finite values; NaN must match NaN)."""
    assert torch.equal(a.isnan(), b.isnan())
    fin = ~a.isnan()
    ia, ib = a[fin].view(torch.int16).int(), b[fin].view(torch.int16).int()
    return int((ia - ib).abs().max()) if ia.numel() else 0


def assert_norm_close(y, ref):
    """The RMSNorm claim: at most one ulp apart, and nearly always equal."""
    assert ulps(y, ref) <= 1
    assert (y != ref).float().mean().item() <= 0.02


def assert_bytes(xq, y, quant):
    """Fused Q(y) == quantize_2d(y) == the reference's per-token quantize of the same y."""
    d, s, g = quantize_2d(y, per_row=True, check_finite=False, **quant)
    assert torch.equal(xq[0], d)
    assert torch.equal(xq[1].view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(xq[2], g)
    if not y.isnan().any():
        ref = reference_quantize(y.cpu(), tile=16, scale_scope="row", **quant)
        assert torch.equal(xq[0].cpu(), ref.data)
        assert torch.equal(xq[1].view(torch.uint8).cpu(), ref.block_scale.view(torch.uint8))
        assert torch.equal(xq[2].cpu(), ref.global_scale.reshape(-1))


# ----------------------------------------------------------------------------------------------
# residual add + RMSNorm


@pytest.mark.parametrize("r,k,block", [(3, 80, None), (2, 48, 16), (5, 208, 64), (1, 4096, None)])
def test_add_rmsnorm_is_the_residual_add_and_rmsnorm(r, k, block):
    x, h, norm = _bf16((r, k), 0, 3.0), _bf16((r, k), 1), _norm(k, 2)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, block=block)
    assert xq is None
    assert torch.equal(xo, x + h)  # bit-equal: one fp32 add, one rounding
    with torch.no_grad():
        assert_norm_close(y, norm(x + h))
    xo2, y2, _ = fused.add_rmsnorm(x, None, norm.weight, norm.eps, block=block)  # first layer: no add
    assert xo2 is x
    with torch.no_grad():
        assert_norm_close(y2, norm(x))


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,k,block", [(3, 80, None), (2, 96, 32)])
def test_add_rmsnorm_quantizes_its_output_byte_for_byte(r, k, block, quant):
    x, h, norm = _bf16((r, k), 3, 2.0), _bf16((r, k), 4), _norm(k, 5)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, block=block)
    assert_bytes(xq, y, quant)
    xo2, y2, xq2 = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, write_y=False, block=block)
    assert y2 is None and torch.equal(xo2, xo)
    for a, b in zip(xq, xq2):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_add_rmsnorm_nan_rows_follow_the_unfused_path():
    """A NaN in a row makes that row's norm NaN (torch's too) and leaves the other rows alone; the fused
    Q(y) is the separate quantizer's on the same values (engine setting: no finiteness check)."""
    r, k = 3, 64
    x, h, norm = _bf16((r, k), 6), _bf16((r, k), 7), _norm(k, 8)
    x[1, 5] = float("nan")
    quant = QUANTS[0]
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant)
    with torch.no_grad():
        ref = norm(x + h)
    assert y[1].isnan().all() and ref[1].isnan().all()
    assert_norm_close(y[[0, 2]], ref[[0, 2]])
    assert_bytes(xq, y, quant)


def test_add_rmsnorm_zero_row():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    norm = _norm(32, 9)
    _, y, xq = fused.add_rmsnorm(x, None, norm.weight, norm.eps, quant=QUANTS[1])
    with torch.no_grad():
        assert torch.equal(y, norm(x))
    assert_bytes(xq, y, QUANTS[1])


# ----------------------------------------------------------------------------------------------
# q/k-norm + RoPE + KV write


def _rope_tables(positions, d, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return rope_tables(inv_freq.to(positions.device), positions, torch.bfloat16)  # [R, D]: the engine's


def _unfused_qk(qkv, cos, sin, h, hkv, d, qn, kn):
    """DecodeEngine._attention's arithmetic: q/k-norm, transpose, q * cos + rotate_half(q) * sin."""
    r = qkv.shape[0]
    q = qkv[:, :h * d].view(r, 1, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(r, 1, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(r, 1, hkv, d).transpose(1, 2)
    if qn is not None:
        q, k = qn(q), kn(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    c, s = cos[:, None, None], sin[:, None, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v


@pytest.mark.parametrize("h,hkv,d,norm", [(4, 2, 32, True), (4, 2, 32, False), (3, 1, 24, True),
                                         (2, 2, 20, False)])
def test_qk_norm_rope_is_the_unfused_rope(h, hkv, d, norm):
    r = 3
    qkv = _bf16((r, (h + 2 * hkv) * d), 10, 2.0)
    cos, sin = _rope_tables(torch.tensor([0, 7, 1000], device=DEV), d)
    qn, kn = (_norm(d, 11), _norm(d, 12)) if norm else (None, None)
    with torch.no_grad():
        q_ref, k_ref, _ = _unfused_qk(qkv, cos, sin, h, hkv, d, qn, kn)
    q, k = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn and qn.weight, kn and kn.weight, 1e-6)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape
    if norm:  # one ulp from the norm can grow through the rotation to a few ulps of the output
        assert ((q.float() - q_ref.float()).abs() <= 2 ** -6 * q_ref.float().abs().clamp(min=1)).all()
        assert (q != q_ref).float().mean().item() <= 0.05 and (k != k_ref).float().mean().item() <= 0.05
    else:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_qk_norm_rope_writes_the_bf16_cache_slot():
    r, h, hkv, d, t, slot = 2, 4, 2, 32, 9, 6
    qkv = _bf16((r, (h + 2 * hkv) * d), 13)
    cos, sin = _rope_tables(torch.tensor([5, 3], device=DEV), d)
    k_cache = _bf16((4, hkv, t, d), 14)  # more rows than the step's: rows >= r stay
    v_cache = _bf16((4, hkv, t, d), 15)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q, k_none = fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache,
                                   v_cache=v_cache, slot=torch.tensor([slot], device=DEV))
    assert k_none is None
    q_ref, k_ref, v_ref = _unfused_qk(qkv, cos, sin, h, hkv, d, None, None)
    assert torch.equal(q, q_ref)
    k0[:r].index_copy_(2, torch.tensor([slot], device=DEV), k_ref)
    v0[:r].index_copy_(2, torch.tensor([slot], device=DEV), v_ref)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_fused_kernels_refuse_misfit_arguments():
    """Wrong shapes, dtypes or devices are a ValueError naming the argument, never a silent misread."""
    r, h, hkv, d = 2, 4, 2, 32
    x = _bf16((r, 64), 30)
    with pytest.raises(ValueError, match="weight must be the norm's contiguous \\[64\\]"):
        fused.add_rmsnorm(x, None, _norm(48, 32).weight, 1e-6)
    qkv = _bf16((r, (h + 2 * hkv) * d), 33)
    cos, sin = _rope_tables(torch.tensor([1, 2], device=DEV), d)
    qn, kn = _norm(d, 34), _norm(d, 35)
    with pytest.raises(TypeError):  # eps is the model's (Qwen3 1e-6, Llama 1e-5): no default
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, kn.weight)
    with pytest.raises(ValueError, match="sin must be"):
        fused.qk_norm_rope(qkv, cos, sin[:, :16].contiguous(), h, hkv, d, None, None, 1e-6)
    with pytest.raises(ValueError, match="cos must be"):
        fused.qk_norm_rope(qkv, cos.float(), sin, h, hkv, d, None, None, 1e-6)
    with pytest.raises(ValueError, match="k_weight must be"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, _norm(16, 36).weight, 1e-6)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, qn.weight, None, 1e-6)
    k_cache, v_cache = _bf16((r, hkv, 8, d), 37), _bf16((r, hkv, 8, d), 38)
    for bad in (torch.tensor([3], dtype=torch.int32, device=DEV), torch.tensor([3, 4], device=DEV)):
        with pytest.raises(ValueError, match="slot must be a \\[1\\] torch.long tensor"):
            fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache, v_cache=v_cache,
                               slot=bad)
    with pytest.raises(ValueError, match="k_cache/v_cache must be"):
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6, k_cache=k_cache[:, :1].contiguous(),
                           v_cache=v_cache[:, :1].contiguous(), slot=torch.tensor([3], device=DEV))


# ----------------------------------------------------------------------------------------------
# SiLU(gate) * up


@pytest.mark.parametrize("r,i,block", [(3, 40, None), (2, 100, 32), (1, 1536, None)])
def test_silu_mul_is_silu_times_up(r, i, block):
    gu = _bf16((r, 2 * i), 16, 4.0)
    y, xq = fused.silu_mul(gu, block=block)
    assert xq is None
    ref = F.silu(gu[:, :i]) * gu[:, i:]
    if DEV == "cuda":
        assert torch.equal(y, ref)  # libdevice expf + IEEE division: torch's CUDA SiLU
    else:
        assert ulps(y, ref) <= 1 and (y != ref).float().mean().item() <= 0.02


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,i,block", [(3, 48, None), (2, 160, 32)])
def test_silu_mul_quantizes_its_output_byte_for_byte(r, i, block, quant):
    gu = _bf16((r, 2 * i), 17, 3.0)
    y, xq = fused.silu_mul(gu, quant=quant, block=block)
    y_plain, _ = fused.silu_mul(gu, block=block)
    assert torch.equal(y, y_plain)
    assert_bytes(xq, y, quant)
    none, xq2 = fused.silu_mul(gu, quant=quant, write_y=False, block=block)
    assert none is None and torch.equal(xq2[0], xq[0]) and torch.equal(xq2[2], xq[2])


def test_silu_mul_nonfinite_follows_torch():
    gu = _bf16((2, 64), 18)
    gu[0, 3] = float("nan")
    gu[0, 4] = float("inf")  # silu(inf) = inf
    gu[1, 5] = float("-inf")  # -inf / (1 + inf) = NaN, as torch's x / (1 + exp(-x))
    y, xq = fused.silu_mul(gu, quant=QUANTS[0])
    ref = F.silu(gu[:, :32]) * gu[:, 32:]
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert_bytes(xq, y, QUANTS[0])


def test_silu_without_libdevice_on_cuda_warns_once(monkeypatch):
    """A compiled CUDA launch without libdevice falls back to tl.exp (approximate): say so, once."""
    monkeypatch.setattr(fused, "USE_LIBDEVICE", False)
    monkeypatch.setattr(fused, "INTERPRET", False)
    monkeypatch.setattr(fused, "_WARNED_NO_LIBDEVICE", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fused._libdevice_for(torch.device("cuda")) is False
        assert fused._libdevice_for(torch.device("cuda")) is False
        assert fused._libdevice_for(torch.device("cpu")) is False  # the CPU never has it: no warning
    assert sum("libdevice" in str(w.message) for w in seen) == 1
    monkeypatch.setattr(fused, "INTERPRET", True)  # the interpreter has no libdevice by design: quiet
    monkeypatch.setattr(fused, "_WARNED_NO_LIBDEVICE", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused._libdevice_for(torch.device("cuda"))
    assert not seen


def test_fused_quantize_rejects_bad_settings():
    gu = _bf16((1, 64), 19)
    with pytest.raises(ValueError, match="scale_rule"):
        fused.silu_mul(gu, quant=dict(scale_rule="5", err="mse"))
    with pytest.raises(ValueError, match="multiple of 16"):
        fused.silu_mul(_bf16((1, 40), 20), quant=QUANTS[0])


# ----------------------------------------------------------------------------------------------
# GPU: the real Qwen3-8B widths, bit for bit where claimed


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_qwen3_8b_widths(quant):
    x, h, norm = _bf16((8, 4096), 21), _bf16((8, 4096), 22), _norm(4096, 23)
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant)
    assert torch.equal(xo, x + h)
    with torch.no_grad():
        assert_norm_close(y, norm(x + h))
    assert_bytes(xq, y, quant)
    gu = _bf16((8, 2 * 12288), 24, 2.0)
    y, xq = fused.silu_mul(gu, quant=quant)
    assert torch.equal(y, F.silu(gu[:, :12288]) * gu[:, 12288:])
    assert_bytes(xq, y, quant)


# ----------------------------------------------------------------------------------------------
# split rows: several programs per row (grid (rows, chunks)), each writing its own columns


def _bits_eq(a, b):
    """The same bfloat16 bit patterns (NaNs included)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _nan_eq(a, b):
    """Equal values, NaN where the other has NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _q_eq(a, b):
    """Two (data, block_scale, global_scale) triples are the same bytes."""
    return (torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
            and torch.equal(a[2], b[2]))


@pytest.mark.parametrize("quant", [None] + QUANTS)
@pytest.mark.parametrize("r,k,chunk,block", [(3, 208, 48, None), (2, 96, 16, 16), (1, 4096, None, None)])
def test_add_rmsnorm_split_rows_are_one_program_per_row_bit_for_bit(r, k, chunk, block, quant):
    """chunk 48 of 208 columns (a partial last chunk, tile 16), chunk 16 (one block per program), the
    default (4096 -> 8 programs of 512): x', y, codes, block scales and global scales equal those of one
    program per row (chunk >= K) and the shared quantizer's, with y on and off, h given and not, a NaN row."""
    x, h, norm = _bf16((r, k), 40, 3.0), _bf16((r, k), 41), _norm(k, 42)
    if r > 2:
        x[1, 7] = float("nan")
    whole = triton_next_pow2(k)
    for hh in (h, None) if quant in (None, QUANTS[2]) else (h,):  # no add: once unquantized, once with 4/6
        xo1, y1, xq1 = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, block=block, chunk=whole)
        xo, y, xq = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, block=block, chunk=chunk)
        if hh is None:
            assert xo is x
        else:
            assert xo.data_ptr() != x.data_ptr()  # x' is a new tensor: programs read all of x's row
            assert _nan_eq(xo, x + h) and _bits_eq(xo, xo1)
        assert _bits_eq(y, y1)
        with torch.no_grad():
            ref = norm(x + h if hh is not None else x)
        fin = ~ref.isnan().any(1)
        assert_norm_close(y[fin], ref[fin])
        if quant is None:
            assert xq is None
            continue
        assert _q_eq(xq, xq1)
        assert_bytes(xq, y, quant)
        xo2, none, xq2 = fused.add_rmsnorm(x, hh, norm.weight, norm.eps, quant=quant, write_y=False,
                                           block=block, chunk=chunk)
        assert none is None and _bits_eq(xo2, xo) and _q_eq(xq2, xq)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("r,i,chunk,block", [(3, 176, 48, None), (2, 96, 32, 16), (1, 3072, None, None)])
def test_silu_mul_split_rows_are_one_program_per_row_bit_for_bit(r, i, chunk, block, quant):
    """As above for SiLU * up with Q(y): chunk 48 of 176 (partial last chunk), 32 with a tile of 16, the
    default (3072 -> 12 programs of 256); y on and off, a row with NaN/Inf."""
    gu = _bf16((r, 2 * i), 43, 3.0)
    if r > 2:
        gu[1, 3], gu[1, 9] = float("nan"), float("inf")
    y1, xq1 = fused.silu_mul(gu, quant=quant, block=block, chunk=triton_next_pow2(i))
    y, xq = fused.silu_mul(gu, quant=quant, block=block, chunk=chunk)
    y_plain, _ = fused.silu_mul(gu, block=block)
    assert _bits_eq(y, y1) and _bits_eq(y, y_plain)
    assert _q_eq(xq, xq1)
    assert_bytes(xq, y, quant)
    none, xq2 = fused.silu_mul(gu, quant=quant, write_y=False, block=block, chunk=chunk)
    assert none is None and _q_eq(xq2, xq)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_split_chunk_choice():
    """Default programs per row: 12 for a 12288-column row and 8 for 4096 at batch 1 (Qwen3-8B's down_proj
    and q/k/v inputs), fewer as rows fill the GPU, never under 256 columns; a chunk is a multiple of 16 and
    the loop's tile divides it."""
    assert fused._chunk(12288, 1, 1024, None) == (1024, 1024)
    assert fused._chunk(4096, 1, 2048, None) == (512, 512)
    assert fused._chunk(12288, 64, 1024, None) == (4096, 1024)
    assert fused._chunk(4096, 256, 2048, None) == (4096, 2048)
    assert fused._chunk(1024, 1, 512, None) == (256, 256)
    assert fused._chunk(80, 1, 128, None) == (128, 128)  # one program for a short row
    assert fused._chunk(208, 3, 512, 48) == (48, 16)
    for bad in (0, 40, -16):
        with pytest.raises(ValueError, match="multiple of 16"):
            fused._chunk(256, 1, 256, bad)


def test_launches_pass_launch_pdl_only_with_the_pdl_constexpr(monkeypatch):
    """Each wrapper hands its launch the PDL constexpr and, only when PDL is on (fp4rl.kernels.pdl), Triton's
    launch_pdl; on this machine's device PDL is off. The launches are recorded, not run."""
    seen = {}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = (grid, kwargs)
            return launch

    for name in ("_add_rmsnorm_kernel", "_silu_mul_kernel", "_qk_norm_rope_kernel"):
        monkeypatch.setattr(fused, name, Spy(name))
    r, h, hkv, d = 2, 4, 2, 32
    x, norm = _bf16((r, 64), 44), _norm(64, 45)
    qkv = _bf16((r, (h + 2 * hkv) * d), 46)
    cos, sin = _rope_tables(torch.tensor([1, 2], device=DEV), d)

    def run_all():
        seen.clear()
        fused.add_rmsnorm(x, x, norm.weight, norm.eps, quant=QUANTS[0])
        fused.silu_mul(_bf16((r, 128), 47), quant=QUANTS[0])
        fused.qk_norm_rope(qkv, cos, sin, h, hkv, d, None, None, 1e-6)
        assert len(seen) == 3
        return [kw for _, kw in seen.values()]

    on_here = fused.pdl.triton_flag(torch.device(DEV))
    for kw in run_all():
        assert kw["PDL"] is on_here and ("launch_pdl" in kw) is on_here
    if DEV == "cpu":
        assert not on_here  # the interpreter has no griddepcontrol
    monkeypatch.setattr(fused.pdl, "triton_flag", lambda device: True)
    for kw in run_all():
        assert kw["PDL"] is True and kw["launch_pdl"] is True
    monkeypatch.setattr(fused.pdl, "triton_flag", lambda device: False)
    for kw in run_all():
        assert kw["PDL"] is False and "launch_pdl" not in kw


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, QUANTS[1]])
def test_gpu_pdl_chain_in_a_cuda_graph_is_the_plain_launch(quant):
    """The three kernels with PDL on, each right after a kernel that writes its input on the same stream (a
    torch copy, then fused kernels that let the next launch at their start), captured in a CUDA graph and
    replayed on new inputs: the same bytes as without PDL (a missing griddepcontrol.wait reads stale data)."""
    from fp4rl.kernels import pdl

    dev = torch.device("cuda")
    was = pdl.is_enabled()
    pdl.set_enabled(True)
    try:
        if not pdl.triton_flag(dev):
            pytest.skip("PDL needs compute capability >= 9 and a Triton with griddepcontrol and launch_pdl")
        r, hq, hkv, d = 4, 16, 4, 128
        k = (hq + 2 * hkv) * d  # add_rmsnorm's y is the qkv of qk_norm_rope
        norm, norm2, qn, kn = _norm(k, 50), _norm(hq * d // 2, 51), _norm(d, 52), _norm(d, 53)
        h0, h2 = _bf16((r, k), 54), _bf16((r, hq * d // 2), 55)
        cos, sin = _rope_tables(torch.tensor([3, 70, 500, 9], device=DEV), d)
        src = torch.empty(r, k, dtype=torch.bfloat16, device=dev)
        xs = torch.empty_like(src)

        def step():
            with pdl.step():  # as the engine's decode step
                xs.copy_(src)  # a plain kernel writes the first input
                x1, y1, q1 = fused.add_rmsnorm(xs, h0, norm.weight, norm.eps, quant=quant)
                q, kk = fused.qk_norm_rope(y1, cos, sin, hq, hkv, d, qn.weight, kn.weight, 1e-6)  # reads y1
                a, aq = fused.silu_mul(q.view(r, hq * d), quant=quant)  # reads q
                x3, y3, q3 = fused.add_rmsnorm(a, h2, norm2.weight, norm2.eps, quant=quant)  # reads a
            outs = [x1, y1, q, kk, a, x3, y3]
            for t in (q1, aq, q3):
                outs += [] if t is None else [t[0], t[1].view(torch.uint8), t[2]]
            return outs

        def plain(seed):
            src.copy_(_bf16((r, k), seed, 2.0))
            pdl.set_enabled(False)
            try:
                return [t.clone() for t in step()]
            finally:
                pdl.set_enabled(True)

        _check_pdl_graph(step, lambda seed: src.copy_(_bf16((r, k), seed, 2.0)),
                         {seed: plain(seed) for seed in (60, 61, 62)})
    finally:
        pdl.set_enabled(was)


def _check_pdl_graph(step, load, want: dict) -> None:
    """step() under PDL, eagerly on a side stream (the PDL variants compile outside the capture), then
    captured once and replayed after load(seed) for each seed in turn: every output equal, bit for bit, to
    want[seed] (the outputs of the launches without PDL)."""
    def same(a, b):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert torch.equal(u, v)

    seeds = list(want)
    load(seeds[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        same([t.clone() for t in step()], want[seeds[0]])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for seed in seeds[1:] + [seeds[0], seeds[-1]]:
        load(seed)
        graph.replay()
        torch.cuda.synchronize()
        same(got, want[seed])


# ----------------------------------------------------------------------------------------------
# MoE combine folded into the residual add + RMSNorm (add_rmsnorm's moe=(d, pos, w))


def _moe_inputs(t, k, hd, seed, w_dtype=torch.bfloat16):
    """x [T, H], the shared-expert term h [T, H], expert outputs d [T k, H] in sorted-row order, pos [T k]
    int32 (a permutation of the rows, not the identity when T k > 1), weights w [T, k] (in (0, 1.05 / k))."""
    x, h, d = _bf16((t, hd), seed, 3.0), _bf16((t, hd), seed + 1), _bf16((t * k, hd), seed + 2, 2.0)
    perm = torch.randperm(t * k, generator=_gen(seed + 3))
    if t * k > 1 and torch.equal(perm, torch.arange(t * k)):
        perm = perm.roll(1)
    w = ((torch.rand(t, k, generator=_gen(seed + 4)) + 0.05) / k).to(w_dtype)  # 24-bit fractions in fp32
    return x, h, d, perm.int().to(DEV), w.to(DEV)


def _torch_combine(d, pos, w):
    """combine's arithmetic in torch: fp32, products rounded before each add (separate ops: no FMA), j in
    order starting from +0, one rounding to bfloat16."""
    t, k = w.shape
    rows = d[pos.long()].view(t, k, -1).float()
    acc = torch.zeros(t, d.shape[1], dtype=torch.float32, device=d.device)
    for j in range(k):
        acc = acc + w[:, j].float()[:, None] * rows[:, j]
    return acc.bfloat16()


def _q_bytes_eq(a, b):
    return (a is None and b is None) or _q_eq(a, b)


def check_moe_fold(x, h, d, pos, w, norm, quant, write_y=True, **kw):
    """add_rmsnorm(x, h, moe=(d, pos, w)) against moe_route.combine then add_rmsnorm (the unfused launches):
    x', y and Q(y) bit for bit; x' also against torch's combine arithmetic. Returns the fused outputs."""
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=quant, write_y=write_y, moe=(d, pos, w),
                                  **kw)
    r = moe_route.combine(d, pos, w)
    if h is not None:
        r = r + h  # SparseMoeBlock: y = routed + shared (bf16 add: one rounding)
    xo_ref, y_ref, xq_ref = fused.add_rmsnorm(x, r, norm.weight, norm.eps, quant=quant, write_y=write_y, **kw)
    assert xo.data_ptr() not in (x.data_ptr(), d.data_ptr())
    assert _bits_eq(xo, xo_ref)
    rt = _torch_combine(d, pos, w)
    assert _nan_eq(xo, x + (rt + h if h is not None else rt))
    if write_y or quant is None:
        assert _bits_eq(y, y_ref)
    else:
        assert y is None and y_ref is None
    assert (xq is None) == (quant is None) and _q_bytes_eq(xq, xq_ref)
    return xo, y, xq


@pytest.mark.parametrize("quant", [None, QUANTS[0], QUANTS[2]])  # 4/6 + mae: both quantizer flags on
@pytest.mark.parametrize("t,k,hd,chunk,block", [(1, 8, 2048, None, None), (3, 2, 208, 48, None),
                                                (8, 1, 64, None, None), (3, 8, 96, 32, 16),
                                                (8, 2, 512, None, None)])
def test_add_rmsnorm_moe_is_combine_then_add_rmsnorm(t, k, hd, chunk, block, quant):
    """T 1/3/8 tokens, top-k 1/2/8, H 64..2048; the default split (2048 at T 1: 8 programs of 256 columns),
    a partial last chunk (48 of 208), chunk 32 on a tile of 16; with and without the shared term h, w in
    bfloat16 and float32, y written or not: the bits of combine followed by add_rmsnorm."""
    x, h, d, pos, w = _moe_inputs(t, k, hd, 70)
    norm = _norm(hd, 71)
    for hh in (h, None):
        for wd in (torch.bfloat16, torch.float32):
            _, y, xq = check_moe_fold(x, hh, d, pos, w.to(wd), norm, quant, block=block, chunk=chunk)
            if quant is not None:
                assert_bytes(xq, y, quant)
    if quant is not None:
        check_moe_fold(x, h, d, pos, w, norm, quant, write_y=False, block=block, chunk=chunk)
        check_moe_fold(x, None, d, pos, w.float(), norm, quant, write_y=False, block=block, chunk=chunk)


def test_add_rmsnorm_moe_with_route_outputs_strides_and_nan():
    """pos and w from moe_route.route itself (bf16 weights of bf16 logits); d a column slice of a wider
    buffer (row stride > H), w a non-contiguous view, x and h with row strides; a NaN in one expert row
    reaches only its token's row, as in the unfused launches."""
    t, k, e, hd = 3, 2, 8, 96
    logits = _bf16((t, e), 72, 2.0)
    _, w, _, pos, _ = moe_route.route(logits, k, True, weight_dtype=torch.bfloat16)
    assert not torch.equal(pos.long().cpu(), torch.arange(t * k))
    wide = _bf16((t * k, hd + 32), 73, 2.0)
    d = wide[:, 16:16 + hd]
    xw, hw = _bf16((t, hd + 16), 74, 3.0), _bf16((t, hd + 48), 75)
    x, h = xw[:, :hd], hw[:, 8:8 + hd]
    wt = w.t().contiguous().t()  # strides (1, T): not contiguous
    assert not wt.is_contiguous() and torch.equal(wt, w)
    norm = _norm(hd, 76)
    for quant in (None, QUANTS[1]):
        for hh in (h, None):
            check_moe_fold(x, hh, d, pos, wt, norm, quant)
    tok = 1
    wide[pos[tok * k + 1].item(), 16 + 5] = float("nan")
    xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=QUANTS[0], moe=(d, pos, w))
    ref_x, ref_y, ref_q = fused.add_rmsnorm(x, moe_route.combine(d, pos, w) + h, norm.weight, norm.eps,
                                            quant=QUANTS[0])
    assert xo[tok, 5].isnan() and y[tok].isnan().all()
    assert not xo[[0, 2]].isnan().any() and not y[[0, 2]].isnan().any()
    assert _nan_eq(xo, ref_x) and _nan_eq(y, ref_y) and _q_eq(xq, ref_q)
    assert_bytes(xq, y, QUANTS[0])


def test_add_rmsnorm_moe_refuses_misfit_arguments():
    """Each misfit moe argument is a ValueError saying which and what to pass."""
    t, k, hd = 2, 4, 64
    x, h, d, pos, w = _moe_inputs(t, k, hd, 77)
    norm = _norm(hd, 78)

    def call(moe):
        return fused.add_rmsnorm(x, h, norm.weight, norm.eps, moe=moe)

    cases = [
        ((d, pos), "moe must be the tuple \\(d, pos, w\\)"),
        ((d, pos, w[:1]), "moe w must be \\[T, k\\] with T = 2"),
        ((d, pos, w.reshape(-1)), "moe w must be \\[T, k\\]"),
        ((d, pos, w.half()), "moe w must be bfloat16 or float32"),
        ((d[:-1], pos, w), "moe d must be \\[T k, H\\] = \\[2 x 4, 64\\]"),
        ((d[:, :32], pos, w), "moe d must be \\[T k, H\\]"),
        ((d.float(), pos, w), "moe d must be bfloat16"),
        ((torch.cat([d, d], 1)[:, ::2], pos, w), "moe d needs unit column stride"),
        ((d, pos.long(), w), "moe pos must be a contiguous int32 \\[T k = 8\\]"),
        ((d, pos[:-1], w), "moe pos must be a contiguous int32"),
        ((d, torch.cat([pos, pos])[::2], w), "moe pos must be a contiguous int32"),
        ((d, pos.cpu().numpy(), w), "moe pos must be a tensor on x's device"),
    ]
    if DEV == "cuda":
        cases.append(((d.cpu(), pos, w), "moe d must be a tensor on x's device"))
    for moe, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call(moe)
    call((d, pos, w))  # the fitting arguments pass


def test_add_rmsnorm_moe_constexprs(monkeypatch):
    """Without moe the launch is the former kernel's variant (HAS_MOE False, K_TOP 1, whatever else); with
    moe HAS_MOE and K_TOP = top-k, and the combine's strides (d's rows, w's two). Recorded, not run."""
    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((grid, args, kwargs))
            return launch

    monkeypatch.setattr(fused, "_add_rmsnorm_kernel", Spy())
    t, k, hd = 2, 4, 64
    x, h, d, pos, w = _moe_inputs(t, k, hd, 79)
    norm = _norm(hd, 80)
    fused.add_rmsnorm(x, h, norm.weight, norm.eps)
    fused.add_rmsnorm(x, h, norm.weight, norm.eps, moe=(d, pos, w.float()))
    (_, _, plain), (grid, args, moe) = seen
    assert plain["HAS_MOE"] is False and plain["K_TOP"] == 1
    assert moe["HAS_MOE"] is True and moe["K_TOP"] == k and moe["HAS_RES"] is True
    assert {key: v for key, v in plain.items() if key not in ("HAS_MOE", "K_TOP")} == \
        {key: v for key, v in moe.items() if key not in ("HAS_MOE", "K_TOP")}
    assert args[8] is d and args[9] is pos and args[10].dtype == torch.float32
    assert args[16:19] == (d.stride(0), k, 1)
    assert grid == (t, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None] + QUANTS)
@pytest.mark.parametrize("t", [1, 8, 32])
def test_gpu_moe_fold_qwen3_30b_a3b(t, quant):
    """Qwen3-30B-A3B's MoE layers (H 2048, top-8): on CUDA, compiled, the bits of combine then add_rmsnorm,
    with and without a shared term, bf16 and fp32 weights, y on and off; pos and w from the route kernel;
    T 1 and 8: 8 programs of 256 columns per row, T 32: 4 of 512."""
    k, e, hd = 8, 128, 2048
    x, h, d, _, _ = _moe_inputs(t, k, hd, 81)
    logits = _bf16((t, e), 82, 2.0)
    _, w16, _, pos, _ = moe_route.route(logits, k, True, weight_dtype=torch.bfloat16)
    _, w32, _, pos32, _ = moe_route.route(logits, k, True, weight_dtype=torch.float32)  # 24-bit weights
    assert torch.equal(pos, pos32) and not torch.equal(pos.long().cpu(), torch.arange(t * k))
    norm = _norm(hd, 83)
    for hh in (None, h):
        for w in (w16, w32):
            _, y, xq = check_moe_fold(x, hh, d, pos, w, norm, quant)
            if quant is not None:
                assert_bytes(xq, y, quant)
                check_moe_fold(x, hh, d, pos, w, norm, quant, write_y=False)
            with torch.no_grad():
                r = _torch_combine(d, pos, w)
                assert_norm_close(y, norm(x + (r + hh if hh is not None else r)))
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_moe_fold_pdl_in_a_cuda_graph():
    """With PDL on, add_rmsnorm(moe=...) right after the kernels that write d (a copy) and w (the route),
    captured in a CUDA graph and replayed on new inputs: the bytes of the plain launches (a read before
    griddepcontrol.wait would see stale expert rows)."""
    from fp4rl.kernels import pdl

    dev = torch.device("cuda")
    was = pdl.is_enabled()
    pdl.set_enabled(True)
    try:
        if not pdl.triton_flag(dev):
            pytest.skip("PDL needs compute capability >= 9 and a Triton with griddepcontrol and launch_pdl")
        t, k, e, hd = 8, 8, 128, 2048
        x, h, _, _, _ = _moe_inputs(t, k, hd, 84)
        norm = _norm(hd, 85)
        src_d = torch.empty(t * k, hd, dtype=torch.bfloat16, device=dev)
        src_l = torch.empty(t, e, dtype=torch.bfloat16, device=dev)
        d = torch.empty_like(src_d)

        def step():
            with pdl.step():
                d.copy_(src_d)
                _, w, _, pos, _ = moe_route.route(src_l, k, True, weight_dtype=torch.bfloat16)
                xo, y, xq = fused.add_rmsnorm(x, h, norm.weight, norm.eps, quant=QUANTS[1], moe=(d, pos, w))
            return [xo, y, xq[0], xq[1].view(torch.uint8), xq[2]]

        def load(seed):
            src_d.copy_(_bf16((t * k, hd), seed, 2.0))
            src_l.copy_(_bf16((t, e), seed + 1, 2.0))

        def plain(seed):
            load(seed)
            pdl.set_enabled(False)
            try:
                outs = [v.clone() for v in step()]
                _, w, _, pos, _ = moe_route.route(src_l, k, True, weight_dtype=torch.bfloat16)
                xo, y, xq = fused.add_rmsnorm(x, moe_route.combine(src_d, pos, w) + h, norm.weight, norm.eps,
                                              quant=QUANTS[1])
                for u, v in zip(outs, [xo, y, xq[0], xq[1].view(torch.uint8), xq[2]]):
                    assert torch.equal(u, v)  # no PDL: the unfused launches' bytes
                return outs
            finally:
                pdl.set_enabled(True)

        _check_pdl_graph(step, load, {seed: plain(seed) for seed in (90, 92, 94)})
    finally:
        pdl.set_enabled(was)
