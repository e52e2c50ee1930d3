"""fp4rl.kernels.moe_route_cuda (the CUDA router + route: x @ Wr.T, the top-k and the grouping by expert in
one cluster launch) against its reference and torch: the reference's arithmetic (the router's sums in the
kernel's lane order, then torch's route and grouping), ties and NaN rows, the plan and the refusals;
KernelMoeBlock's ROUTER_CUDA path and its norm_routed_parts (on a CPU the reference stands in for the kernel).
On the GPU (-m gpu) the kernel against its reference bit for bit, also under PDL in a CUDA graph. The Triton
route and the rest of KernelMoeBlock: tests/test_moe_route.py (its helpers are shared). On a machine without
CUDA the Triton kernels run in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from test_moe_route import DEV, MOE, _kernel_moe_block, check_route_outputs  # noqa: E402

from fp4rl import gpu_experts  # noqa: E402
from fp4rl.kernels import moe_route  # noqa: E402


def _with_and_without_router_cuda(block, x, router_route, monkeypatch):
    """block(x) with ROUTER_CUDA (moe_route_cuda.router_route replaced by `router_route`, its failure state
    cleared) and without: (y, experts, y_triton, experts_triton); the fused router's defaults set here (the
    environment may not)."""
    from fp4rl.kernels import moe_route_cuda

    monkeypatch.setattr(moe_route_cuda, "router_route", router_route)
    monkeypatch.setattr(gpu_experts, "FUSED_ROUTER", True)
    monkeypatch.setattr(gpu_experts, "ROUTER_MAX_TOKENS", 8)
    monkeypatch.setattr(gpu_experts, "ROUTER_CUDA_MAX_TOKENS", 8)
    monkeypatch.setitem(moe_route_cuda.STATE, "ok", None)
    with torch.inference_mode():
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA", True)
        y, experts = block(x)
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA", False)
        y_triton, experts_triton = block(x)
    return y, experts, y_triton, experts_triton


@pytest.mark.parametrize("contract", ["bf16", "nvfp4-w4a16"])
def test_kernel_moe_block_takes_the_cuda_router_route_where_it_runs(contract, monkeypatch):
    """ROUTER_CUDA: the decode-sized forward routes through moe_route_cuda.router_route where the kernel runs
    and its plan takes the router (on a CPU its reference stands in for it: the kernel's arithmetic), and the
    block's output is the experts' on that route: the Triton router_route's choice here, weights within a bf16
    ulp. A kernel failure outside a graph capture turns it off with a warning; the Triton kernel routes."""
    from fp4rl.kernels import moe_route_cuda

    block, x = _kernel_moe_block(contract, MOE)
    calls = []

    def fake(xx, w, k, norm, weight_dtype=None):
        calls.append((tuple(xx.shape), k, norm, weight_dtype))
        return moe_route_cuda.reference(xx, w, k, norm)

    monkeypatch.setattr(moe_route_cuda, "available", lambda device=None:
                        moe_route_cuda.STATE["ok"] is not False)
    y, experts, y_triton, experts_triton = _with_and_without_router_cuda(block, x, fake, monkeypatch)
    with torch.inference_mode():
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA", True)

        def broken(*args, **kwargs):
            calls.append("broken")
            raise RuntimeError("no cluster launch here")

        monkeypatch.setattr(moe_route_cuda, "router_route", broken)
        with pytest.warns(UserWarning, match="no cluster launch here"):
            y_failed, _ = block(x)
        y_after, _ = block(x)  # off for good: the kernel is not tried again
    assert calls == [((3, 64), 2, True, torch.bfloat16), "broken"], calls
    assert torch.equal(experts, experts_triton)
    assert torch.allclose(y.float(), y_triton.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(y_failed, y_triton) and torch.equal(y_after, y_triton)
    assert moe_route_cuda.STATE["ok"] is False


def test_the_cuda_router_route_takes_only_up_to_its_token_bound(monkeypatch):
    """ROUTER_CUDA_MAX_TOKENS: above it (where the kernel no longer made the 30B's step faster) the Triton
    router_route routes, with the same experts and output; at or below it the CUDA kernel does."""
    from fp4rl.kernels import moe_route_cuda

    block, x = _kernel_moe_block("nvfp4-w4a16", MOE)  # 3 tokens
    calls = []

    def fake(xx, w, k, norm, weight_dtype=None):
        calls.append(xx.shape[0])
        return moe_route_cuda.reference(xx, w, k, norm)

    monkeypatch.setattr(moe_route_cuda, "available", lambda device=None: True)
    monkeypatch.setattr(moe_route_cuda, "router_route", fake)
    monkeypatch.setattr(gpu_experts, "FUSED_ROUTER", True)
    monkeypatch.setattr(gpu_experts, "ROUTER_MAX_TOKENS", 8)
    monkeypatch.setattr(gpu_experts, "ROUTER_CUDA", True)
    runs = {}
    for bound in (2, 3):
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA_MAX_TOKENS", bound)
        with torch.inference_mode():
            runs[bound] = block(x)
    assert calls == [3], calls  # bound 2: not called for 3 tokens; bound 3: called once
    assert torch.equal(runs[2][1], runs[3][1])
    assert torch.allclose(runs[2][0].float(), runs[3][0].float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
def test_gpu_kernel_moe_block_with_the_cuda_router_route(monkeypatch):
    """On the GPU: the block with ROUTER_CUDA runs the kernel itself (once, without failing), chooses the
    Triton router_route's experts and gives its output within a bf16 ulp; its route is the kernel
    reference's."""
    from fp4rl.kernels import moe_route_cuda

    if not moe_route_cuda.available():
        pytest.skip("needs an sm_90 GPU and NVRTC")
    block, x = _kernel_moe_block("nvfp4-w4a16", MOE)
    calls = []
    real = moe_route_cuda.router_route
    y, experts, y_triton, experts_triton = _with_and_without_router_cuda(
        block, x, lambda *a, **kw: calls.append(1) or real(*a, **kw), monkeypatch)
    assert calls == [1] and moe_route_cuda.STATE["ok"] is True, moe_route_cuda.STATE
    assert torch.equal(experts, experts_triton)
    assert torch.allclose(y.float(), y_triton.float(), rtol=2 ** -7, atol=1e-6)
    want = moe_route_cuda.reference(x[:, 0].contiguous(), block.gate.weight, block.top_k,
                                    block.norm_topk_prob)
    assert torch.equal(experts[:, 0], want[1])


def _router_operands(t, e, h, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * scale).bfloat16().to(DEV)
    wr = (torch.randn(e, h, generator=g) * 0.2).bfloat16().to(DEV)
    return x, wr


def _scalar_logit(x, wr, t, e):
    """One router sum (fp32, before the bf16 rounding) in moe_router_route.cu's order, scalar by scalar in
    numpy float32: lane l sums its chunks l + 32 i (i ascending, the 8 products of a chunk in order), the xor
    butterfly adds the lanes."""
    import numpy as np

    xs, ws = x[t].float().cpu().numpy(), wr[e].float().cpu().numpy()
    h = xs.shape[0]
    lanes = []
    for lane in range(32):
        acc = np.float32(0.0)
        for i in range(-(-h // 256)):
            c = lane + 32 * i
            for el in range(8 if 8 * c < h else 0):
                acc = np.float32(acc + np.float32(xs[8 * c + el] * ws[8 * c + el]))
        lanes.append(acc)
    for m in (16, 8, 4, 2, 1):
        lanes = [np.float32(lanes[lane] + lanes[lane ^ m]) for lane in range(32)]
    return float(lanes[0])


@pytest.mark.parametrize("t,e,k,h,norm", [(1, 128, 8, 2048, True), (8, 128, 8, 2048, True),
                                          (3, 60, 4, 296, False), (2, 8, 2, 576, True), (5, 33, 16, 64, True),
                                          (4, 256, 6, 1024, True), (1, 20, 1, 8, False)])
def test_cuda_router_route_reference_is_the_router_and_the_torch_route(t, e, k, h, norm):
    """moe_route_cuda.reference (the CUDA kernel's arithmetic, which the GPU test holds the kernel to bit for
    bit): logits one bf16 rounding from the fp32 x @ Wr.T, in the kernel's lane order (a scalar emulation of
    two logits); its route is torch's route of those logits (check_route_outputs: top-k, ties, weights within
    a bf16 ulp, the stable grouping)."""
    from fp4rl.kernels import moe_route_cuda

    assert moe_route_cuda.plan(t, k, e, h) is not None
    x, wr = _router_operands(t, e, h, seed=t * 7 + e + h)
    logits, idx, w, rows, pos, offs = moe_route_cuda.reference(x, wr, k, norm)
    ref = x.float() @ wr.float().t()
    ulp = torch.maximum(ref.abs(), torch.full_like(ref, 2.0 ** -126)) * 2.0 ** -7
    assert logits.dtype == torch.bfloat16 and logits.shape == (t, e)
    assert bool(((logits.float() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()), "not x @ Wr.T"
    sums = moe_route_cuda._sums(x, wr)  # fp32, before the rounding: the order shows in the last bits
    for tt, ee in ((0, 0), (t - 1, e - 1), (t // 2, e // 3)):
        assert _scalar_logit(x, wr, tt, ee) == float(sums[tt, ee]), (tt, ee)
    assert torch.equal(sums.bfloat16(), logits)
    check_route_outputs(logits, k, norm, (idx, w, rows, pos, offs))
    assert idx.dtype == torch.int64 and w.dtype == torch.bfloat16
    assert rows.dtype == pos.dtype == offs.dtype == torch.int32


def test_cuda_router_route_reference_ties_and_nan_rows():
    """All-zero logits (x = 0): every probability tied, the lowest ids in order, weights 1/k; a NaN in x makes
    its token's logits NaN: the lowest ids, NaN weights (moe_route.route's rules); an infinite logit too."""
    from fp4rl.kernels import moe_route_cuda

    x, wr = _router_operands(4, 16, 64, seed=3)
    x[0] = 0.0
    x[2, 5] = float("nan")
    x[3] = 0.0
    wr[:, 0] = 0.0
    x[3, 0], wr[7, 0] = 3e38, 2.0  # logit (3, 7) overflows to +inf, the row's others are 0
    logits, idx, w, rows, pos, offs = moe_route_cuda.reference(x, wr, 4, True)
    assert idx[0].tolist() == [0, 1, 2, 3] and torch.equal(w[0].float(), torch.full((4,), 0.25, device=DEV))
    assert bool(logits[2].isnan().all()) and bool(logits[3, 7].isinf()) and int(logits[3].isnan().sum()) == 0
    for row in (2, 3):
        assert idx[row].tolist() == [0, 1, 2, 3] and bool(w[row].isnan().all()), row
    assert not bool(w[:2].isnan().any())
    assert int(offs[-1]) == 16 and sorted(pos.tolist()) == list(range(16))
    ref = moe_route.route(logits, 4, True)  # the Triton route on the same logits: the same NaN-row rule
    assert torch.equal(ref[0][2:], idx[2:]) and bool(ref[1][2:].isnan().all())


def test_cuda_router_route_plan_and_refusals():
    """The 30B router's build; what the kernel does not take (the caller keeps the Triton router_route)."""
    from fp4rl.kernels import moe_route_cuda

    assert moe_route_cuda.plan(1, 8, 128, 2048) == {"T": 1, "E": 128, "H": 2048, "K": 8, "EPW": 2, "NCH": 8,
                                                    "CL": 8}
    assert moe_route_cuda.plan(8, 4, 60, 2048)["CL"] == 8 and moe_route_cuda.plan(2, 2, 8, 576)["CL"] == 1
    assert moe_route_cuda.smem_bytes(moe_route_cuda.plan(8, 8, 128, 2048)) == 16 * 32 * 8 * (8 * 2 + 8)
    for args in ((9, 8, 128, 2048), (1, 17, 128, 2048), (1, 8, 128, 2044), (1, 8, 128, 4096),
                 (1, 8, 512, 2048), (0, 8, 128, 2048), (1, 9, 8, 64)):
        assert moe_route_cuda.plan(*args) is None, args
    x, wr = _router_operands(2, 16, 64, seed=0)
    with pytest.raises(ValueError, match="CUDA device"):
        moe_route_cuda.router_route(x.cpu(), wr.cpu(), 2, True)
    with pytest.raises(TypeError, match="bfloat16"):
        moe_route_cuda.router_route(x.float(), wr, 2, True)
    with pytest.raises(TypeError, match="weight_dtype"):
        moe_route_cuda.router_route(x, wr, 2, True, weight_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[E, H\]"):
        moe_route_cuda.router_route(x, wr[:, :32], 2, True)


def test_kernel_moe_block_norm_routed_parts_is_add_rmsnorm_then_routed_parts(monkeypatch):
    """KernelMoeBlock.norm_routed_parts (the step's post-attention add + RMSNorm inside the CUDA router's
    launch; on a CPU moe_route_cuda.norm_reference stands in for the kernel): x' and y are add_rmsnorm's up to
    the norm's order, the experts and the expert outputs those of add_rmsnorm then routed_parts; where the
    CUDA router does not take the call (above its token bound, h of another dtype) it returns None; a kernel
    failure turns this launch off with a warning and returns None, the CUDA router + route alone stays on."""
    from fp4rl.kernels import fused, moe_route_cuda

    block, x = _kernel_moe_block("nvfp4-w4a16", MOE)
    x = x[:, 0]
    hh = (x * 0.5 + 0.25).bfloat16()
    from fp4rl.model import RMSNorm

    norm = RMSNorm(x.shape[1], 1e-6).bfloat16().to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(x.shape[1], generator=torch.Generator().manual_seed(3)) + 0.5)
    calls = []

    def fake(xx, h, w, eps, wr, k, nrm, weight_dtype=None):
        calls.append((tuple(xx.shape), eps, k, nrm))
        return moe_route_cuda.norm_reference(xx, h, w, eps, wr, k, nrm)

    monkeypatch.setattr(moe_route_cuda, "available",
                        lambda device=None: moe_route_cuda.STATE["ok"] is not False)
    monkeypatch.setattr(moe_route_cuda, "norm_router_route", fake)
    monkeypatch.setattr(moe_route_cuda, "router_route",
                        lambda xx, w, k, nrm, weight_dtype=None: moe_route_cuda.reference(xx, w, k, nrm))
    monkeypatch.setitem(moe_route_cuda.STATE, "ok", None)
    monkeypatch.setitem(moe_route_cuda.NORM_STATE, "ok", None)
    for name, value in (("FUSED_ROUTER", True), ("ROUTER_MAX_TOKENS", 8), ("ROUTER_CUDA", True),
                        ("ROUTER_CUDA_MAX_TOKENS", 8)):
        monkeypatch.setattr(gpu_experts, name, value)
    with torch.inference_mode():
        assert block.norm_routed_parts(x, hh.float(), norm) is None and not calls  # h not x's dtype
        xs, y, (d, pos, w, idx) = block.norm_routed_parts(x, hh, norm)
        xs2, y2, _ = fused.add_rmsnorm(x, hh, norm.weight, norm.eps)
        d2, pos2, w2, idx2 = block.routed_parts(y2)
        assert calls == [((3, 64), 1e-6, 2, True)]
        assert torch.equal(xs, xs2)
        assert int((y.view(torch.int16).int() - y2.view(torch.int16).int()).abs().max()) <= 1
        assert torch.equal(idx, idx2) and torch.equal(pos, pos2)
        assert torch.allclose(d.float(), d2.float(), rtol=2 ** -6, atol=1e-3)
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA_MAX_TOKENS", 2)  # 3 tokens: not the CUDA launch
        assert block.norm_routed_parts(x, hh, norm) is None and len(calls) == 1
        monkeypatch.setattr(gpu_experts, "ROUTER_CUDA_MAX_TOKENS", 8)

        def broken(*args, **kwargs):
            raise RuntimeError("no cluster launch here")

        monkeypatch.setattr(moe_route_cuda, "norm_router_route", broken)
        with pytest.warns(UserWarning, match="no cluster launch here"):
            assert block.norm_routed_parts(x, hh, norm) is None
        assert moe_route_cuda.NORM_STATE["ok"] is False and block.norm_routed_parts(x, hh, norm) is None
        assert moe_route_cuda.STATE["ok"] is not False  # the router + route alone stays on
        assert block.routed_parts(y2) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("asy", [False, True], ids=["cluster-barrier", "st-async"])
@pytest.mark.parametrize("t,e,k,h", [(1, 128, 8, 2048), (4, 128, 8, 2048), (8, 128, 8, 2048), (3, 60, 4, 296),
                                     (2, 64, 4, 4096)])
def test_gpu_cuda_norm_router_route_is_its_reference_bit_for_bit(t, e, k, h, asy, monkeypatch):
    """The PRENORM kernel against moe_route_cuda.norm_reference on the same GPU (torch's sqrt and division
    there are IEEE, as the kernel's __fsqrt_rn / __fdiv_rn): x', y and every route output equal, for two
    inputs in a row (a call that wrote nothing would leave the first one's outputs), the second's h a
    strided view."""
    from fp4rl.kernels import moe_route_cuda

    if not moe_route_cuda.available():
        pytest.skip("needs an sm_90 GPU and NVRTC")
    monkeypatch.setattr(moe_route_cuda, "ASYNC_LOGITS", asy)
    x0, wr = _router_operands(t, e, h, seed=t + e + h)
    g = torch.Generator().manual_seed(h)
    h0 = (torch.randn(t, h, generator=g) * 0.5).bfloat16().to("cuda")
    nw = (torch.rand(h, generator=g) + 0.5).bfloat16().to("cuda")
    wide = torch.zeros(t, h + 64, dtype=torch.bfloat16, device="cuda")
    for i, sign in enumerate((1.0, -0.5)):
        x, hh = (x0 * sign).bfloat16(), (h0 * sign).bfloat16()
        hv = hh if i == 0 else wide[:, :h].copy_(hh)
        got = moe_route_cuda.norm_router_route(x, hv, nw, 1e-6, wr, k, True)
        want = moe_route_cuda.norm_reference(x, hh, nw, 1e-6, wr, k, True)
        for name, a, b in zip(("x'", "y", "logits", "idx", "w", "rows", "pos", "offsets"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) \
                if a.is_floating_point() else torch.equal(a, b)
            assert same, (name, a, b)
        check_route_outputs(got[2], k, True, got[3:])


@pytest.mark.gpu
@pytest.mark.parametrize("asy", [False, True], ids=["cluster-barrier", "st-async"])
@pytest.mark.parametrize("t,e,k,h,norm", [(1, 128, 8, 2048, True), (8, 128, 8, 2048, True),
                                          (3, 60, 4, 296, False), (2, 8, 2, 576, True), (5, 33, 16, 64, True),
                                          (4, 256, 6, 1024, True), (7, 128, 8, 1024, True)])
def test_gpu_cuda_router_route_is_its_reference_bit_for_bit(t, e, k, h, norm, asy, monkeypatch):
    """The kernel against moe_route_cuda.reference on the same GPU (torch's exp there is libdevice's expf):
    every output equal for three inputs in a row (a call that wrote nothing would leave the last one's
    outputs), the second a strided view, the third a view the kernel cannot read in place (its start 2 bytes
    off 16: the launcher copies it); with ties (x = 0) and a NaN row. 7 tokens at H 1024: 46 KB of dynamic and
    4 KB of static shared memory (past 48 KB only with the opt-in). Both hand-offs of the logits to CTA 0."""
    from fp4rl.kernels import moe_route_cuda

    if not moe_route_cuda.available():
        pytest.skip("needs an sm_90 GPU and NVRTC")
    monkeypatch.setattr(moe_route_cuda, "ASYNC_LOGITS", asy)
    x0, wr = _router_operands(t, e, h, seed=t + e + h)
    if t > 2:
        x0[0] = 0.0
        x0[1, h // 2] = float("nan")
    wide = torch.zeros(t, h + 64, dtype=torch.bfloat16, device="cuda")
    views = (lambda v: v, lambda v: wide[:, :h].copy_(v), lambda v: wide[:, 1:h + 1].copy_(v))
    for i, (view, sign) in enumerate(zip(views, (1.0, -1.0, 0.5))):
        x = (x0 * sign).bfloat16()
        xs = view(x)
        assert moe_route_cuda.aligned(xs) == (i < 2) and torch.equal(xs.isnan(), x.isnan())
        got = moe_route_cuda.router_route(xs, wr, k, norm)
        want = moe_route_cuda.reference(x, wr, k, norm)
        for name, a, b in zip(("logits", "idx", "w", "rows", "pos", "offsets"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if a.is_floating_point():
                same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            else:
                same = torch.equal(a, b)
            assert same, (name, a, b)
    if t <= 2:
        check_route_outputs(got[0], k, norm, got[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_cuda_router_route_under_pdl_reads_the_new_x(t, monkeypatch):
    """In a CUDA graph inside pdl.step(): a fused add_rmsnorm (PDL, its trigger at its start) writes x, then
    the router + route launches with PDL and reads its weight before the wait, x after it; each replay's new
    input must give the route of the new x (the reference's outputs), never the previous replay's."""
    from fp4rl.kernels import fused, moe_route_cuda, pdl

    if not moe_route_cuda.available() or not pdl.triton_flag("cuda"):
        pytest.skip("needs an sm_90 GPU, PDL in Triton and NVRTC")
    # a decode-copy hazard an earlier test left pending (no GEMM took it) would turn PDL off for the route
    monkeypatch.setitem(pdl._STATE, "hazard", False)
    with pdl.step():
        assert pdl.weights_flag("cuda", "route"), "the route's launch must carry PDL here (FP4RL_PDL_OFF?)"
    h, e, k = 2048, 128, 8
    _, wr = _router_operands(t, e, h, seed=11)
    nw = torch.ones(h, dtype=torch.bfloat16, device="cuda")
    a = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda")

    def step():
        with pdl.step():
            _, n, _ = fused.add_rmsnorm(a, b, nw, 1e-6)
            return n, moe_route_cuda.router_route(n, wr, k, True)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        n, outs = step()
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        a.copy_(torch.randn(t, h, generator=g).bfloat16())
        b.copy_(torch.randn(t, h, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want = moe_route_cuda.reference(n.clone(), wr, k, True)
        for name, u, v in zip(("logits", "idx", "w", "rows", "pos", "offsets"), outs, want):
            assert torch.equal(u, v), name
