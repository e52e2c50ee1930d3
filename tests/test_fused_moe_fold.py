"""The MoE combine folded into the residual add + RMSNorm (fused.add_rmsnorm's moe=(d, pos, w)): bit for bit
moe_route.combine then add_rmsnorm, with the route kernel's outputs, strides, NaN rows, every quantizer and
row split; the refusals; on the GPU (-m gpu) Qwen3-30B-A3B's widths and the fold in a PDL chain replayed from
a CUDA graph. The other fused kernels: tests/test_fused_kernels.py (its helpers are shared)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from test_fused_kernels import (  # noqa: E402
    DEV,
    QUANTS,
    _bf16,
    _bits_eq,
    _check_pdl_graph,
    _gen,
    _nan_eq,
    _norm,
    _q_eq,
    _quiet,  # noqa: F401  (the shared autouse fixture: quiet numpy warnings under the interpreter)
    assert_bytes,
    assert_norm_close,
)

from fp4rl.kernels import fused, moe_route  # noqa: E402


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
