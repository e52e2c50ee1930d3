"""fp4rl.kernels.moe_route (the decode step's MoE route and combine kernels) against torch: the router's
top-k and weights (SparseMoeBlock.route), the stable grouping by expert that KernelMoeBlock.run_experts
builds with argsort + searchsorted, and the weighted combine; then KernelMoeBlock's fused forward against
its torch-routed forward. The CUDA router + route (moe_route_cuda): tests/test_moe_route_cuda.py. On a machine
without CUDA the kernels run in Triton's interpreter."""

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
