"""fp4rl.kernels.moe_route (the decode step's MoE route and combine kernels) against torch: the router's
top-k and weights (SparseMoeBlock.route), the stable grouping by expert that KernelMoeBlock.run_experts
builds with argsort + searchsorted, and the weighted combine; then KernelMoeBlock's fused forward against
its torch-routed forward. On a machine without CUDA the kernels run in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl import gpu_experts  # noqa: E402
from fp4rl.kernels import moe_route  # noqa: E402
from fp4rl.model import CausalLM, ModelConfig  # noqa: E402
from fp4rl.moe import SparseMoeBlock  # noqa: E402
from fp4rl.precision import PrecisionContract  # noqa: E402
from fp4rl.qat import convert  # noqa: E402
from fp4rl.sampler import Sampler  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(t, e, seed, dtype=torch.bfloat16, scale=2.0):
    return (torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


def check_route(lg, k, norm):
    return check_route_outputs(lg, k, norm, moe_route.route(lg, k, norm, weight_dtype=torch.bfloat16))


def check_route_outputs(lg, k, norm, outs):
    """outs = (idx, w, rows, pos, offsets), a route of the logits lg [T, E], against torch's: the top-k
    probabilities in descending order (ids equal where no tie), the weights within a bf16 ulp, the stable
    grouping by expert of run_experts (argsort, searchsorted)."""
    t, e = lg.shape
    idx, w, rows, pos, offs = outs
    probs = torch.softmax(lg.float(), -1)
    ref_w, ref_i = torch.topk(probs, k, dim=-1)
    # the chosen probabilities are torch's top-k values, descending (ids can differ only at exact ties)
    got = probs.gather(-1, idx)
    assert torch.allclose(got, ref_w, rtol=1e-6, atol=0), "not the top-k probabilities"
    assert bool((got[:, :-1] >= got[:, 1:]).all()), "top-k not in descending order"
    assert all(len(set(r.tolist())) == k for r in idx.cpu()), "an expert chosen twice"
    same = (probs.unsqueeze(-1) == ref_w.unsqueeze(-2)).sum(-2)  # [T, k]: experts with each top-k value
    untied = (same == 1).all(-1)  # rows whose top-k values are each held by one expert
    assert torch.equal(idx[untied], ref_i[untied])
    # weights: the module's arithmetic on the kernel's choice, in bfloat16 (the kernel's sum is sequential)
    sel = got.clone()
    if norm:
        total = torch.zeros(t, device=lg.device)
        for j in range(k):
            total = total + sel[:, j]
        sel = sel / total[:, None]
    assert bool(((w.float() - sel.bfloat16().float()).abs() <= 2 ** -8 * sel.abs()).all())  # one bf16 ulp
    # the grouping: run_experts' stable argsort of the kernel's own ids, and its searchsorted offsets
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(rows.long(), order // k)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(t * k, device=lg.device)
    assert torch.equal(pos.long(), inv)
    ref_offs = torch.searchsorted(flat[order], torch.arange(e + 1, device=lg.device)).int()
    assert torch.equal(offs, ref_offs)
    return idx, w, rows, pos, offs


@pytest.mark.parametrize("t,e,k,norm", [(1, 16, 2, True), (3, 8, 8, True), (5, 20, 4, False),
                                        (32, 128, 8, True), (7, 60, 6, True)])
def test_route_is_the_torch_route_and_grouping(t, e, k, norm):
    check_route(_logits(t, e, seed=t * 1000 + e), k, norm)


def test_route_with_ties_and_float32_logits():
    lg = torch.zeros(4, 16, device=DEV)  # every probability tied: the lowest ids, in order
    lg[1, 5] = 3.0
    idx, w, _, _, offs = check_route(lg, 4, True)
    assert idx[0].tolist() == [0, 1, 2, 3] and idx[1].tolist() == [5, 0, 1, 2]
    assert torch.equal(w[0].float(), torch.full((4,), 0.25, device=DEV))
    check_route(_logits(9, 32, seed=3, dtype=torch.float32), 3, True)


def test_route_nan_logits_stay_in_range():
    lg = _logits(4, 16, seed=1)
    lg[2] = float("nan")
    lg[3, 5] = float("inf")
    idx, w, rows, pos, offs = moe_route.route(lg, 4, True)
    assert int(idx.min()) >= 0 and int(idx.max()) < 16, "a NaN row must not index past the experts"
    assert idx[2].tolist() == [0, 1, 2, 3] and idx[3].tolist() == [0, 1, 2, 3], "NaN rows: distinct ids"
    assert bool(w[2:].isnan().all()) and not bool(w[:2].isnan().any()), "NaN rows: NaN weights, as torch's"
    assert int(offs[-1]) == 16 and sorted(pos.tolist()) == list(range(16))
    assert sorted(rows.tolist()) == sorted([r for r in range(4) for _ in range(4)])


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (8, 128, 8), (5, 20, 4), (3, 8, 8), (2, 60, 1), (16, 33, 6)])
def test_route_keyed_top_k_is_the_two_pass_top_k(t, e, k):
    """The top-k on packed (probability bits, reversed id) keys: the outputs of the two-pass arg-max form,
    with ties (an all-zero row: every probability equal), a NaN row, fp32 and bf16 weights, with and without
    the normalization; the default form is the keyed one."""
    assert moe_route.KEYED_TOPK
    lg = _logits(t, e, seed=t * 31 + e, scale=3.0)
    lg[0] = 0.0
    if t > 2:
        lg[1, e // 2] = float("nan")
    for norm in (True, False):
        for wd in (torch.bfloat16, torch.float32):
            a = moe_route.route(lg, k, norm, weight_dtype=wd, keyed=True)
            b = moe_route.route(lg, k, norm, weight_dtype=wd, keyed=False)
            for u, v in zip(a, b):
                assert torch.equal(u.isnan(), v.isnan()) if u.is_floating_point() else True
                assert torch.equal(torch.nan_to_num(u), torch.nan_to_num(v))
    assert a[0][0].tolist() == list(range(k)), "tied probabilities: the lowest ids, in order"


def test_route_refuses_what_it_does_not_fit():
    assert moe_route.fits(64, 8, 128) and not moe_route.fits(65, 8, 128) and not moe_route.fits(2, 9, 8)
    assert not moe_route.fits(512, 1, 512)  # the softmax / top-k tile would not fit one program
    with pytest.raises(ValueError, match="torch route"):
        moe_route.route(_logits(200, 16, seed=0), 8, True)
    with pytest.raises(ValueError, match="unit column stride"):
        moe_route.route(_logits(16, 4, seed=0).t(), 2, True)


@pytest.mark.parametrize("tile", [{}, {"bh": 32, "hc": 64}, {"bh": 16, "hc": 4096}])
@pytest.mark.parametrize("t,e,k,h", [(1, 16, 2, 96), (8, 20, 4, 300), (33, 128, 8, 64), (3, 60, 6, 512)])
def test_router_route_is_the_router_then_the_route(t, e, k, h, tile):
    """Every column split: one slice (hc >= H), the default, and slices of 64 columns (300: four full, one of
    44), whose partial sums the last program adds."""
    g = torch.Generator().manual_seed(t * 7 + e)
    x = (torch.randn(t, h, generator=g) * 0.5).bfloat16().to(DEV)
    wr = (torch.randn(e, h, generator=g) * 0.2).bfloat16().to(DEV)
    for _ in range(2):  # the second call finds the counter back at zero
        logits, idx, w, rows, pos, offs = moe_route.router_route(x, wr, k, True, **tile)
        ref = (x.float() @ wr.float().t())  # fp32 sums of exact products: one rounding away from the kernel's
        ulp = torch.maximum(ref.abs(), torch.full_like(ref, 2.0 ** -126)) * 2.0 ** -7
        assert logits.dtype == torch.bfloat16 and logits.shape == (t, e)
        assert bool(((logits.float() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()), "not x @ Wr.T"
        want = check_route(logits, k, True)  # the route of those logits, by the one-program kernel
        for a, b in zip((idx, w, rows, pos, offs), want):
            assert torch.equal(a, b), "the fused route must be route() of the fused logits"
    assert int(moe_route._LOCKS[x.device].item()) == 0


def test_router_route_refuses_bad_operands():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(TypeError, match="bfloat16"):
        moe_route.router_route(x.float(), torch.zeros(8, 32, device=DEV), 2, True)
    with pytest.raises(ValueError, match=r"\[E, H\]"):
        moe_route.router_route(x, torch.zeros(8, 16, dtype=torch.bfloat16, device=DEV), 2, True)
    with pytest.raises(ValueError, match="powers of two"):
        moe_route.router_route(x, torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV), 2, True, bes=8)
    with pytest.raises(ValueError, match="int32 \\[1\\] counter"):
        moe_route.router_route(x, torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV), 2, True,
                               lock=torch.zeros(1, device=DEV))
    with pytest.raises(ValueError, match="multiple of bh=32"):
        moe_route.router_route(x, torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV), 2, True, bh=32, hc=48)
    with pytest.raises(ValueError, match="torch route"):
        moe_route.router_route(torch.zeros(200, 32, dtype=torch.bfloat16, device=DEV),
                               torch.zeros(8, 32, dtype=torch.bfloat16, device=DEV), 8, True)


def test_combine_is_the_weighted_sum_in_pair_order():
    t, k, h = 6, 4, 96
    lg = _logits(t, 16, seed=5)
    _, w, _, pos, _ = moe_route.route(lg, k, True)
    d = torch.randn(t * k, h, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    y = moe_route.combine(d, pos, w)
    acc = torch.zeros(t, h, device=DEV)
    for j in range(k):  # products rounded to fp32, added in slot order, one rounding at the end
        acc = acc + w[:, j].float()[:, None] * d[pos.view(t, k)[:, j].long()].float()
    assert torch.equal(y, acc.bfloat16())
    with pytest.raises(ValueError, match="T k"):
        moe_route.combine(d[:-1], pos, w)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_prenorm_combine_is_add_rmsnorm_with_the_moe_combine(w_dtype):
    """prenorm.reference(moe=) (the PRENORM 2 GEMM's arithmetic): its combine is moe_route.combine's bits, its
    x' = bf16(x + combine) fused.add_rmsnorm(moe=)'s bit for bit, its y within a bf16 ulp of add_rmsnorm's
    (the sum of squares' order, IEEE sqrt and division) and equal in >= 98% of the elements."""
    from fp4rl.kernels import fused, prenorm

    t, k, h = 3, 8, 512
    lg = _logits(t, 32, seed=7)
    _, w, _, pos, _ = moe_route.route(lg, k, True)
    w = w.to(w_dtype)
    gen = torch.Generator().manual_seed(3)
    d = torch.randn(t * k, h, generator=gen).bfloat16().to(DEV)
    x = (torch.randn(t, h, generator=gen) * 3).bfloat16().to(DEV)
    nw = (torch.rand(h, generator=gen) + 0.5).bfloat16().to(DEV)
    assert torch.equal(prenorm.combine(d, pos, w), moe_route.combine(d, pos, w))
    xs, y = prenorm.reference(x, None, nw, 1e-6, moe=(d, pos, w))
    xo, yo, _ = fused.add_rmsnorm(x, None, nw, 1e-6, moe=(d, pos, w))
    assert torch.equal(xs, xo)
    a, b = y.view(torch.int16).int(), yo.view(torch.int16).int()
    assert int((a - b).abs().max()) <= 1 and (y == yo).float().mean().item() >= 0.98


MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
           qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


SHARED = dict(MOE, model_type="qwen2_moe", qk_norm=False, shared_expert_intermediate_size=48,
              norm_topk_prob=False)


def _kernel_moe_block(contract, config):
    """The sampler's KernelMoeBlock of a one-layer model, and 3 tokens x [3, 1, H] without tied router
    probabilities (with ties either id is a valid top-k; check_route covers ties)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    model = convert(model.to(torch.bfloat16).eval(), PrecisionContract(contract, bf16_last_fraction=0.0))
    sampler = Sampler(model, kernels=True, device=DEV, dtype=torch.bfloat16)
    block = sampler.model.model.layers[0].mlp
    assert isinstance(block, gpu_experts.KernelMoeBlock) and block.plan is not None
    x0 = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    for scale in (1.0, 1.37, 0.71, 1.9):
        x = (x0 * scale).bfloat16()
        with torch.inference_mode():
            probs = torch.softmax(block.gate(x[:, 0]).float(), -1).cpu()
        if all(len(set(r.tolist())) == r.numel() for r in probs):
            return block, x
    pytest.fail("every scaled input has tied router probabilities")


@pytest.mark.parametrize("contract,config", [("bf16", MOE), ("nvfp4-w4a16", MOE), ("nvfp4-w4a16", SHARED),
                                             ("bf16", dict(MOE, norm_topk_prob=False))])
def test_kernel_moe_block_fused_route_computes_the_torch_route(contract, config, monkeypatch):
    block, x = _kernel_moe_block(contract, config)
    monkeypatch.setattr(gpu_experts, "FUSED_ROUTER", True)  # the defaults (set here: the environment may not)
    monkeypatch.setattr(gpu_experts, "ROUTER_MAX_TOKENS", 8)
    calls = []
    real, real_rr = moe_route.route, moe_route.router_route
    monkeypatch.setattr(moe_route, "route", lambda *a, **kw: calls.append("route") or real(*a, **kw))
    monkeypatch.setattr(moe_route, "router_route", lambda *a, **kw: calls.append("rr") or real_rr(*a, **kw))
    with torch.inference_mode():
        y, experts = block(x)
        y_forced, _ = block(x, experts)  # routing replay takes the torch route
        monkeypatch.setattr(gpu_experts, "FUSED_ROUTER", False)
        y_router, experts_router = block(x)  # the module's gate, then the route kernel
        monkeypatch.setattr(gpu_experts, "FUSED_ROUTER", True)
        monkeypatch.setattr(gpu_experts, "ROUTER_MAX_TOKENS", 2)
        y_bound, experts_bound = block(x)  # 3 tokens, above the bound: the gate module, then the route kernel
        monkeypatch.setattr(gpu_experts, "ROUTER_MAX_TOKENS", 8)
        monkeypatch.setattr(gpu_experts, "FUSED_GATHER", False)
        y_gathered, _ = block(x)  # x.index_select(0, rows) before the grouped GEMM instead of in it
        monkeypatch.setattr(gpu_experts, "FUSED_GATHER", True)
        monkeypatch.setattr(gpu_experts, "FUSED_ROUTE", False)
        y_ref, experts_ref = block(x)  # the torch route, the same grouped experts
        flat = x[:, 0]
        idx, w = SparseMoeBlock.route(block, flat)
        y_run = block.run_experts(flat, idx, w)  # the torch grouping and combine on the same route
        if hasattr(block, "shared_expert"):
            y_run = y_run + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    assert calls == ["rr", "route", "route", "rr"], "the decode-sized forward must take the fused router + " \
        "route (replay must not; FUSED_ROUTER=False or more tokens than ROUTER_MAX_TOKENS: the gate " \
        "module, then the route kernel)"
    assert torch.equal(y_bound, y_router) and torch.equal(experts_bound, experts_router)
    assert int(block._router_lock.item()) == 0  # the block's own counter, back at zero
    # the router's logits in the kernel's sum order: the same experts here, weights within a bf16 ulp
    assert torch.equal(experts, experts_router)
    assert torch.allclose(y.float(), y_router.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(y, y_gathered), "the grouped GEMM's own gather must equal index_select's rows"
    assert torch.equal(experts, experts_ref) and experts.dtype == torch.long
    assert y.dtype == x.dtype and y.shape == x.shape
    # only the combine's sum order over the k slots can differ: within a bf16 ulp of the torch combine
    assert torch.allclose(y[:, 0].float(), y_run.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.allclose(y.float(), y_ref.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(y_forced, y_ref)


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


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (8, 128, 8), (5, 20, 4), (3, 8, 8), (2, 60, 1), (7, 33, 6)])
def test_route_sort_from_registers_is_the_sort_from_idx(t, e, k, monkeypatch):
    """REGS: the counting sort over the ids as the program holds them (all pairs at once) gives the outputs of
    the sort that reads them back from idx in blocks, and torch's grouping; ties, a NaN row, keyed and
    two-pass top-k, the router's fused launch with column slices (routed from its sums as held) and without;
    by default only up to REGS_PAIRS cells (0: never), and never past REGS_MAX."""
    lg = _logits(t, e, seed=t * 17 + e, scale=3.0)
    lg[0] = 0.0
    if t > 2:
        lg[1, e // 3] = float("nan")
    for keyed in (True, False):
        a = moe_route.route(lg, k, True, keyed=keyed, regs=True)
        b = moe_route.route(lg, k, True, keyed=keyed, regs=False)
        for u, v in zip(a, b):
            assert torch.equal(u.isnan(), v.isnan()) if u.is_floating_point() else True
            assert torch.equal(torch.nan_to_num(u), torch.nan_to_num(v)), (keyed, u, v)
    monkeypatch.setattr(moe_route, "REGS_PAIRS", moe_route.REGS_MAX)  # the default path takes REGS
    assert moe_route._regs(t, k, None)
    check_route(_logits(t, e, seed=t * 19 + e), k, True)  # against torch's argsort / searchsorted
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, 96, generator=g) * 0.5).bfloat16().to(DEV)
    wr = (torch.randn(e, 96, generator=g) * 0.2).bfloat16().to(DEV)
    for tile in ({"bh": 32, "hc": 32}, {"bh": 16, "hc": 4096}):  # three column slices, one
        for keyed in (True, False):
            a = moe_route.router_route(x, wr, k, True, regs=True, keyed=keyed, **tile)
            b = moe_route.router_route(x, wr, k, True, regs=False, keyed=keyed, **tile)
            for u, v in zip(a, b):
                assert torch.equal(u, v), (tile, keyed)


def test_route_sort_from_registers_bounds(monkeypatch):
    monkeypatch.setattr(moe_route, "REGS_PAIRS", 0)
    assert not moe_route._regs(1, 8, None) and moe_route._regs(1, 8, True)
    monkeypatch.setattr(moe_route, "REGS_PAIRS", 16)  # (token, slot) cells: tokens to a power of two >= 2
    assert moe_route._regs(1, 8, None) and moe_route._regs(2, 8, None) and not moe_route._regs(3, 8, None)
    assert moe_route._regs(2, 5, None) and not moe_route._regs(2, 9, None)
    monkeypatch.setattr(moe_route, "REGS_PAIRS", 1 << 20)  # never past REGS_MAX
    assert moe_route._regs(16, 8, None) and not moe_route._regs(17, 8, None)
    with pytest.raises(ValueError, match="at most 128"):
        moe_route.route(_logits(17, 16, seed=0), 8, True, regs=True)


# ----------------------------------------------------------------------------- the CUDA router + route
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
