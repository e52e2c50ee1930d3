"""The CUDA quantize kernels (fp4rl/kernels/quantize/quant.cu): byte-identical to the reference in every
mode they take, on the GPU; on CPU, their launch plan and the fallback to the Triton kernels when they fail.

The E2M1 rounding they use (one FADD at the binade's step, the code read off the sum's bits) is checked
here on CPU against the reference too, in numpy float32 (the same IEEE operations as the kernel's)."""

import numpy as np
import pytest
import torch

from fp4rl.kernels import quantize as kq
from fp4rl.kernels.quantize import cuda as qc
from fp4rl.nvfp4 import reference
from fp4rl.nvfp4.format import round_to_e2m1


def _e2m1_cuda(z):
    """quant.cu's e2m1 in numpy float32: code with sign bit, and the magnitude's E2M1 value."""
    a = np.minimum(np.abs(z), np.float32(6))
    e = np.maximum(a.view(np.uint32) & np.uint32(0x7F800000), np.uint32(0x3F800000))
    m = (e + np.uint32(22 << 23)).view(np.float32)
    t = (a + m).astype(np.float32)
    tb = t.view(np.uint32)
    code = (tb & np.uint32(0x7FFFFF)) + (tb >> np.uint32(22)) - np.uint32(298)
    return code | ((z < 0).astype(np.uint32) << 3), (t - m).astype(np.float32)


def test_e2m1_rounding_matches_reference():
    """Every tie and binade edge of the grid, their float32 neighbours, -0.0, saturation, and 2^20 random
    values from 2^-30 to 8."""
    grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 1e30], np.float32)
    near = np.concatenate([np.nextafter(grid, np.float32(-1)), grid, np.nextafter(grid, np.float32(9))])
    rng = np.random.default_rng(0)
    rnd = np.exp2(rng.uniform(-30, 3, 1 << 20)).astype(np.float32)
    z = np.concatenate([near, rnd, [np.float32(1e-45)]]).astype(np.float32)
    z = np.concatenate([z, -z])
    code, val = _e2m1_cuda(z)
    want = round_to_e2m1(torch.from_numpy(z.copy())).numpy().astype(np.uint32)
    assert np.array_equal(code, want)
    values = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    assert np.array_equal(val, values[want & 7])
    assert code[np.flatnonzero(z == 0)].max() == 0  # -0.0 -> code 0; -tiny -> 8
    assert code[-1] == 8


@pytest.mark.parametrize("nb_row,want", [(1, (1, 1, 256)), (8, (1, 8, 256)), (256, (1, 256, 256)),
                                         (257, (1, 512, 512)), (896, (2, 512, 512)), (4096, (8, 512, 512))])
def test_rows_plan(nb_row, want):
    bpt, tpr, cta = qc.rows_plan(nb_row)
    assert (bpt, tpr, cta) == want and bpt * tpr >= nb_row and cta % tpr == 0
    with pytest.raises(ValueError, match="1..4096"):
        qc.rows_plan(4097)
    assert qc.rows_plan(256, 4) == (4, 64, 256) and qc.rows_plan(896, 2) == (2, 512, 512)
    assert qc.rows_plan(3, 8) == (8, 1, 256)


def test_source_defines_every_macro():
    """The kernels' compile-time switches all come from _defs (a missing one would be a silent 0)."""
    src = qc.source(dict(qc.rows_config(torch.bfloat16, True, True, True, 200, 2)[2]))
    for name in ("RULE46", "MAE", "NONFINITE", "SRC", "GIVEN_ROWS", "IN_F32", "FAST46", "BPT", "TPR", "CTA",
                 "MINB"):
        assert f"#define {name} " in src
        assert name in qc._SOURCE.read_text()


def test_failure_falls_back_to_triton(monkeypatch):
    """NVRTC or the launch failing: a warning, the kernels switched off, and the Triton bytes."""
    monkeypatch.setitem(qc.STATE, "on", True)
    monkeypatch.setitem(qc.STATE, "error", None)
    monkeypatch.setattr(qc, "usable", lambda x: qc.STATE["on"])
    monkeypatch.setitem(qc.ROWS_BPT, "6", 1)  # no device query before the launch

    def broken(*a, **k):
        raise RuntimeError("nvrtc: no such architecture")

    monkeypatch.setattr(qc, "_launch", broken)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(8, 64) * torch.logspace(-2, 2, 64)).to(dev)
    with pytest.warns(UserWarning, match="CUDA quantize kernels disabled"):
        d, s, g = kq.quantize_2d(x, per_row=True)
    assert qc.STATE["on"] is False and "no such architecture" in qc.STATE["error"]
    q = reference.quantize(x, scale_scope="row")
    assert torch.equal(d, q.data) and torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8))


# ----------------------------------------------------------------------------------------------- GPU


@pytest.fixture
def cuda_on(monkeypatch):
    """The CUDA kernels on for the test; afterwards none of them may have failed (a failure would switch
    them off with a warning and the Triton kernels would make the bytes: the test would not test them)."""
    monkeypatch.setitem(qc.STATE, "on", True)
    monkeypatch.setitem(qc.STATE, "error", None)
    yield
    assert qc.STATE["on"] and qc.STATE["error"] is None, qc.STATE["error"]


def _x(shape, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    r, k = shape
    if kind == "wide":
        x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, k)[torch.randperm(k, generator=g)]
    elif kind == "grid":  # E2M1 grid points and midpoints times powers of two: ties everywhere
        v = torch.arange(-48, 49, dtype=torch.float32) * 0.125
        x = v[torch.randint(0, v.numel(), shape, generator=g)]
        x = x * 2.0 ** torch.randint(-3, 4, (r, 1), generator=g)
    elif kind == "rows":  # rows over 60 decades: tiny and huge amaxes (the IEEE division of 4/6)
        x = torch.randn(shape, generator=g) * torch.logspace(-28, 32, r)[:, None]
    elif kind == "edges":  # subnormal values; row amaxes 2^-70, 2^100 (the division-free range's ends) and
        # just outside; a row of subnormals only (dtype's smallest normal: bf16 and fp32 share it)
        x = torch.randn(shape, generator=g) * 2.0 ** -130
        ends = [2.0 ** -70, 2.0 ** 100, 2.0 ** -71, 2.0 ** 101]
        for i in range(min(r - 1, len(ends))):
            x[i + 1] = torch.randn(k, generator=g).clamp(-0.9, 0.9) * ends[i]
            x[i + 1, -1] = ends[i]
    x = x.to(dtype)
    x[0, :16] = 0.0  # an all-zero block
    x[1 % r, 16 % k:32 % k or k] = -0.0
    return x.cuda()


def _check(x, **kw):
    d, s, g = kq.quantize_2d(x, check_finite=False, **kw)
    ref_kw = dict(scale_rule=kw.get("scale_rule", "6"), err=kw.get("err", "mse"),
                  scale_scope="row" if kw.get("per_row") else "tensor",
                  allow_nonfinite=kw.get("allow_nonfinite", False))
    for name in ("amax", "global_scale"):
        if name in kw:
            ref_kw[name] = kw[name].reshape(-1, 1) if kw.get("per_row") else kw[name]
    q = reference.quantize(x, **ref_kw)
    assert torch.equal(d, q.data), f"{(d != q.data).sum().item()} code bytes differ ({kw})"
    assert torch.equal(s.view(torch.uint8), q.block_scale.view(torch.uint8)), f"block scales differ ({kw})"
    assert torch.equal(g.reshape(-1), q.global_scale.reshape(-1).to(g.device)), f"global scales differ ({kw})"


@pytest.mark.parametrize("rule,err,fast46", [("6", "mse", None), ("4/6", "mse", None), ("4/6", "mae", None),
                                             ("4/6", "mse", 3), ("4/6", "mae", 3), ("4/6", "mse", "3r"),
                                             ("4/6", "mae", "3r"), ("4/6", "mse", 2), ("4/6", "mae", 2),
                                             ("4/6", "mse", 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_matches_reference(cuda_on, monkeypatch, rule, err, fast46, dtype):
    """Every mode's bytes against the reference on wide, grid, 60-decade and edge-case tensors; fast46 set:
    the 4/6 kernels with decide46 (FAST46 3, 3 reading blocks twice, 2 or 1) at every size (the launcher
    takes it from FAST46_MIN_BLOCKS blocks, more than these tensors hold), else the launcher's own choice
    (here the exact errors)."""
    if fast46 is not None:  # "3r": FAST46 3 with the row kernel reading each block twice (RELOAD46)
        monkeypatch.setattr(qc, "FAST46", 3 if fast46 == "3r" else fast46)
        monkeypatch.setattr(qc, "RELOAD46", fast46 == "3r")
        monkeypatch.setattr(qc, "RELOAD46_MIN_WAVES", 0.0)  # 8 blocks a thread whatever the size
        monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 0)
    for shape in [(1, 16), (3, 48), (37, 4096), (5, 4112), (2, 14336), (3, 65536), (300, 128)]:
        for kind in ("wide", "grid", "rows", "edges"):
            x = _x(shape, dtype, kind, seed=shape[0] + shape[1])
            assert qc.usable(x)
            for per_row in (False, True):
                _check(x, scale_rule=rule, err=err, per_row=per_row)
            amax = x.float().abs().amax(dim=1) * 0.75  # values beyond saturate
            _check(x, scale_rule=rule, err=err, per_row=True, amax=amax)
            _check(x, scale_rule=rule, err=err, amax=amax.max().reshape(()))
            gsc = (x.float().abs().amax(dim=1) / 2688.0).clamp(min=1e-30)
            _check(x, scale_rule=rule, err=err, per_row=True, global_scale=gsc)
            _check(x, scale_rule=rule, err=err, global_scale=gsc.max().reshape(()))
        zero = torch.zeros((), device=x.device)
        _check(x, scale_rule=rule, err=err, amax=zero)  # imposed amax 0: S_enc = 1, as TE


def _check_tile(x, **kw):
    """16x16 tiles through quantize_2d against the reference (per-tensor or imposed scale)."""
    d, s, g = kq.quantize_2d(x, tile16=True, check_finite=False, **kw)
    q = reference.quantize(x, tile=(16, 16), **kw)
    assert torch.equal(d, q.data), f"{(d != q.data).sum().item()} code bytes differ ({kw})"
    su, qu = s.view(torch.uint8), q.block_scale.view(torch.uint8)
    assert torch.equal(su, qu), f"{(su != qu).sum().item()} block scales differ ({kw})"
    assert torch.equal(g.reshape(-1), q.global_scale.reshape(-1).to(g.device)), f"global scales differ ({kw})"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tile_fast46", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_cuda_tile16_matches_reference(cuda_on, monkeypatch, dtype, tile_fast46):
    """16x16 tiles on the CUDA kernel (a half-warp a tile; the tile's max and 4/6 error tree by shuffles):
    rules 6 and 4/6 (mse, mae), the tensor's amax, an imposed amax and an imposed g, against the reference;
    odd and even block columns (a warp's second tile past the last column), the division-free and the IEEE
    4/6 errors ("rows": amaxes past 2^100; "edges"), NaN / Inf with allow_nonfinite (and refused without), and
    TE's tree order: a tile whose 4/6 pick flips under any other pairing of its rows. Rule 6 too (off by
    default: slower than Triton there), on the strip kernel (a warp 16 rows x 16 or 8 block columns, a block
    split over 2 or 4 lanes: block columns past the last in a warp, NaN / Inf in half a block) and on the tile
    kernel. tile_fast46: 4/6 decided per tile at every size, on the tile kernel (the summed block bounds,
    FAST46 3) and for bfloat16 on the strip kernel too (STRIP16_46: the lanes' bounds), the tile kernel with
    2 tile pairs a warp staged through shared memory where they fit (the defaults: TILE16_U, TILE16_SMEM),
    else the exact errors at 4 pairs a warp, not staged."""
    monkeypatch.setattr(qc, "TILE16_RULE6", True)
    monkeypatch.setattr(qc, "TILE16_FAST46", tile_fast46)
    monkeypatch.setattr(qc, "TILE16_U", 2 if tile_fast46 else 4)
    monkeypatch.setattr(qc, "TILE16_SMEM", tile_fast46)  # (staged where the pairs are a multiple of 2)
    monkeypatch.setattr(qc, "FAST46", 3)
    monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 0 if tile_fast46 else 1 << 40)
    for shape in [(16, 16), (48, 80), (64, 4096), (32, 4112), (4096, 2048)]:
        for kind in ("wide", "grid", "rows", "edges"):
            x = _x(shape, dtype, kind, seed=shape[0] + shape[1])
            assert qc.usable(x)
            for rule, err, strip in (("6", "mse", True), ("6", "mse", False), ("4/6", "mse", False),
                                     ("4/6", "mae", False), ("4/6", "mse", True), ("4/6", "mae", True)):
                monkeypatch.setattr(qc, "STRIP16", strip)
                monkeypatch.setattr(qc, "STRIP16_46", strip)  # (4/6 decided per tile on bfloat16)
                _check_tile(x, scale_rule=rule, err=err)
                _check_tile(x, scale_rule=rule, err=err, amax=x.float().abs().amax() * 0.75)
                gsc = (x.float().abs().amax() / 2688.0).clamp(min=1e-30)
                _check_tile(x, scale_rule=rule, err=err, global_scale=gsc)
    x = _x((64, 256), dtype, "wide", seed=3)
    x[3, 5], x[7, 1], x[9, 30] = float("nan"), float("inf"), -float("inf")
    x[16:32, 32:48] = float("nan")  # a whole NaN tile
    x[33, 64:72], x[40, 88:96] = float("nan"), float("nan")  # NaN half blocks (the strip kernel: a lane's)
    z = torch.zeros(16, 16, dtype=dtype, device="cuda")  # a tile of zeros and +-Inf: its finite max is 0
    z[0, 0], z[5, 9] = float("inf"), -float("inf")
    for rule, strip in (("6", True), ("6", False), ("4/6", False), ("4/6", True)):
        monkeypatch.setattr(qc, "STRIP16", strip)
        monkeypatch.setattr(qc, "STRIP16_46", strip)
        _check_tile(x, scale_rule=rule, allow_nonfinite=True)
        _check_tile(z, scale_rule=rule, allow_nonfinite=True)
        with pytest.raises(ValueError, match="NaN or Inf"):
            kq.quantize_2d(x, tile16=True, scale_rule=rule)
    # unchecked NaN / Inf without allow_nonfinite (the engine's calls): a block's max over its non-NaN values,
    # NaN for an all-NaN block; the strip kernel's bytes as the tile kernel's, its scales as Triton's
    outs = []
    monkeypatch.setattr(qc, "STRIP16_46", False)
    for strip, on in ((True, True), (False, True), (True, False)):
        monkeypatch.setattr(qc, "STRIP16", strip)
        monkeypatch.setitem(qc.STATE, "on", on)
        outs.append(kq.quantize_2d(x, tile16=True, check_finite=False))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(outs[0][:2], outs[1][:2]))
    assert torch.equal(outs[0][1].view(torch.uint8), outs[2][1].view(torch.uint8))
    monkeypatch.setitem(qc.STATE, "on", True)
    # u = 2^-30: row 1 (four 1.0) costs only 4 0.25, row 2 (4.5) only 6 0.25, rows 3 and 4 16u and 25u to
    # both; TE's order gives err4 = 0.25 + 32u < err6 = 0.25 + 64u, rows (2j, 2j+1) first the other way round
    t = torch.zeros(16, 16)
    t[0, 0], t[2, 0], t[3, 0], t[4, 0] = 6.0, 4.5, 2.0 ** -13, 5 * 2.0 ** -15
    t[1, :4] = 1.0
    x = torch.cat([torch.cat([t] * 3, 1), torch.cat([t] * 3, 1) * 0.5], 0).to(dtype).cuda()
    for kw in (dict(), dict(global_scale=torch.tensor(2.0 ** -8, device="cuda"))):
        assert reference.quantize(x, tile=(16, 16), scale_rule="4/6", **kw).block_scale.float()[0, 0] == 384.0
        for strip in (False, True):
            monkeypatch.setattr(qc, "STRIP16_46", strip)
            _check_tile(x, scale_rule="4/6", **kw)
    built = {name for name, _, _ in qc._KERNELS}
    assert {"nvfp4_quant_tile16", "nvfp4_quant_strip16"} <= built, built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("min_blocks", [None, 0])
def test_gpu_cuda_nonfinite(cuda_on, monkeypatch, min_blocks):
    """min_blocks 0: rule 4/6 with decide46 (its NaN / Inf blocks go to the exact errors) at this size."""
    if min_blocks is not None:
        monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", min_blocks)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x((64, 256), dtype, "wide", seed=3)
        x[3, 5], x[7, 1], x[9, 30] = float("nan"), float("inf"), -float("inf")
        x[11, 32:48] = float("nan")
        x[13, 3] = -0.0
        for rule in ("6", "4/6"):
            for per_row in (False, True):
                _check(x, scale_rule=rule, per_row=per_row, allow_nonfinite=True)
                with pytest.raises(ValueError, match="NaN or Inf"):
                    kq.quantize_2d(x, scale_rule=rule, per_row=per_row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_and_misaligned(cuda_on, monkeypatch):
    """Captured in a CUDA graph (no host sync inside), replayed on new data; a configuration first met inside
    a capture takes the Triton kernels for that call (no module build while capturing) and leaves the CUDA
    kernels on; a misaligned view and float16 take the Triton kernels with the same bytes; an imposed scale
    on another device is refused."""
    x = _x((64, 512), torch.bfloat16, "wide", seed=5)
    static = x.clone()
    out = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kq.quantize_2d(static, per_row=True, check_finite=False)  # compile outside the capture
        kq.quantize_2d(static, check_finite=False)
        qc.STATE["on"] = False  # the Triton kernel of the 4/6 call below, compiled outside the capture
        kq.quantize_2d(static, per_row=True, scale_rule="4/6", err="mae", check_finite=False)
        qc.STATE["on"] = True
    torch.cuda.current_stream().wait_stream(s)
    monkeypatch.setattr(qc, "_KERNELS", {ident: k for ident, k in qc._KERNELS.items()  # 4/6 mae rows: unbuilt
                                         if not (ident[0] == "nvfp4_quant_rows" and dict(ident[1])["MAE"])})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out["row"] = kq.quantize_2d(static, per_row=True, check_finite=False)
        out["tensor"] = kq.quantize_2d(static, check_finite=False)
        out["row 4/6"] = kq.quantize_2d(static, per_row=True, scale_rule="4/6", err="mae", check_finite=False)
    y = _x((64, 512), torch.bfloat16, "grid", seed=6)
    static.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    for key, kw in (("row", dict(scale_scope="row")), ("tensor", {}),
                    ("row 4/6", dict(scale_scope="row", scale_rule="4/6", err="mae"))):
        q = reference.quantize(y, **kw)
        assert torch.equal(out[key][0], q.data)
        assert torch.equal(out[key][1].view(torch.uint8), q.block_scale.view(torch.uint8))
        assert torch.equal(out[key][2].reshape(-1), q.global_scale.reshape(-1))
    with pytest.raises(ValueError, match="move it to x's device"):
        kq.quantize_2d(static, per_row=True, amax=torch.ones(64))
    flat = _x((1, 4096 + 8), torch.bfloat16, "wide", seed=7).reshape(-1)[4:4100].reshape(4, 1024)
    assert not qc.usable(flat)
    _check(flat, per_row=True)
    half = (flat.float() / flat.float().abs().amax()).half()  # float16 range
    assert not qc.usable(half)
    _check(half, per_row=True)


@pytest.mark.parametrize("bpt", [2, 4])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_rows_blocks_per_thread(cuda_on, monkeypatch, bpt):
    """The row kernel with several blocks per thread (fewer threads per row, idle tails)."""
    monkeypatch.setattr(qc, "ROWS_BPT", {"6": bpt, "4/6": bpt})
    for dtype in (torch.bfloat16, torch.float32):
        for shape in [(3, 16), (5, 112), (37, 4096), (4, 14336), (2, 65536)]:
            x = _x(shape, dtype, "wide", seed=shape[1])
            for rule in ("6", "4/6"):
                _check(x, scale_rule=rule, per_row=True)
            x[1 % shape[0], 3] = float("inf")
            _check(x, scale_rule="4/6", per_row=True, allow_nonfinite=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reload", [False, True])
def test_gpu_cuda_nonfinite_unchecked_matches_triton(cuda_on, monkeypatch, reload):
    """Without allow_nonfinite and without the check (the engine's setting) the bytes of blocks with NaN/Inf
    are the Triton kernels' (which the fused decode kernels reproduce): amaxes over the finite values, block
    maxima over the non-NaN ones (NaN when all 16 are NaN). reload: rule 4/6 per row on the row kernel that
    reads each block twice (its second read takes the first's block maxima, NaN / Inf ones computed again)."""
    if reload:
        monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 0)
        monkeypatch.setattr(qc, "RELOAD46_MIN_WAVES", 0.0)
        monkeypatch.setattr(qc, "RELOAD46", True)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x((48, 256), dtype, "wide", seed=9)
        x[1, 5], x[2, 20], x[3, 40] = float("nan"), float("inf"), -float("inf")
        x[4, 48:64] = float("nan")  # an all-NaN block
        x[5, 64:80] = float("inf")
        x[6] = float("nan")  # an all-NaN row
        for rule in ("6", "4/6"):
            for per_row in (False, True):
                kw = dict(scale_rule=rule, per_row=per_row, check_finite=False)
                got = kq.quantize_2d(x, **kw)
                assert qc.STATE["on"] and qc.STATE["error"] is None  # got is the CUDA kernels'
                qc.STATE["on"] = False
                want = kq.quantize_2d(x, **kw)
                qc.STATE["on"] = True
                assert torch.equal(got[0], want[0]), (dtype, rule, per_row)
                assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), (rule, per_row)
                assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("err", ["mse", "mae"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fast46_near_ties(cuda_on, monkeypatch, err):
    """quant.cu's decide46 on the GPU against the reference where it must give way to the exact errors: near
    ties found by bisection and blocks on both candidates' grids moved by a few ulps
    (tests/test_quant_fast46.py), as one tensor (per tensor and per row, imposed amax and g), at FAST46 3, 2,
    1 and 0 whatever the size; and bfloat16 near ties and sign blocks (FAST46 3's signs)."""
    from test_quant_fast46 import grid_ties, near_ties

    monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 0)  # these tensors are smaller than the launcher's gate
    monkeypatch.setattr(qc, "RELOAD46_MIN_WAVES", 0.0)  # and than the RELOAD row kernel's
    for src in (0, 3):
        for x, v in (near_ties(err == "mae", src), grid_ties(src)):
            x = x[: x.shape[0] // 4 * 4].reshape(-1, 64).cuda()  # 4 blocks a row: the row kernel's path too
            for fast, reload in ((3, True), (3, False), (2, False), (1, False), (0, False)):
                monkeypatch.setattr(qc, "FAST46", fast)
                monkeypatch.setattr(qc, "RELOAD46", reload)
                if src == 0:
                    _check(x, scale_rule="4/6", err=err, amax=torch.tensor(v, device="cuda"))
                    _check(x, scale_rule="4/6", err=err)
                    _check(x, scale_rule="4/6", err=err, per_row=True)
                else:
                    _check(x, scale_rule="4/6", err=err, global_scale=torch.tensor(v, device="cuda"))
    from test_quant_fast46 import sign_blocks

    x16 = near_ties(err == "mae", 0, dtype=torch.bfloat16)[0]
    for x in (x16[: x16.shape[0] // 4 * 4].reshape(-1, 64), sign_blocks(torch.bfloat16).reshape(-1, 64),
              sign_blocks(torch.float32).reshape(-1, 64)):
        x = x.cuda()
        for fast, reload in ((3, True), (3, False), (2, False)):
            monkeypatch.setattr(qc, "FAST46", fast)
            monkeypatch.setattr(qc, "RELOAD46", reload)
            _check(x, scale_rule="4/6", err=err)
            _check(x, scale_rule="4/6", err=err, per_row=True)


def test_fast46_from_its_size_with_its_register_caps(monkeypatch):
    """The launcher takes decide46 (FAST46 3, the default) from FAST46_MIN_BLOCKS blocks a call, with at most
    2 blocks a thread and the 64-register cap in the row kernel; smaller calls and rule 6 compile without it
    (measured faster on a decode-sized tensor). Launches recorded, not run (no GPU needed)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(qc, "_launch", lambda name, key, *a: calls.append((name, dict(key))))
    sm = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: sm)
    monkeypatch.setattr(qc, "FAST46", 3)
    for rows, rule46, src, want in ((256, True, 1, 0), (4096, True, 1, 3), (4096, False, 1, 0),
                                    (32, True, 0, 0), (4096, True, 0, 3)):
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
        qc.quantize(x, None, None, None, None, None, None, src, False, rule46, False, False)
        name, key = calls[-1]
        assert name == ("nvfp4_quant_rows" if src == 1 else "nvfp4_quant_flat")
        assert key["FAST46"] == want, (rows, rule46, src, key)
        if src == 1 and want:
            assert key["BPT"] == 2 and key["MINB"] == 4  # 64 registers, 32 warps an SM
    monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 0)
    qc.quantize(torch.zeros(32, 4096, dtype=torch.bfloat16), *[None] * 6, 1, False, True, False, False)
    assert calls[-1][1]["FAST46"] == 3
    # blocks read twice: 8 a thread (one warp a row at K = 4096) from 2 x 8 x the thread slots, 4 from
    # 2 x 4 x, else held in registers; bfloat16 only
    monkeypatch.setattr(qc, "RELOAD46", True)
    monkeypatch.setattr(qc, "FAST46_MIN_BLOCKS", 1 << 17)
    slots = 132 * 2048
    big, mid = 2 * 8 * slots // 256, 2 * 4 * slots // 256  # rows of 256 blocks
    for rows, dtype, want, bpt in ((big, torch.bfloat16, 1, 8), (mid, torch.bfloat16, 1, 4),
                                   (4096, torch.bfloat16, None, 2), (big, torch.float32, None, 2)):
        qc.quantize(torch.zeros(rows, 4096, dtype=dtype), *[None] * 6, 1, False, True, False, False)
        key = calls[-1][1]
        assert key.get("RELOAD") == want and key["BPT"] == bpt, (rows, dtype, key)
        if want:
            assert key["TPR"] == 256 // bpt and key["MINB"] == 4
    # rows of more than 512 blocks (K > 8192): 4 a thread from 0.8 x the thread slots, 8 from 2 x 8 x; rows of
    # 512 (K = 8192) keep the 2-wave rule
    for rows, k, want, bpt in ((8192, 14336, 1, 8), (4096, 14336, 1, 4), (1024, 14336, 1, 4),
                               (512, 14336, None, 2), (2048, 8192, None, 2)):
        qc.quantize(torch.zeros(rows, k, dtype=torch.bfloat16), *[None] * 6, 1, False, True, False, False)
        key = calls[-1][1]
        assert key.get("RELOAD") == want and key["BPT"] == bpt, (rows, key)
    monkeypatch.setattr(qc, "RELOAD46", False)
    qc.quantize(torch.zeros(big, 4096, dtype=torch.bfloat16), *[None] * 6, 1, False, True, False, False)
    assert "RELOAD" not in calls[-1][1] and calls[-1][1]["BPT"] == 2


def test_flat_grid_caps(monkeypatch):
    """The flat 1x16 kernel's grid: a CTA per 256 blocks up to FLAT_CTAS_PER_SM (rule 6) or FLAT46_CTAS_PER_SM
    (rule 4/6) CTAs an SM, then grid-striding; the amax pass up to AMAX_CTAS_PER_SM. Launches recorded, not
    run (no GPU needed)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(qc, "_launch", lambda name, key, x, grid, *a: calls.append((name, grid)))
    sm = SimpleNamespace(multi_processor_count=2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: sm)
    x = torch.zeros(1024, 4096, dtype=torch.bfloat16)  # 262144 blocks: 1024 CTAs uncapped
    for rule46, cap in ((False, qc.FLAT_CTAS_PER_SM), (True, qc.FLAT46_CTAS_PER_SM)):
        qc.quantize(x, None, None, None, None, None, None, 3, False, rule46, False, False)
        assert calls[-1] == ("nvfp4_quant_flat", (2 * cap, 1, 1))
    qc.quantize(x[:16], None, None, None, None, None, None, 3, False, False, False, False)
    assert calls[-1] == ("nvfp4_quant_flat", (16, 1, 1))  # (4096 blocks: under the cap)
    assert (qc.FLAT_CTAS_PER_SM, qc.FLAT46_CTAS_PER_SM) == (64, 16)


def test_tile16_launch_plan(monkeypatch):
    """16x16 tiles: the tile kernel (two tiles a warp, 8 warps a CTA, grid-stride) with the exact 4/6 errors,
    or decide46 per tile (FAST46 3) with TILE16_FAST46 from FAST46_MIN_BLOCKS blocks; rule 6 on the strip
    kernel (STRIP16) or the tile kernel; 4/6 decided per tile on the strip kernel for bfloat16 (STRIP16_46,
    the default: float32, the exact errors below FAST46_MIN_BLOCKS and TILE16_FAST46 off take the tile
    kernel); rows not in 16s and per-row scales refused by name. Launches recorded, not run (no GPU
    needed)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(qc, "_launch", lambda name, key, x, grid, block, args: calls.append(
        (name, dict(key), grid, args)))
    sm = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: sm)
    monkeypatch.setattr(qc, "FAST46", 3)
    assert (qc.TILE16_U, qc.TILE16_SMEM, qc.STRIP16_46) == (2, True, True)  # the defaults
    x = torch.zeros(4096, 4112, dtype=torch.bfloat16)  # 257 block columns: 129 tile pairs a tile row
    for mae in (False, True):  # 4/6 decided per tile, bfloat16: the strip kernel, 17 strips a tile row
        monkeypatch.setattr(qc, "TILE16_FAST46", True)
        qc.quantize(x, None, None, None, None, None, None, 3, False, True, mae, False, True)
        name, key, grid, args = calls[-1]
        assert name == "nvfp4_quant_strip16" and (key["RULE46"], key["FAST46"], key["MAE"]) == (1, 3, mae)
        assert key["SRC"] == 3 and grid == (-(-256 * 17 // 8), 1, 1) and args[-2:] == [256, 257]
        monkeypatch.setattr(qc, "STRIP16_CTAS_PER_SM", 2)  # (the grid's cap: then each CTA loops)
        qc.quantize(x, None, None, None, None, None, None, 3, False, True, mae, False, True)
        assert calls[-1][2] == (132 * 2, 1, 1)
        monkeypatch.setattr(qc, "STRIP16_CTAS_PER_SM", 32)
        qc.quantize(x.float(), None, None, None, None, None, None, 3, False, True, mae, False, True)
        assert calls[-1][0] == "nvfp4_quant_tile16" and calls[-1][1]["FAST46"] == 3  # (float32)
        qc.quantize(x[:64], None, None, None, None, None, None, 3, False, True, mae, False, True)
        assert calls[-1][0] == "nvfp4_quant_tile16" and calls[-1][1]["FAST46"] == 0  # (few blocks: exact)
        monkeypatch.setattr(qc, "TILE16_FAST46", False)
        qc.quantize(x, None, None, None, None, None, None, 3, False, True, mae, False, True)
        assert calls[-1][0] == "nvfp4_quant_tile16" and calls[-1][1]["FAST46"] == 0
    monkeypatch.setattr(qc, "STRIP16_46", False)  # (below: the tile kernel, one pair a warp first)
    monkeypatch.setattr(qc, "TILE16_U", 1)
    for fast, want in ((False, 0), (True, 3)):
        monkeypatch.setattr(qc, "TILE16_FAST46", fast)
        qc.quantize(x, None, None, None, None, None, None, 0, False, True, False, False, True)
        name, key, grid, args = calls[-1]
        assert name == "nvfp4_quant_tile16" and key["FAST46"] == want and key["SRC"] == 0
        assert grid == (min(-(-256 * 129 // 8), 132 * 16), 1, 1) and args[-2:] == [256, 257]
    qc.quantize(x[:64], None, None, None, None, None, None, 3, False, True, False, False, True)
    assert calls[-1][1]["FAST46"] == 0  # below FAST46_MIN_BLOCKS: the exact errors
    monkeypatch.setattr(qc, "STRIP16", False)
    qc.quantize(x, None, None, None, None, None, None, 0, False, False, False, False, True)
    assert calls[-1][0] == "nvfp4_quant_tile16"
    assert calls[-1][1]["FAST46"] == 0 and calls[-1][1]["RULE46"] == 0
    # rule 6 on the strip kernel: 16 block columns a warp (bfloat16; float32 8), 17 strips a tile row here
    monkeypatch.setattr(qc, "STRIP16", True)
    for dtype, per in ((torch.bfloat16, 16), (torch.float32, 8)):
        qc.quantize(x.to(dtype), None, None, None, None, None, None, 2, False, False, False, True, True)
        name, key, grid, args = calls[-1]
        assert name == "nvfp4_quant_strip16" and key["RULE46"] == 0 and key["NONFINITE"] == 1
        assert grid == (-(-256 * -(-257 // per) // 8), 1, 1) and args[-2:] == [256, 257]
    # 4 tile pairs a warp (TILE_U): a quarter of the CTAs, the compile key says so; 3 is refused
    monkeypatch.setattr(qc, "TILE16_U", 4)
    qc.quantize(x, None, None, None, None, None, None, 0, False, True, False, False, True)
    name, key, grid, args = calls[-1]
    assert name == "nvfp4_quant_tile16" and key["TILE_U"] == 4
    assert grid == (min(-(-256 * 129 // 32), 132 * 16), 1, 1)
    # staged through shared memory where a tile row's pairs (129 here) are a multiple of TILE16_U
    monkeypatch.setattr(qc, "TILE16_SMEM", True)
    qc.quantize(x, None, None, None, None, None, None, 0, False, True, False, False, True)
    assert "TILE_SMEM" not in calls[-1][1]
    qc.quantize(x[:, :4096], None, None, None, None, None, None, 0, False, True, False, False, True)
    assert calls[-1][1]["TILE_SMEM"] == 1 and calls[-1][1]["TILE_U"] == 4
    qc.quantize(x[:, :4096].float(), None, None, None, None, None, None, 0, False, True, False, False, True)
    assert "TILE_SMEM" not in calls[-1][1]  # (float32 at 4 pairs: over 48 KB of shared memory)
    monkeypatch.setattr(qc, "TILE16_SMEM", False)
    monkeypatch.setattr(qc, "TILE16_U", 3)
    with pytest.raises(ValueError, match="TILE16_U"):
        qc.quantize(x, None, None, None, None, None, None, 0, False, True, False, False, True)
    monkeypatch.setattr(qc, "TILE16_U", 1)
    with pytest.raises(ValueError, match="multiples of 16 and one scale"):
        qc.quantize(x[:40], None, None, None, None, None, None, 0, False, True, False, False, True)
    with pytest.raises(ValueError, match="multiples of 16 and one scale"):
        qc.quantize(x, None, None, None, None, None, None, 1, False, True, False, False, True)


def test_fast46_env_is_checked(monkeypatch):
    monkeypatch.setenv("FP4RL_QUANT_FAST46", "4")
    with pytest.raises(ValueError, match="FP4RL_QUANT_FAST46='4': use 3"):
        qc._fast46_from_env()
    monkeypatch.setenv("FP4RL_QUANT_FAST46", "0")
    assert qc._fast46_from_env() == 0
